"""The agent suite's part of the report: per method, tasks solved, steps, per-step and per-task latency, forward
passes and reused prompt tokens per step, tokens accepted by source; plots of per-step latency and of accepted
tokens by source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import methods as M
from .agent import accepted_by_source, prefill_accounting
from .figures import fmt, mean, pyplot, quantile, save

SUITE = "agent"


def agent_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """method -> the suite's numbers; ``records`` are the latest successful record per (item, method)."""
    recs = [r for r in records if r.get("suite") == SUITE and not r.get("error")]
    plain = {r["item"]: r for r in recs if r["method"] == M.PLAIN}
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r["method"] for r in recs):
        rs = [r for r in recs if r["method"] == method]
        steps = [s for r in rs for s in r.get("steps") or []]
        paired = [(r["latency_s"], plain[r["item"]]["latency_s"]) for r in rs if r["item"] in plain]
        compared = [r for r in rs if "identical_to_plain" in r and method != M.PLAIN]
        out[method] = {
            # a replay peer whose tokens left plain's has no loop of its own to score: unknown (None)
            "tasks": len(rs), "solved": None if any(r.get("score") is None for r in rs) else
            sum(1 for r in rs if r.get("score")), "steps": len(steps),
            "step_latency_median": quantile([s["latency_s"] for s in steps], 0.5),
            "step_latency_p90": quantile([s["latency_s"] for s in steps], 0.9),
            "task_latency_mean": mean([r["latency_s"] for r in rs]),
            # the suite's whole time against plain's on the same tasks (a long task weighs as long as it took)
            "task_latency_ratio": sum(a for a, _ in paired) / sum(b for _, b in paired) if paired else None,
            "passes_per_step": mean([s["forward_passes"] for s in steps if s.get("forward_passes") is not None]),
            "tokens_per_step": mean([s["n_tokens"] for s in steps]),
            "reused_per_step": mean([s["reused_prompt_tokens"] for s in steps
                                      if s.get("reused_prompt_tokens") is not None]),
            "prompt_per_step": mean([s["prompt_tokens"] for s in steps if s.get("prompt_tokens") is not None]),
            "accepted_by_source": accepted_by_source(steps),
            # steps after the first: tokens prefilled against the tokens added since the previous step's prompt
            **_prefill(r.get("steps") or [] for r in rs),
            "identical": sum(1 for r in compared if r["identical_to_plain"]), "compared": len(compared),
            # a backend whose rows depend on the batch: tasks whose tokens left plain's first at a near-tie
            "near_tie": sum(1 for r in compared if not r["identical_to_plain"] and r.get("near_tie")),
        }
    return out


PREFILL_SLACK = 32  # the allowance over the added tokens (the generation prompt, a think prefill)


def _prefill(runs) -> dict[str, Any]:
    acc = [a for steps in runs for a in prefill_accounting(steps)]
    return {"prefilled_per_step": mean([a["prefilled"] for a in acc]),
            "added_per_step": mean([a["added"] for a in acc]),
            "prefill_within": sum(1 for a in acc if a["prefilled"] <= a["added"] + PREFILL_SLACK),
            "prefill_steps": len(acc)}


def plot_step_latency(records: list[dict[str, Any]], summary: dict[str, dict[str, Any]], path: Path) -> Path:
    methods = list(summary)
    data = [[s["latency_s"] for r in records if r.get("suite") == SUITE and r["method"] == m
             for s in r.get("steps") or []] for m in methods]
    fig, ax = pyplot().subplots(figsize=(max(4.5, 1.3 * len(methods)), 3.6))
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(methods) + 1), methods)
    ax.set_ylabel("seconds per agent step")
    ax.set_title("agent suite: per-step latency")
    return save(fig, path)


def plot_accepted_by_source(summary: dict[str, dict[str, Any]], path: Path) -> Path:
    methods = [m for m in summary if m != M.PLAIN] or list(summary)
    sources = sorted({src for m in methods for src in summary[m]["accepted_by_source"]})
    fig, ax = pyplot().subplots(figsize=(max(4.5, 1.3 * len(methods)), 3.6))
    bottom = [0] * len(methods)
    for src in sources:
        heights = [summary[m]["accepted_by_source"].get(src, 0) for m in methods]
        ax.bar(methods, heights, bottom=bottom, label=src)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("tokens accepted (all tasks)")
    ax.set_title("agent suite: accepted tokens by source")
    if sources:
        ax.legend(fontsize=8)
    return save(fig, path)


def agent_section(records: list[dict[str, Any]], out: Path) -> list[str]:
    """Markdown lines (and the two PNGs in ``out``) for the agent suite; nothing when the run has none."""
    summary = agent_summary(records)
    if not summary:
        return []
    fronts = sorted({str(r.get("front")) for r in records if r.get("suite") == SUITE})
    cols = ("tasks solved", "steps", "step latency med (s)", "p90 (s)", "task latency mean (s)", "ratio to plain",
            "passes / step", "tokens / step", "prompt reused / step", "prefilled / added (steps 2+)",
            f"steps prefilling <= added + {PREFILL_SLACK}", "accepted by source", "identical")
    lines = [f"## agent suite (front: {', '.join(fronts)})", "", "| method | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for m, s in summary.items():
        sources = ", ".join(f"{k} {v}" for k, v in sorted(s["accepted_by_source"].items())) or "-"
        solved = f"{s['solved']}/{s['tasks']}" if s["solved"] is not None else "-"
        row = (solved, s["steps"], fmt(s["step_latency_median"]), fmt(s["step_latency_p90"]),
               fmt(s["task_latency_mean"]), fmt(s["task_latency_ratio"], 3), fmt(s["passes_per_step"], 1),
               fmt(s["tokens_per_step"], 1), f"{fmt(s['reused_per_step'], 0)} of {fmt(s['prompt_per_step'], 0)}",
               f"{fmt(s['prefilled_per_step'], 0)} / {fmt(s['added_per_step'], 0)}",
               f"{s['prefill_within']}/{s['prefill_steps']}" if s["prefill_steps"] else "-", sources,
               (f"{s['identical']}/{s['compared']}" + (f" (+{s['near_tie']} near-tie)" if s["near_tie"] else ""))
               if s["compared"] else "-")
        lines.append(f"| {m} | " + " | ".join(map(str, row)) + " |")
    p1 = plot_step_latency(records, summary, out / "agent_step_latency.png")
    p2 = plot_accepted_by_source(summary, out / "agent_accepted_by_source.png")
    lines += ["", "Prefilled / added: per step after the first, the prompt tokens the step computed (its prompt less "
              "what the cache reused) against how much the prompt grew since the previous step "
              "(``agent.prefill_accounting``); an append-only loop prefills what it adds.",
              "", "Ratio to plain: the method's summed task latency over plain's on the same tasks. Identical: tasks "
              "whose every step gave plain decoding's tokens; near-tie: tasks that left plain's tokens first where two "
              "candidates were within the kernel noise (llama.cpp's multi-row decodes; ``ssr.agreement``). Front "
              "`replay`: a peer with its own decoding loop (vLLM, llama.cpp, prompt lookup) generates plain's number "
              "of tokens from each of plain's step prompts; its "
              "tasks count as solved where its tokens are plain's.", "", f"![per-step latency]({p1.name})", "",
              f"![accepted by source]({p2.name})", ""]
    return lines
