"""ssr/backends/kernels.py: the measured kernel choice, through the transformers backend (injected timings, counted
calls): nothing here depends on timings."""

from __future__ import annotations

import pytest
import torch

from ssr import SSRConfig
from ssr.backends.kernels import KERNELS, PACKED, choose_kernels
from ssr.backends.transformers import TransformersBackend, kernel_ranges
from tiny import prompt_ids, tiny_engine, tiny_model

needs_onednn = pytest.mark.skipif(PACKED not in KERNELS, reason="this torch build has no oneDNN CPU ops")


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


TIMINGS = {  # seconds per pass; at 16 rows stationary is faster by less than the margin, so F.linear stays
    "linear": {1: 1.0, 2: 2.0, 4: 3.0, 8: 3.0, 16: 3.0},
    "stationary": {1: 1.1, 2: 1.2, 4: 1.4, 8: 2.0, 16: 2.95},
}
CHOSEN = [(1, "linear"), (8, "stationary"), (None, "linear")]


def test_default_kernel_is_linear_everywhere():
    b = backend()
    assert b.kernels == [(None, "linear")]
    lane = b.new_lane()
    b.step({lane: [3, 4, 5]})
    assert set(b.kernel_calls) == {"linear"}


def test_select_kernels_follows_injected_timings():
    b = backend()
    table = b.select_kernels(timings=TIMINGS)
    assert table == b.kernels == CHOSEN
    assert kernel_ranges(table) == [("1", "linear"), ("2-8", "stationary"), ("9+", "linear")]
    decoder = sum(isinstance(m, torch.nn.Linear) for m in b.model.get_decoder().modules())
    lane = b.new_lane()
    for feed, want, decoder_kernel, head_kernel in [([3], 1, "linear", "linear"),
                                                    ([3, 4], 1, "stationary", "linear"),
                                                    ([3, 4, 5], 2, "stationary", "stationary"),
                                                    ([5] * 6, 6, "stationary", "stationary"),
                                                    ([6] * 12, 1, "linear", "linear")]:
        b.kernel_calls.clear()
        b.step({lane: feed}, {lane: want})
        expected = {decoder_kernel: decoder}
        expected[head_kernel] = expected.get(head_kernel, 0) + 1  # the output projection: ``want`` rows
        assert dict(b.kernel_calls) == expected, feed


def test_select_kernels_ignores_noise(monkeypatch):
    """Kernels within the margin of each other do not alternate from one row count to the next."""
    import ssr.backends.kernels as tr

    monkeypatch.setitem(tr.KERNELS, "other", tr._stationary)
    noisy = {"linear": {1: 2.0, 2: 2.0, 3: 2.0, 4: 1.0}, "stationary": {1: 1.0, 2: 1.01, 3: 1.0, 4: 0.99},
             "other": {1: 1.01, 2: 1.0, 3: 1.01, 4: 1.5}}
    assert backend().select_kernels(timings=noisy) == [(3, "stationary"), (None, "linear")]
    clear = {"linear": {1: 2.0, 2: 2.0}, "stationary": {1: 1.0, 2: 1.5}, "other": {1: 1.5, 2: 1.0}}
    assert backend().select_kernels(timings=clear) == [(1, "stationary"), (None, "other")]  # the largest extends


def test_two_lanes_count_rows_times_tokens():
    b = backend()
    b.select_kernels(timings=TIMINGS)
    main = b.new_lane()
    b.step({main: [3, 4, 5]}, {main: 1})
    b.fork(main)
    b.kernel_calls.clear()
    b.step({main: [6, 7]}, {main: 1})  # 2 lanes x 2 columns = 4 rows per linear call
    assert b.kernel_calls["stationary"] == sum(isinstance(m, torch.nn.Linear) for m in b.model.get_decoder().modules())


