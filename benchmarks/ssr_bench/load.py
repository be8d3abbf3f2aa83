"""``ssr bench --concurrency 1,2,4,8,16``: many requests at once through one engine's scheduler.

For each method (plain decoding, SSR) and each level N, N requests are submitted together and the wall time until
the last one ends is compared with the same N requests run one after another (each timed alone in the same run).
Reported: that ratio, throughput (generated tokens per second) and p50/p95 request latency; every concurrent
output is checked token for token against the same request run alone.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ssr.agreement import compare
from ssr.config import SSRConfig
from .figures import pyplot, save
from .suites import load_humaneval

METHODS = {"plain": dict(enabled=False), "ssr": {}}
BUDGET = dict(max_think_tokens=64, max_tokens=160)


def _timed(engine, prompt, config) -> tuple[float, Any]:
    start = time.perf_counter()
    result = engine.generate(prompt, config=config)
    return time.perf_counter() - start, result


def _concurrent(engine, prompts, config) -> tuple[float, list[float], list[Any]]:
    """Submit every prompt at once (one thread each); wall time to the last result, each request's latency."""
    latencies: list[float] = [0.0] * len(prompts)
    results: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []
    go = threading.Barrier(len(prompts) + 1)

    def worker(i: int) -> None:
        go.wait()
        try:
            latencies[i], results[i] = _timed(engine, prompts[i], config)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, latencies, results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_load(out: Path, levels: list[int], model: str | None = None, backend: str = "transformers",
             methods: tuple[str, ...] = ("plain", "ssr"), overrides: dict | None = None,
             backend_kwargs: dict | None = None, progress: bool = True) -> dict[str, Any]:
    from ssr.engine import SSREngine

    out.mkdir(parents=True, exist_ok=True)
    engine = SSREngine.from_pretrained(model, backend=backend, max_running=max(levels), max_queue=4 * max(levels),
                                       **(backend_kwargs or {}))
    prompts = [item["messages"] for item in load_humaneval(max(levels))]
    budget = {**BUDGET, **(overrides or {})}
    engine.generate(prompts[0], config=SSRConfig(max_think_tokens=2, max_tokens=4))  # untimed warm-up
    rows = []
    bar = tqdm(total=len(methods) * (max(levels) + sum(levels)), desc="load", unit="req", disable=not progress)
    for method in methods:
        config = SSRConfig(**budget, **METHODS[method])
        alone = []
        for prompt in prompts:  # the sequential reference, each request alone
            alone.append(_timed(engine, prompt, config))
            bar.update()
        for n in levels:
            wall, latencies, results = _concurrent(engine, prompts[:n], config)
            bar.update(n)
            sequential = sum(seconds for seconds, _ in alone[:n])
            tokens = sum(len(r.token_ids) for r in results)
            rows.append({
                "method": method, "concurrency": n, "wall_seconds": wall, "sequential_seconds": sequential,
                "ratio_to_sequential": wall / sequential, "tokens_per_second": tokens / wall,
                "sequential_tokens_per_second": tokens / sequential,
                "p50_latency": statistics.median(latencies), "p95_latency": _quantile(latencies, 0.95),
                "identical": sum(r.token_ids == a.token_ids for r, (_, a) in zip(results, alone[:n])), "n": n,
                # the others against the same request alone: left at a near-tie (rows that depend on the batch)
                "near_ties": sum(not c.identical and c.near_tie for c in (
                    compare(a.token_ids, a.near_ties, r.token_ids) for r, (_, a) in zip(results, alone[:n]))),
                "passes": sum(r.stats["forward_passes"] for r in results),
            })
    bar.close()
    engine.close()
    record = {"model": engine.model_name, "backend": backend, "budget": budget, "levels": levels, "rows": rows,
              "machine": _machine()}
    (out / "load.json").write_text(json.dumps(record, indent=1))
    (out / "load.md").write_text(report(record))
    plot(record, out / "load.png")
    return record


def report(record: dict[str, Any]) -> str:
    lines = [f"# Concurrent requests ({record['model']}, {record['backend']})", "",
             f"Machine: {record['machine']}. Budget: {record['budget']}. N requests submitted together (HumanEval "
             "prompts); `vs sequential` = wall time to the last result / the sum of the same requests' latencies "
             "alone, measured in the same run.", "",
             "| method | N | wall s | vs sequential | tokens/s | sequential tokens/s | p50 s | p95 s | identical | "
             "near-tie |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['wall_seconds']:.1f} | "
                     f"{r['ratio_to_sequential']:.3f} | {r['tokens_per_second']:.1f} | "
                     f"{r['sequential_tokens_per_second']:.1f} | {r['p50_latency']:.1f} | {r['p95_latency']:.1f} | "
                     f"{r['identical']}/{r['n']} | {r.get('near_ties', 0)} |")
    return "\n".join(lines) + "\n\n![throughput](load.png)\n"


def plot(record: dict[str, Any], path: Path) -> None:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in record["rows"]):
        rows = [r for r in record["rows"] if r["method"] == method]
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["tokens_per_second"] for r in rows], marker="o", label=method)
        right.plot(levels, [r["ratio_to_sequential"] for r in rows], marker="o", label=method)
    left.set(xscale="log", xlabel="concurrent requests", ylabel="tokens / s", title="throughput")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="wall / sequential", title="time vs one by one")
    right.axhline(0.5, color="grey", linestyle=":", label="target 0.5")
    for ax in (left, right):
        ax.legend()
        ax.set_xticks(record["levels"], [str(n) for n in record["levels"]])
    save(fig, path, dpi=120)


def _machine() -> str:
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        threads = None
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    return f"{model}, {threads} torch thread(s)"
