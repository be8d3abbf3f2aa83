"""ssr/backends/kernels.py: the measured kernel choice, through the transformers backend (injected timings, counted
calls): nothing here depends on timings."""

from __future__ import annotations

import pytest
import torch

from ssr.backends.transformers import TransformersBackend, kernel_ranges
from tiny import tiny_model


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
    assert backend().select_kernels(timings=clear) == [(1, "stationary"), (2, "other"), (None, "linear")]


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
    assert set(timings) == {"linear", "stationary"}
    assert all(set(per) == {1, 2} and all(t > 0 for t in per.values()) for per in timings.values())
