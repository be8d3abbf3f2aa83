"""Measure a backend's step costs on this machine (``measure_costs``), once per machine and setup (``calibrated``).

What an extra lane or an extra verified token costs differs between machines, dtypes and kernels by 2x
(docs/design.md: the cost model), so SSR's speculation policy reads a table measured where it runs. Measuring takes
seconds; the table, and for the transformers backend on CPU the linear-kernel choice made first, are cached as JSON
under ``$SSR_CACHE/costs/`` per model, backend, dtype, device, CPU, core count and torch version.
``SSR_RECALIBRATE=1`` (or ``refresh=True``) measures again. A table measured while other processes shared the CPUs
(its repetitions disagree by more than ``NOISY``) is used but not cached, so the next load measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from .costs import CostTable
from .models import cache_dir, write_cached
from .threads import on_own_thread

ROWS = (1, 2, 3)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
NOISY = 0.25  # repetitions that disagree by more (median over points): a busy machine; such a table is not cached


def dummy_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Deterministic token ids spread over the vocabulary (what the tokens are does not change the cost)."""
    span = max(1, min(vocab, 30000) - 200)
    return [200 + (seed * 7919 + i * 104729) % span if vocab > 400 else (seed + i) % vocab for i in range(n)]


def measure_costs(backend, rows=ROWS, widths=WIDTHS, context: int = 256, reps: int = 3,
                  progress: bool = True) -> CostTable:
    """Seconds of one step with ``r`` lanes fed ``w`` tokens each (every fed position's logits wanted, as
    verification needs), for every ``r`` in ``rows`` and ``w`` in ``widths``, relative to one lane and one token.

    Only the Backend protocol is used (any backend). Each repetition visits every point once, the row groups in a
    rotating order, so drift (other load, clocks) hits all points alike; the table holds medians. Within a group the
    lanes grow by the widths (no truncation between points: on vLLM a truncated lane re-prefills its last block).
    """
    rows, widths = tuple(sorted(set(rows))), tuple(sorted(set(widths)))
    if rows[0] != 1 or widths[0] != 1:
        raise ValueError("measure_costs: rows and widths must include 1 (the reference step)")
    seconds: dict[tuple[int, int], list[float]] = {(r, w): [] for r in rows for w in widths}
    from tqdm.auto import tqdm

    bar = tqdm(total=1 + reps * len(rows), desc=f"calibrating {backend.model_name}", disable=not progress,
               leave=False)
    backend.release_all()
    try:
        # (rows, widths, repetition): first a warm-up (no repetition), the largest step, which allocates what the
        # others need
        groups: list[tuple[int, tuple[int, ...], int | None]] = [(rows[-1], (1, widths[-1]), None)]
        for repetition in range(reps):
            groups += [(rows[(i + repetition) % len(rows)], widths, repetition) for i in range(len(rows))]
        # every group's lanes are forks of one lane holding the context, prefilled once; where a released fork's
        # cells stay taken while a lane is live (llama.cpp's exact mode), which would widen every later step, each
        # group starts from an empty cache and prefills the context again
        linger = getattr(backend, "released_cells_linger", False)
        context_lane = None
        for r, group_widths, rep in groups:
            if context_lane is None:
                context_lane = backend.new_lane()
                backend.step({context_lane: dummy_ids(context, backend.vocab_size)}, {context_lane: 1})
            lanes = [backend.fork(context_lane) for _ in range(r)]
            _sync(backend.step({lane: dummy_ids(1, backend.vocab_size, k) for k, lane in enumerate(lanes)},
                               {lane: 1 for lane in lanes}))  # after a fork (vLLM: a new session's first step)
            for w in group_widths:
                feeds = {lane: dummy_ids(w, backend.vocab_size, k + w) for k, lane in enumerate(lanes)}
                t0 = time.perf_counter()
                _sync(backend.step(feeds, {lane: w for lane in lanes}))
                if rep is not None:
                    seconds[r, w].append(time.perf_counter() - t0)
            if linger:
                backend.release_all()
                context_lane = None
            else:
                for lane in lanes:
                    backend.release(lane)
            bar.update()
    finally:
        bar.close()
        backend.release_all()
    median = padded_envelope({point: statistics.median(ts) for point, ts in seconds.items()}, rows, widths)
    base = median[1, 1]
    # how far repetitions of one point disagree (median over points): large when other load shared the machine
    spread = statistics.median((max(ts) - min(ts)) / median[p] for p, ts in seconds.items())
    return CostTable(rows=rows, widths=widths,
                     cost=tuple(tuple(round(median[r, w] / base, 4) for w in widths) for r in rows),
                     base_seconds=base,
                     meta={"context": context, "reps": reps, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "machine": machine(), "spread": round(spread, 3)})


def measure_noise(backend, widths=(2, 4, 8, 16, 32), lanes: int = 3, context: int = 256) -> float:
    """How far a logit moves with the shape of the decode that computes it, on a backend whose multi-row kernels
    are not batch-invariant (``backend.row_exact`` False): the largest absolute difference, over the vocabulary,
    between a position's logits computed one token per step (as plain decoding computes them) and the same
    position computed among ``w`` rows of one lane, or beside ``lanes - 1`` other lanes. Two candidates whose
    logits are closer than twice this are a near-tie: either may come out of a batched step (docs/design.md,
    what "exact" means). The widest shape (32 tokens in each of 3 lanes) reaches the 64 rows from which llama.cpp's
    attention takes its tiled kernel: with one thread and the AMX layout the smaller shapes round alike."""
    import torch

    worst = 0.0
    backend.release_all()
    try:
        base = backend.new_lane()
        backend.step({base: dummy_ids(context, backend.vocab_size)}, {base: 1})
        for w in widths:
            feed = dummy_ids(w, backend.vocab_size, seed=w)
            one = backend.fork(base)
            single = torch.cat([backend.step({one: [t]})[one] for t in feed])
            backend.release(one)
            many = [backend.fork(base) for _ in range(lanes)]
            out = backend.step({lane: feed for lane in many}, {lane: w for lane in many})
            for lane in many:
                worst = max(worst, float((out[lane] - single).abs().max()))
                backend.release(lane)
    finally:
        backend.release_all()
    return worst


