"""The cost table (interpolation, validation, persistence), the measured kernel choice (with injected timings, counted
calls) and the calibration cache (measured once, then loaded). Counts only: nothing here depends on timings."""

from __future__ import annotations

import json

import pytest
import torch

import ssr.calibrate as calibrate
from ssr.backends.transformers import TransformersBackend, kernel_ranges
from ssr.costs import CostTable
from tiny import tiny_model

TABLE = CostTable(rows=(1, 2, 3), widths=(1, 2, 4), cost=((1.0, 1.2, 1.6), (1.5, 1.9, 2.7), (2.0, 2.6, 3.8)),
                  base_seconds=0.08, meta={"kind": "test"})


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


# -- CostTable --------------------------------------------------------------------------------------------------------

def test_table_points_and_interpolation():
    assert TABLE(1, 1) == 1.0 and TABLE(2, 4) == 2.7
    assert TABLE(1, 3) == pytest.approx(1.4)  # halfway between widths 2 and 4
    assert TABLE(2, 3) == pytest.approx(2.3)
    assert TABLE(1, 8) == pytest.approx(1.6 + 0.2 * 4)  # beyond the last width: the last slope
    assert TABLE(4, 1) == pytest.approx(2.5)  # beyond the last row count
    assert TABLE(4, 8) == pytest.approx(TABLE(3, 8) + (TABLE(3, 8) - TABLE(2, 8)))
    assert CostTable.flat()(3, 16) == 1.0
    assert CostTable.linear()(3, 4) == pytest.approx(12.0)


@pytest.mark.parametrize("rows, widths, cost", [
    ((2, 3), (1, 2), ((1, 1), (1, 1))),  # must start at 1
    ((1, 1), (1, 2), ((1, 1), (1, 1))),  # strictly ascending
    ((1, 2), (1, 2), ((1, 1),)),  # shape
    ((1, 2), (1, 2), ((1, 1), (1,))),
    ((), (1,), ()),
])
def test_table_validation(rows, widths, cost):
    with pytest.raises(ValueError):
        CostTable(rows=rows, widths=widths, cost=cost)


def test_table_round_trip():
    again = CostTable.from_dict(json.loads(json.dumps(TABLE.to_dict())))
    assert again == TABLE and again.meta == TABLE.meta and again.base_seconds == TABLE.base_seconds


# -- kernel choice ----------------------------------------------------------------------------------------------------

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


# -- calibration ------------------------------------------------------------------------------------------------------

GRID = dict(rows=(1, 2), widths=(1, 2, 3), context=8, reps=1, progress=False)


def test_measure_costs_through_the_protocol():
    b = backend()
    table = calibrate.measure_costs(b, **GRID)
    assert table.rows == (1, 2) and table.widths == (1, 2, 3)
    assert table.cost[0][0] == 1.0 and table.base_seconds > 0
    assert b.live_lanes == 0  # it cleans up after itself


def test_calibrated_caches_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    monkeypatch.delenv("SSR_RECALIBRATE", raising=False)
    calls = {"measure": 0, "select": 0}
    measure, select = calibrate.measure_costs, TransformersBackend.select_kernels

    def counted_measure(*args, **kwargs):
        calls["measure"] += 1
        return measure(*args, **kwargs)

    def counted_select(self, timings=None, **kwargs):
        calls["select"] += 1
        return select(self, timings=TIMINGS, **kwargs)  # a known choice, so reloading it can be checked

    monkeypatch.setattr(calibrate, "measure_costs", counted_measure)
    monkeypatch.setattr(TransformersBackend, "select_kernels", counted_select)
    first = calibrate.calibrated(backend(), **GRID)
    assert calls == {"measure": 1, "select": 1}
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("tiny-")
    assert first.meta["kernels"] == CHOSEN

    fresh = backend()
    again = calibrate.calibrated(fresh, **GRID)
    assert calls == {"measure": 1, "select": 1}  # loaded, not measured
    assert again == first
    assert fresh.kernels == [tuple(k) for k in first.meta["kernels"]]  # the cached choice is applied

    monkeypatch.setenv("SSR_RECALIBRATE", "1")
    calibrate.calibrated(backend(), **GRID)
    assert calls == {"measure": 2, "select": 2}
    monkeypatch.delenv("SSR_RECALIBRATE")
    calibrate.calibrated(backend(), refresh=True, **GRID)
    assert calls == {"measure": 3, "select": 3}


def test_noisy_table_is_not_cached(tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    measure = calibrate.measure_costs
    monkeypatch.setattr(calibrate, "measure_costs",
                        lambda *a, **k: replace(measure(*a, **k), meta={"spread": 2 * calibrate.NOISY}))
    table = calibrate.calibrated(backend(), **GRID)
    assert table.meta["spread"] > calibrate.NOISY and "kernels" in table.meta
    assert not list(tmp_path.glob("costs/*.json"))


def test_cache_key_depends_on_setup(monkeypatch):
    b = backend()
    key = calibrate.cache_key(b)
    assert calibrate.cache_key(backend(1)) == key  # same model name, setup and machine
    b.model_name = "other"
    assert calibrate.cache_key(b) != key
    monkeypatch.setattr(calibrate, "cpu_name", lambda: "another CPU")
    b.model_name = "tiny"
    assert calibrate.cache_key(b) != key


def test_markdown_and_kernel_text():
    md = calibrate.markdown(TABLE)
    assert md.splitlines()[0] == "| lanes \\ tokens per lane | 1 | 2 | 4 |"
    assert "| 2 | 1.50 | 1.90 | 2.70 |" in md
    assert calibrate.kernels_text([[2, "stationary"], [None, "linear"]]) == "1-2: stationary; 3+: linear"


def test_micro_calibration_report(tmp_path, monkeypatch):
    import types

    from ssr_bench import micro

    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    engine = types.SimpleNamespace(backend=backend(), policy=types.SimpleNamespace(costs=None))
    c = micro.calibration(engine)
    assert engine.policy.costs.to_dict() == c["table"]  # the engine prices its next requests with the fresh table
    assert c["kernels"] == engine.backend.kernels and len(c["table"]["rows"]) == 3
    md = micro.micro_markdown({"model": "tiny", "backend": "transformers", "preset": "smoke", "calibration": c})
    assert "## Calibration" in md and "| lanes \\ tokens per lane | 1 | 2 | 3 | 4 | 6 | 8 | 12 | 16 |" in md


def test_padded_envelope_makes_costs_monotone():
    from ssr.calibrate import padded_envelope

    seconds = {(1, 1): 1.0, (1, 2): 0.9, (1, 4): 3.0, (2, 1): 1.1, (2, 2): 2.5, (2, 4): 2.0}
    env = padded_envelope(seconds, (1, 2), (1, 2, 4))
    assert env == {(1, 1): 0.9, (1, 2): 0.9, (1, 4): 2.0, (2, 1): 1.1, (2, 2): 2.0, (2, 4): 2.0}
