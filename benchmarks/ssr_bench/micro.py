"""Microbenchmarks of one model on this machine, through the backend protocol (``engine.backend``).

Calibration (first, re-measured every run): the linear kernel chosen per input row count and the step-cost table
(lanes x tokens per lane, relative to one lane decoding one token) that SSR's speculation policy prices with; then,
with those kernels:

(a) cost of one batched step with the thinking lane + one draft lane, relative to a thinking-only step at equal
    lengths (target <= 1.1);
(b) cost of verifying an N-token draft (N = 256) in one pass, relative to decoding those N tokens one by one
    (target <= 0.05);
(c) end-to-end latency SSR vs plain on >= 10 HumanEval prompts, with identical outputs reported (the bench runner);
(d) peak RSS of plain and SSR, each measured in a fresh subprocess;
(e) a step's cost against the context: steps of 1, 4 and 8 rows on lanes of several lengths, interleaved (what a
    thousand tokens of context add to a step and to each further row; not in the default parts).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET_BATCHED = 1.1
TARGET_VERIFY = 0.05
CONTEXTS = (64, 1024, 2048)  # part (e)'s lane lengths (tokens) and row counts, unless the caller names others
ROWS = (1, 4, 8)


def _context_ids(engine, min_tokens: int) -> list[int]:
    """A real prompt (HumanEval, through the chat template) padded with more task text to ``min_tokens``."""
    from .suites import load_humaneval

    items = load_humaneval(n=8)
    ids = engine.encode(items[0]["messages"])
    k = 1
    while len(ids) < min_tokens:
        ids = ids + engine.tokenizer.encode(items[k % len(items)]["prompt"], add_special_tokens=False)
        k += 1
    return ids


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds): on a shared machine CPU time is far less disturbed by other load."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def batched_step_ratio(engine, context: int = 300, reps: int = 20, warmup: int = 3) -> dict[str, Any]:
    """(a): thinking-only step vs thinking + one draft lane step, both at the same lane lengths; the two kinds
    alternate so that drift hits both alike. Each step appends one token and is then truncated away."""
    b = engine.backend
    ids = _context_ids(engine, context)
    tok = ids[-1]
    b.release_all()
    main = b.new_lane()
    b.step({main: ids}, {main: 1})
    length = b.length(main)
    single, batched = [], []
    try:
        for r in range(warmup + reps):
            t1 = _timed(lambda: b.step({main: [tok]}, {main: 1}))
            b.truncate(main, length)
            draft = b.fork(main)
            t2 = _timed(lambda: b.step({main: [tok], draft: [tok]}, {main: 1, draft: 1}))
            b.release(draft)
            b.truncate(main, length)
            if r >= warmup:
                single.append(t1)
                batched.append(t2)
    finally:
        b.release_all()
    s, t = statistics.median(x for x, _ in single), statistics.median(x for x, _ in batched)
    cs, ct = statistics.median(c for _, c in single), statistics.median(c for _, c in batched)
    return {"context_tokens": length, "reps": reps, "single_step_ms": round(s * 1e3, 2),
            "batched_step_ms": round(t * 1e3, 2), "ratio": round(t / s, 4), "target": TARGET_BATCHED,
            "meets_target": t / s <= TARGET_BATCHED, "cpu_single_step_ms": round(cs * 1e3, 2),
            "cpu_batched_step_ms": round(ct * 1e3, 2), "cpu_ratio": round(ct / cs, 4) if cs else None,
            "threads": _threads(), "kernels": getattr(b, "kernels", None)}


def verify_ratio(engine, n_tokens: int = 256, context: int = 300, reps: int = 3) -> dict[str, Any]:
    """(b): one forward pass over ``n_tokens`` draft tokens (logits at every position, as verification needs)
    vs the same tokens decoded one step at a time, from the same context."""
    b = engine.backend
    ids = _context_ids(engine, context + n_tokens)
    prefix, draft = ids[:context], ids[context: context + n_tokens]
    b.release_all()
    main = b.new_lane()
    try:
        b.step({main: prefix}, {main: 1})
        length = b.length(main)
        b.step({main: draft[:8]}, {main: 8})  # warm up
        b.truncate(main, length)
        one_pass = []
        for _ in range(reps):
            one_pass.append(_timed(lambda: b.step({main: draft}, {main: len(draft)})))
            b.truncate(main, length)

        def one_by_one():
            for t in draft:
                b.step({main: [t]}, {main: 1})

        sequential, cpu_sequential = _timed(one_by_one)
        b.truncate(main, length)
    finally:
        b.release_all()
    p = statistics.median(x for x, _ in one_pass)
    cp = statistics.median(c for _, c in one_pass)
    return {"draft_tokens": n_tokens, "context_tokens": context, "one_pass_s": round(p, 4),
            "sequential_s": round(sequential, 4), "ratio": round(p / sequential, 5), "target": TARGET_VERIFY,
            "meets_target": p / sequential <= TARGET_VERIFY, "cpu_one_pass_s": round(cp, 4),
            "cpu_sequential_s": round(cpu_sequential, 4),
            "cpu_ratio": round(cp / cpu_sequential, 5) if cpu_sequential else None, "threads": _threads()}


def context_cost(engine, contexts: tuple[int, ...] = CONTEXTS, rows: tuple[int, ...] = ROWS,
                 reps: int = 8, warmup: int = 2) -> dict[str, Any]:
    """(e): a step of each row count on a lane of each context length, the (context, rows) pairs interleaved
    round after round so that drift hits every pair alike; each step is truncated away after it."""
    b = engine.backend
    room = b.context_window - max(rows) - 1
    contexts = tuple(c for c in contexts if c <= room)
    ids = _context_ids(engine, max(contexts) + max(rows))
    b.release_all()
    lanes = {}
    times: dict[tuple[int, int], list[float]] = {(c, r): [] for c in contexts for r in rows}
    try:
        for c in contexts:
            lanes[c] = b.new_lane()
            b.step({lanes[c]: ids[:c]}, {lanes[c]: 1})
        for rep in range(warmup + reps):
            for (c, r), seen in times.items():
                wall, _ = _timed(functools.partial(b.step, {lanes[c]: ids[c: c + r]}, {lanes[c]: r}))
                b.truncate(lanes[c], c)
                if rep >= warmup:
                    seen.append(wall)
    finally:
        b.release_all()
    ms = {f"{c}x{r}": round(statistics.median(t) * 1e3, 2) for (c, r), t in times.items()}
    return {"contexts": list(contexts), "rows": list(rows), "reps": reps, "step_ms": ms, "threads": _threads()}


def calibration(engine) -> dict[str, Any]:
    """Re-measure the kernel choice and the cost table (and refresh the disk cache the engine reads)."""
    from ssr.calibrate import calibrated

    t0 = time.perf_counter()
    table = calibrated(engine.backend, refresh=True)
    engine.policy.costs = table  # the engine prices its next requests with the fresh table
    return {"seconds": round(time.perf_counter() - t0, 1), "kernels": table.meta.get("kernels"),
            "table": table.to_dict(), "threads": _threads()}


def _threads() -> int | None:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return None


def end_to_end(engine, out: Path, n: int, preset: str, model: str | None, backend: str,
               overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """(c): the bench runner with plain and ssr on the first ``n`` HumanEval prompts."""
    from .report import summarize, write_report
    from .runner import BenchRun, load_records, run_bench

    run = BenchRun(suites=["humaneval"], methods=["plain", "ssr"], out=out, n=n, model=model, backend=backend,
                   preset=preset, overrides=overrides or {})
    path = run_bench(run, engine=engine)
    write_report(path, title="Micro (c): SSR vs plain end to end, HumanEval")
    s = summarize(load_records(path)).get("humaneval", {})
    plain, ssr = s.get("plain", {}), s.get("ssr", {})
    return {"items": ssr.get("n"), "plain_latency_median_s": plain.get("latency_median"),
            "ssr_latency_median_s": ssr.get("latency_median"), "latency_ratio_geomean": ssr.get("latency_ratio"),
            "answer_passes_ratio": ssr.get("answer_passes_ratio"), "identical": ssr.get("identical"),
            "compared": ssr.get("compared"), "plain_score": plain.get("score"), "ssr_score": ssr.get("score"),
            "results": str(path)}


# ---------------------------------------------------------------------------------------------------- (d) RSS


def _rss_now_mb() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
    return None


def _peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rss_child(method: str, model: str | None, backend: str, preset: str, n: int) -> dict[str, Any]:
    """Run inside a fresh process: load the engine, generate ``n`` HumanEval items with ``method``."""
    from .methods import method_config, run_engine
    from .runner import base_config, load_engine
    from .suites import load_humaneval

    if os.environ.get("SSR_BENCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["SSR_BENCH_THREADS"]))
    t0 = time.perf_counter()
    engine = load_engine(model, backend)
    loaded_rss, loaded_peak = _rss_now_mb(), _peak_rss_mb()
    load_s = time.perf_counter() - t0
    cfg = method_config(method, base_config("humaneval", preset))
    tokens = 0
    for item in load_humaneval(n=n):
        tokens += len(run_engine(engine, item, cfg).token_ids)
    return {"method": method, "rss_after_load_mb": round(loaded_rss or 0, 1),
            "peak_after_load_mb": round(loaded_peak, 1), "peak_rss_mb": round(_peak_rss_mb(), 1),
            "generated_tokens": tokens, "load_s": round(load_s, 2)}


def peak_rss(methods: tuple[str, ...], model: str | None, backend: str, preset: str, n: int,
             timeout: float = 1800) -> dict[str, Any]:
    """(d): each method in its own fresh interpreter (one at a time), so peaks do not mix."""
    out = {}
    for method in methods:
        cmd = [sys.executable, "-m", "ssr_bench.micro", "--rss-child", method, "--backend", backend,
               "--preset", preset, "--n", str(n)]
        if model:
            cmd += ["--model", model]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        out[method] = json.loads(line) if line else {"error": (proc.stderr or "")[-800:]}
    return out


# ---------------------------------------------------------------------------------------------------- driver


def run_micro(out: Path, model: str | None = None, backend: str = "transformers", preset: str = "default",
              n: int | None = None, parts: str = "abcd", log=print,
              overrides: dict[str, Any] | None = None, backend_kwargs: dict[str, Any] | None = None,
              contexts: tuple[int, ...] = CONTEXTS, rows: tuple[int, ...] = ROWS) -> dict[str, Any]:
    """Run the chosen parts and write ``micro.json`` and ``micro.md`` into ``out`` (``contexts`` and ``rows``: part
    (e)'s lane lengths and row counts; ``backend_kwargs``: the engine's backend arguments, as ``--backend-arg``)."""
    smoke = preset == "smoke"
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": model or "default", "backend": backend, "preset": preset}
    try:
        result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if "d" in parts:  # before this process loads a model, so that the two never share the machine's memory
        log("(d) peak RSS, each method in a fresh process ...")
        result["d_peak_rss"] = peak_rss(("plain", "ssr"), model, backend, preset, n=1)
    engine = None
    if any(p in parts for p in "abce"):
        from .runner import load_engine

        log(f"loading model {model or 'default'} ...")
        engine = load_engine(model, backend, **(backend_kwargs or {}))
    if engine is not None:
        log("calibrating: linear kernel per row count, then the lanes x tokens step-cost table ...")
        result["calibration"] = calibration(engine)
    if "a" in parts:
        log("(a) batched step: thinking lane + one draft lane vs thinking lane alone ...")
        result["a_batched_step"] = batched_step_ratio(engine, reps=5 if smoke else 20, warmup=2 if smoke else 3)
    if "b" in parts:
        k = 32 if smoke else 256
        log(f"(b) verifying {k} draft tokens in one pass vs decoding them one by one ...")
        result["b_verify"] = verify_ratio(engine, n_tokens=k, reps=2 if smoke else 3)
    if "c" in parts:
        items = n if n is not None else (2 if smoke else 10)
        log(f"(c) end to end on {items} HumanEval prompts: plain vs ssr ...")
        result["c_end_to_end"] = end_to_end(engine, out / "e2e", items, preset, model, backend, overrides)
    if "e" in parts:
        log(f"(e) a step's cost against the context: {rows} rows at {contexts} tokens, interleaved ...")
        result["e_context_cost"] = context_cost(engine, contexts, rows, reps=3 if smoke else 8,
                                                warmup=1 if smoke else 2)
    (out / "micro.json").write_text(json.dumps(result, indent=2))
    (out / "micro.md").write_text(micro_markdown(result))
    return result


def micro_markdown(r: dict[str, Any]) -> str:
    from ssr.calibrate import kernels_text

    lines = ["# Microbenchmarks", "", f"Model `{r.get('model')}` on `{r.get('backend')}`, preset "
             f"`{r.get('preset')}`, {os.cpu_count()} CPUs, load average at the start "
             f"{r.get('loadavg', '?')}.", "",
             "Wall-clock ratios are the targets; on a shared machine the ratio of process CPU time is printed "
             "beside them (less disturbed by other processes).", ""]
    if "calibration" in r:
        lines += calibration_markdown(r["calibration"])
    if "a_batched_step" in r:
        a = r["a_batched_step"]
        lines += [f"- (a) batched step (thinking + 1 draft lane) / thinking-only step at {a['context_tokens']} "
                  f"tokens: **{a['ratio']:.3f}** ({a['batched_step_ms']} ms vs {a['single_step_ms']} ms, median of "
                  f"{a['reps']}, {a.get('threads')} threads; by process CPU time: {_fmt(a.get('cpu_ratio'), 3)}); "
                  f"target <= {a['target']}: {'met' if a['meets_target'] else 'NOT met'}"
                  + (f"; kernels {kernels_text(a['kernels'])}" if a.get("kernels") else "")]
    if "b_verify" in r:
        b = r["b_verify"]
        lines += [f"- (b) verifying {b['draft_tokens']} tokens in one pass / decoding them one by one: "
                  f"**{b['ratio']:.4f}** ({b['one_pass_s']} s vs {b['sequential_s']} s; by process CPU time: "
                  f"{_fmt(b.get('cpu_ratio'), 4)}); target <= {b['target']}: "
                  f"{'met' if b['meets_target'] else 'NOT met'}"]
    if "c_end_to_end" in r:
        c = r["c_end_to_end"]
        lines += [f"- (c) end to end on {c['items']} HumanEval prompts: SSR / plain latency "
                  f"**{_fmt(c['latency_ratio_geomean'], 3)}** (geo. mean; medians {_fmt(c['ssr_latency_median_s'])} s "
                  f"vs {_fmt(c['plain_latency_median_s'])} s), answer-phase passes ratio "
                  f"{_fmt(c['answer_passes_ratio'], 3)}; identical outputs **{c['identical']}/{c['compared']}**; "
                  f"pass rate plain {_fmt(c['plain_score'])} / ssr {_fmt(c['ssr_score'])} (details: "
                  f"`{c['results']}` and its report.md)"]
    if "e_context_cost" in r:
        e = r["e_context_cost"]
        header = " | ".join(f"{k} row{'s' if k > 1 else ''}" for k in e["rows"])
        lines += ["", f"(e) step cost (ms, median of {e['reps']}, {e.get('threads')} threads) by context and rows, the "
                  "pairs interleaved:", "", f"| context | {header} |", "|---|" + "---|" * len(e["rows"])]
        lines += [f"| {c} | " + " | ".join(str(e["step_ms"][f"{c}x{k}"]) for k in e["rows"]) + " |"
                  for c in e["contexts"]]
    if "d_peak_rss" in r:
        for method, d in r["d_peak_rss"].items():
            if "error" in d:
                lines.append(f"- (d) peak RSS {method}: failed: {d['error'][-300:]}")
            else:
                lines.append(f"- (d) peak RSS {method}: **{d['peak_rss_mb']} MB** (after loading: "
                             f"{d['rss_after_load_mb']} MB; {d['generated_tokens']} tokens generated)")
    return "\n".join(lines) + "\n"


def calibration_markdown(c: dict[str, Any]) -> list[str]:
    from ssr.calibrate import kernels_text, markdown
    from ssr.costs import CostTable

    table = CostTable.from_dict(c["table"])
    kernels = kernels_text(c["kernels"]) if c.get("kernels") else "not chosen by this backend"
    return ["## Calibration", "",
            f"Measured in {c['seconds']} s ({c.get('threads')} threads). Linear kernel per input rows (lanes x "
            f"tokens): {kernels}.", "",
            f"Step cost relative to one lane decoding one token ({1e3 * table.base_seconds:.1f} ms), at "
            f"{table.meta.get('context')} tokens of context, median of {table.meta.get('reps')} (repetitions "
            f"differ by {table.meta.get('spread')} of the median, median over points):", "",
            markdown(table), "", "## Ratios", ""]


def _fmt(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="SSR microbenchmarks (internal entry point; use `ssr bench --micro`)")
    p.add_argument("--rss-child", metavar="METHOD")
    p.add_argument("--model")
    p.add_argument("--backend", default="transformers")
    p.add_argument("--preset", default="default")
    p.add_argument("--n", type=int, default=1)
    args = p.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.model, args.backend, args.preset, args.n)), flush=True)


if __name__ == "__main__":
    _main()