def padded_envelope(seconds: dict[tuple[int, int], float], rows, widths) -> dict[tuple[int, int], float]:
    """A step can always be run padded to a bigger one, so no step costs more than any bigger step measured: each
    point becomes the least of itself and every point with at least as many lanes and tokens. This removes the
    noise that would make the policy think a bigger step is cheaper (and keeps e.g. one row padded to two)."""
    return {(r, w): min(seconds[r2, w2] for r2 in rows if r2 >= r for w2 in widths if w2 >= w)
            for r in rows for w in widths}


def _sync(out) -> None:
    """Wait for the step's results (an accelerator computes asynchronously): read one value."""
    for logits in out.values():
        float(logits[-1, 0])
        return


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's name with its family and model: a VM often names every generation alike ("AMD EPYC"), and two
    generations' step costs differ (docs/log.md measured one such pair)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if info.get("cpu family") and info.get("model"):
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


def machine() -> dict:
    """What a cost table depends on besides the model and backend (the CPU flags as a digest: the kernels a build
    and a hypervisor expose)."""
    try:
        import torch

        threads, torch_version = torch.get_num_threads(), torch.__version__
    except ImportError:
        threads, torch_version = None, None
    flags = " ".join(sorted((_cpuinfo().get("flags") or "").split()))
    return {"cpu": cpu_name(), "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else None,
            "cores": os.cpu_count(), "threads": threads, "torch": torch_version}


def cache_key(backend, **grid) -> str:
    """File name of ``backend``'s cached table: readable model name plus a hash of everything the costs depend on."""
    fields = {"model": backend.model_name, "backend": f"{type(backend).__module__}.{type(backend).__qualname__}",
              "dtype": str(getattr(backend, "dtype", None)), "device": str(getattr(backend, "device", None)),
              "kernels": getattr(backend, "cost_version", None),  # a backend whose step code changed re-measures
              **machine(), "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(grid.items())}}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(backend.model_name))[-60:]
    return f"{slug}-{digest}"


def cache_path(backend, **grid) -> Path:
    return cache_dir() / "costs" / f"{cache_key(backend, **grid)}.json"


def _selects_kernels(backend) -> bool:
    return hasattr(backend, "select_kernels") and getattr(getattr(backend, "device", None), "type", None) == "cpu"


def calibrated(backend, refresh: bool = False, rows=ROWS, widths=WIDTHS, context: int = 256, reps: int = 3,
               progress: bool = True) -> CostTable:
    """``backend``'s cost table on this machine: from the disk cache (its kernel choice applied to the backend), or
    measured now (for the transformers backend on CPU, after choosing its linear kernels) and cached unless noisy."""
    path = cache_path(backend, rows=tuple(rows), widths=tuple(widths), context=context)
    refresh = refresh or os.environ.get("SSR_RECALIBRATE", "") not in ("", "0")
    if not refresh and path.exists():
        try:
            table = CostTable.from_dict(json.loads(path.read_text()))
            if _selects_kernels(backend) and table.meta.get("kernels"):
                backend.set_kernels(table.meta["kernels"])
            return table
        except (ValueError, KeyError, TypeError):  # unreadable or from an older layout: measure again
            pass
    # on a thread of its own: the OpenMP team it starts ends with it (ssr.threads: why that matters)
    table = on_own_thread(_measure, backend, rows, widths, context, reps, progress, name="ssr-calibrate")
    if table.meta.get("spread", 0) > NOISY:  # measured while other processes shared the CPUs: not kept
        return table
    write_cached(path, json.dumps(table.to_dict(), indent=1))
    return table


def _measure(backend, rows, widths, context: int, reps: int, progress: bool) -> CostTable:
    """The cost table measured now (the kernel choice first where the backend has one, the noise where rows depend
    on the batch), with what it was measured on in its meta."""
    meta = {}
    if _selects_kernels(backend):
        meta["kernels"] = backend.select_kernels(reps=reps, progress=progress)
    table = measure_costs(backend, rows=rows, widths=widths, context=context, reps=reps, progress=progress)
    if not getattr(backend, "row_exact", True):  # rows depend on the batch: what a near-tie is, on this machine
        meta["noise"] = round(measure_noise(backend, context=context), 6)
    return replace(table, meta={**table.meta, **meta, "model": backend.model_name,
                                "backend": type(backend).__name__, "dtype": str(getattr(backend, "dtype", None)),
                                "device": str(getattr(backend, "device", None))})


def markdown(table: CostTable) -> str:
    """The table as Markdown: one line per lane count, one column per tokens per lane."""
    lines = ["| lanes \\ tokens per lane | " + " | ".join(str(w) for w in table.widths) + " |",
             "| --- |" + " --- |" * len(table.widths)]
    for r, costs in zip(table.rows, table.cost):
        lines.append(f"| {r} | " + " | ".join(f"{c:.2f}" for c in costs) + " |")
    return "\n".join(lines)


def kernels_text(table) -> str:
    """A kernel choice (``[(max_rows, kernel), ...]``) as text: ``1: linear; 2-4: stationary; 5+: linear``."""
    from .backends.transformers import kernel_ranges

    return "; ".join(f"{span}: {name}" for span, name in kernel_ranges([tuple(x) for x in table]))
