"""ssr/agreement.py: an output against plain decoding's under the near-tie rule (backends whose rows depend on the
batch). Pure bookkeeping: what counts as identical, as a near-tie divergence, and as a broken promise."""

from ssr.agreement import compare

PLAIN = [5, 6, 7, 8, 9]


def test_identical_outputs():
    found = compare(PLAIN, {}, list(PLAIN))
    assert found.identical and found.diverged_at is None and found.near_tie


def test_a_divergence_to_a_token_within_the_window_of_plain_is_kept():
    found = compare(PLAIN, {2: [(70, 0.07)]}, [5, 6, 70, 1, 2, 3])
    assert not found.identical and found.diverged_at == 2 and found.near_tie and found.margin == 0.07
    third = compare(PLAIN, {2: [(71, 0.01), (70, 0.05)]}, [5, 6, 70])  # three candidates within the window
    assert third.near_tie and third.margin == 0.05


def test_a_divergence_elsewhere_or_to_another_token_breaks_the_promise():
    assert not compare(PLAIN, {3: [(70, 0.07)]}, [5, 6, 70, 8, 9]).near_tie  # no near-tie noted at 2
    assert not compare(PLAIN, {2: [(71, 0.07)]}, [5, 6, 70, 8, 9]).near_tie  # 70 was not within the window


def test_an_output_that_stops_early_or_runs_on_is_not_a_near_tie():
    early = compare(PLAIN, {3: [(1, 0.01)]}, PLAIN[:3])
    assert not early.identical and not early.near_tie and early.diverged_at == 3
    late = compare(PLAIN, {}, PLAIN + [10])
    assert not late.identical and not late.near_tie and late.diverged_at == 5
