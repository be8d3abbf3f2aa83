"""ssr/calibrate.py: the cost table measured through the protocol, and the calibration cache (measured once, then
loaded). Counts only: nothing here depends on timings."""

from __future__ import annotations

import threading

import ssr.calibrate as calibrate
from ssr.backends.transformers import TransformersBackend
from test_backends_kernels import CHOSEN, TIMINGS
from test_costs import TABLE
from tiny import tiny_model


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


GRID = dict(rows=(1, 2), widths=(1, 2, 3), context=8, reps=1, progress=False)


def test_measure_costs_through_the_protocol():
    b = backend()
    table = calibrate.measure_costs(b, **GRID)
    assert table.rows == (1, 2) and table.widths == (1, 2, 3)
    assert table.cost[0][0] == 1.0 and table.base_seconds > 0
    assert b.live_lanes == 0  # it cleans up after itself


def test_context_prefilled_once_unless_released_cells_linger(monkeypatch):
    """The groups of steps fork one prefilled context; a backend whose released lanes' cells stay taken (llama.cpp's
    exact mode) gets an empty cache, and the context prefilled again, for every group."""
    def prefills(linger: bool) -> int:
        b = backend()
        b.released_cells_linger = linger
        fed: list[int] = []  # tokens fed to each lane in each step
        step = b.step

        def counted(feeds, want=None):
            fed.extend(map(len, feeds.values()))
            return step(feeds, want)

        monkeypatch.setattr(b, "step", counted)
        calibrate.measure_costs(b, **GRID)
        assert b.live_lanes == 0
        return fed.count(GRID["context"])

    assert prefills(False) == 1
    assert prefills(True) == 3  # GRID, reps=1: a warm-up group and two row groups


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
    assert first.meta["noise"] >= 0.0  # rows depend on the step's shape here: how far, measured at calibration

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


def test_cache_key_tells_cpu_generations_with_one_name_apart(monkeypatch):
    """A VM names two AMD EPYC generations alike ("AMD EPYC"); their step costs differ, so the family and model, and
    the flags the hypervisor exposes, are part of the key."""
    b = backend()
    zen4 = {"model name": "AMD EPYC", "cpu family": "25", "model": "17", "flags": "avx2 avx512f"}
    zen5 = dict(zen4, **{"cpu family": "26", "model": "2"})
    keys = []
    for info in (zen4, zen5, dict(zen4, flags="avx2")):
        monkeypatch.setattr(calibrate, "_cpuinfo", lambda info=info: info)
        keys.append(calibrate.cache_key(b))
    assert len(set(keys)) == 3
    assert calibrate.cpu_name() == "AMD EPYC (family 25 model 17)"


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


def test_calibration_runs_on_a_thread_of_its_own(tmp_path, monkeypatch):
    """Measuring steps on the caller's thread would leave an OpenMP team there for good, slowing every later step
    of the engine's own thread (ssr.threads): calibration runs on a thread that has ended when it returns."""
    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    ran_on = []
    measure = calibrate.measure_costs

    def recorded(*args, **kwargs):
        ran_on.append(threading.current_thread())
        return measure(*args, **kwargs)

    monkeypatch.setattr(calibrate, "measure_costs", recorded)
    calibrate.calibrated(backend(), refresh=True, **GRID)
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