def test_kernel_choice_changes_only_rounding():
    plain, chosen = backend(3), backend(3)
    chosen.set_kernels([(1, "stationary"), (3, "linear"), (None, "stationary")])  # one row padded, several
    for b in (plain, chosen):
        b.lane = b.new_lane()
    for feed in ([3, 4, 5, 6], [7], [8, 9], [10]):
        a, c = plain.step({plain.lane: feed})[plain.lane], chosen.step({chosen.lane: feed})[chosen.lane]
        assert torch.allclose(a, c, atol=1e-4, rtol=1e-4)


def test_set_kernels_validates():
    b = backend()
    for bad in ([(2, "linear")], [(None, "nope")], [(4, "linear"), (2, "stationary"), (None, "linear")], []):
        with pytest.raises(ValueError):
            b.set_kernels(bad)


def test_select_kernels_measures_on_cpu():
    b = backend()
    timings = b.time_kernels(rows=(1, 2), reps=1)
    assert set(timings) == set(KERNELS)
    assert all(set(per) == {1, 2} and all(t > 0 for t in per.values()) for per in timings.values())


def test_packed_is_chosen_only_where_it_is_fast_for_one_row_and_overall():
    others = {"linear": {1: 1.0, 2: 2.0, 16: 3.0}, "stationary": {1: 1.1, 2: 1.2, 16: 3.5}}
    assert choose_kernels({**others, PACKED: {1: 1.02, 2: 1.3, 16: 1.5}}) == [(None, PACKED)]  # one noisy point
    assert choose_kernels({**others, PACKED: {1: 1.2, 2: 1.0, 16: 1.0}}) != [(None, PACKED)]  # plain would lose
    assert choose_kernels({**others, PACKED: {1: 1.0, 2: 3.0, 16: 4.0}}) != [(None, PACKED)]  # slower overall


@needs_onednn
def test_packed_weights_change_only_rounding_and_stay_packed():
    plain, packed = backend(3), backend(3)
    packed.set_kernels([(None, PACKED)])
    head = packed.model.get_output_embeddings()
    assert all(m.weight is None for m in packed.model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    embeddings = packed.model.get_input_embeddings().weight
    assert embeddings is not None and (head.weight is None or head.weight is embeddings)  # tied: kept, shared
    for b in (plain, packed):
        b.lane = b.new_lane()
    for feed in ([3, 4, 5, 6], [7], [8, 9], [10] * 7):  # fewer rows than the packing's are padded to it
        a, c = plain.step({plain.lane: feed})[plain.lane], packed.step({packed.lane: feed})[packed.lane]
        assert torch.allclose(a, c, atol=1e-4, rtol=1e-4)
    assert set(packed.kernel_calls) == {PACKED}
    with pytest.raises(ValueError):
        packed.set_kernels([(None, "linear")])  # the plain weights are gone
    assert packed.select_kernels() == [(None, PACKED)]  # nothing to measure the other kernels on
    with pytest.raises(ValueError):
        packed.time_kernels(rows=(1,), reps=1)


@needs_onednn
@pytest.mark.parametrize("table", [[(None, PACKED)], [(1, "stationary"), (None, "onednn")]])
def test_ssr_matches_plain_decoding_on_chosen_kernels(table):
    """Greedy SSR against plain decoding on the same backend with the measured kernels of this machine's kinds."""
    engine = tiny_engine(1, attention=0.4, scale=0.5)
    engine.backend.set_kernels(table)
    cfg = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=24, draft_start=1)
    for prompt in ("abc\nde", "hhh", "xyz"):
        engine.history.clear()
        plain = engine.generate(prompt_ids(prompt), config=SSRConfig(enabled=False, **cfg))
        ssr = engine.generate(prompt_ids(prompt), config=SSRConfig(**cfg))
        assert ssr.token_ids == plain.token_ids, prompt
        assert ssr.stats["forward_passes"] <= plain.stats["forward_passes"]
    assert set(engine.backend.kernel_calls) == {k for _, k in table}
