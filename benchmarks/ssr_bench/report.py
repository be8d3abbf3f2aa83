"""Markdown report with PNG plots from a results file (JSON lines written by ``runner``).

Per suite and method: end-to-end latency (median, p90), time to first answer token, answer-phase forward passes,
tokens accepted by prefix / suffix, draft tokens spent, ratios to plain on the same items, score, and every output
that differs from plain decoding. Plots: latency ratio per suite and method, accepted tokens against draft tokens
spent, and per-item latency of SSR against plain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import methods as M
from .agent_report import agent_section
from .figures import fmt, geomean, mean, pyplot, quantile, save
from .projection import section as projection_section
from .runner import load_records

METHOD_ORDER = {m: i for i, m in enumerate(M.METHODS)}


def latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last successful record per (suite, item, method): a resumed or repeated run counts once."""
    by: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("error"):
            continue
        by[(r.get("suite"), r.get("item"), r.get("method"))] = r
    return list(by.values())


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """suite -> method -> metrics. Ratios are per item against plain on the same item (geometric mean)."""
    recs = latest(records)
    plain = {(r["suite"], r["item"]): r for r in recs if r["method"] == M.PLAIN}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in recs:
        groups.setdefault((r["suite"], r["method"]), []).append(r)
    for (suite, method), rs in groups.items():
        lat = [r["latency_s"] for r in rs]
        ratios, pass_ratios, ttfa_ratios = [], [], []
        for r in rs:
            p = plain.get((suite, r["item"]))
            if p is None:
                continue
            if p.get("latency_s"):
                ratios.append(r["latency_s"] / p["latency_s"])
            if r.get("answer_forward_passes") is not None and p.get("answer_forward_passes"):
                pass_ratios.append(r["answer_forward_passes"] / p["answer_forward_passes"])
            if r.get("ttfa_s") and p.get("ttfa_s"):
                ttfa_ratios.append(r["ttfa_s"] / p["ttfa_s"])
        compared = [r for r in rs if r.get("identical_to_plain") is not None and method != M.PLAIN]
        out.setdefault(suite, {})[method] = {
            "n": len(rs),
            "latency_median": quantile(lat, 0.5),
            "latency_p90": quantile(lat, 0.9),
            "ttfa_median": quantile([r.get("ttfa_s") for r in rs], 0.5),
            "answer_passes_mean": mean(r.get("answer_forward_passes") for r in rs),
            "forward_passes_mean": mean(r.get("forward_passes") for r in rs),
            "accepted_prefix_mean": mean(r.get("accepted_prefix") for r in rs),
            "accepted_suffix_mean": mean(r.get("accepted_suffix") for r in rs),
            "draft_tokens_mean": mean(r.get("draft_tokens") for r in rs),
            "think_tokens_mean": mean(r.get("think_tokens") for r in rs),
            "think_passes_mean": mean(r.get("think_forward_passes") for r in rs),
            "think_accepted_mean": mean(r.get("think_accepted") for r in rs),
            "answer_tokens_mean": mean(r.get("answer_tokens") for r in rs),
            "latency_ratio": geomean(ratios),
            "latency_ratio_median": quantile(ratios, 0.5),
            "answer_passes_ratio": geomean(pass_ratios),
            "ttfa_ratio": geomean(ttfa_ratios),
            "score": mean(r.get("score") for r in rs),
            "whole_from_draft": mean(_whole_from_draft(r) for r in rs) if method != M.PLAIN else None,
            "identical": sum(1 for r in compared if r.get("identical_to_plain")),
            "compared": len(compared),
            # a backend whose rows depend on the batch: outputs that left plain's at a near-tie of plain's, and the
            # share of plain's tokens each output reproduces before its first difference (``ssr.agreement``)
            "near_ties": sum(1 for r in compared if r.get("near_tie")),
            "token_agreement": _token_agreement(compared, plain, suite),
        }
    return out


def _token_agreement(compared: list[dict[str, Any]], plain: dict, suite: str) -> float | None:
    """Plain's tokens reproduced before the first difference, over all of plain's tokens (identical: all)."""
    same = total = 0
    for r in compared:
        p = plain.get((suite, r["item"]))
        if p is None or not p.get("token_ids"):
            continue
        total += len(p["token_ids"])
        same += len(p["token_ids"]) if r.get("identical_to_plain") else (r.get("first_difference") or 0)
    return same / total if total else None


def _whole_from_draft(record: dict[str, Any]) -> float | None:
    """1 when the draft's verified prefix gave the whole answer: one answer pass (its last token is the verifier's)."""
    if record.get("answer_forward_passes") is None:
        return None
    return float(record["answer_forward_passes"] <= 1 and (record.get("accepted_prefix") or 0) > 0)


def mismatches(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Outputs that differ from plain decoding, except the replay peers' expected divergence at forced text (and
    ``bare``, which decodes another prompt by design)."""
    return [r for r in latest(records) if r.get("identical_to_plain") is False and not r.get("diverged_at_forced_text")
            and not r.get("ended_at_ignored_eos") and not r.get("near_tie") and r.get("method") != "bare"]


def ignored_eos_endings(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replay peers whose only difference is the last token: plain's end-of-turn, which the peer may not stop at."""
    return [r for r in latest(records) if r.get("identical_to_plain") is False and r.get("ended_at_ignored_eos")]


def near_tie_divergences(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Outputs that left plain decoding's at a near-tie of plain's (a backend whose rows depend on the batch)."""
    return [r for r in latest(records) if r.get("identical_to_plain") is False and r.get("near_tie")]


def forced_divergences(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in latest(records) if r.get("identical_to_plain") is False and r.get("diverged_at_forced_text")]


# ---------------------------------------------------------------------------------------------------- plots


def _methods_in(summary: dict[str, dict[str, Any]]) -> list[str]:
    names = {m for per in summary.values() for m in per}
    return sorted(names, key=lambda m: METHOD_ORDER.get(m, 99))


def plot_latency_ratio(summary: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path:
    suites = sorted(summary)
    methods = [m for m in _methods_in(summary) if m != M.PLAIN]
    fig, ax = pyplot().subplots(figsize=(max(5, 1.6 * len(suites) * max(1, len(methods)) / 2), 3.6))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(suites))]
        ys = [summary[s].get(m, {}).get("latency_ratio") or 0.0 for s in suites]
        ax.bar(xs, ys, width=width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(suites))])
    ax.set_xticklabels(suites)
    ax.set_ylabel("latency / plain (geo. mean)")
    ax.set_title("Latency relative to plain decoding\n(lower is better)")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, path)


def plot_accepted_vs_budget(records: list[dict[str, Any]], path: Path) -> Path:
    recs = [r for r in latest(records) if r.get("draft_tokens") is not None
            and r["method"] not in (M.PLAIN,) + M.REPLAY]
    fig, ax = pyplot().subplots(figsize=(5.5, 4))
    for m in sorted({r["method"] for r in recs}, key=lambda m: METHOD_ORDER.get(m, 99)):
        rs = [r for r in recs if r["method"] == m]
        ax.scatter([r.get("draft_tokens") or 0 for r in rs],
                   [(r.get("accepted_prefix") or 0) + (r.get("accepted_suffix") or 0) for r in rs],
                   label=m, s=18, alpha=0.75)
    ax.set_xlabel("draft tokens spent")
    ax.set_ylabel("accepted tokens (prefix + suffix)")
    ax.set_title("Accepted tokens vs draft budget, per item")
    if recs:
        ax.legend(fontsize=7)
    return save(fig, path)


def plot_item_scatter(records: list[dict[str, Any]], path: Path, method: str = "ssr") -> Path:
    recs = latest(records)
    plain = {(r["suite"], r["item"]): r for r in recs if r["method"] == M.PLAIN}
    fig, ax = pyplot().subplots(figsize=(4.8, 4.5))
    top = 0.0
    for suite in sorted({r["suite"] for r in recs}):
        pts = [(plain[(suite, r["item"])]["latency_s"], r["latency_s"]) for r in recs
               if r["suite"] == suite and r["method"] == method and (suite, r["item"]) in plain]
        if pts:
            ax.scatter([p for p, _ in pts], [s for _, s in pts], label=suite, s=18, alpha=0.8)
            top = max(top, *(max(p, s) for p, s in pts))
    top = top * 1.05 or 1.0
    ax.plot([0, top], [0, top], color="black", lw=0.8, ls="--")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("plain latency (s)")
    ax.set_ylabel(f"{method} latency (s)")
    ax.set_title(f"Per item: {method} vs plain (below the line: faster)")
    if top > 1.05 or recs:
        ax.legend(fontsize=7)
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------- markdown


def write_report(results: str | Path, out_dir: str | Path | None = None, title: str = "SSR benchmark") -> Path:
    """Write ``report.md`` and its PNGs next to ``results`` (or in ``out_dir``); returns the report path."""
    results = Path(results)
    out = Path(out_dir) if out_dir else results.parent
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(results)
    summary = summarize(records)
    bad = mismatches(records)
    expected = forced_divergences(records)
    errors = [r for r in records if r.get("error")]
    meta_path = results.parent / "meta.json"

    lines = [f"# {title}", ""]
    meta: dict[str, Any] = {}
    if meta_path.exists():
        import json

        meta = json.loads(meta_path.read_text())
        lines += [f"Model `{meta.get('model')}` on `{meta.get('backend')}` ({meta.get('dtype', '?')}, "
                  f"{meta.get('device', '?')}, {meta.get('torch_threads', '?')} torch threads, "
                  f"{meta.get('cpus', '?')} CPUs), preset `{meta.get('preset')}`.", ""]
        for suite, cfg in (meta.get("base_configs") or {}).items():
            keys = ("max_think_tokens", "min_think_tokens", "draft_start", "draft_interval", "max_drafts",
                    "max_draft_tokens", "max_suffix_tokens", "max_tokens")
            lines.append(f"- {suite} budgets: " + ", ".join(f"{k}={cfg.get(k)}" for k in keys))
        if meta.get("prompt_cache") == "warm":
            lines.append("- prompt cache: warm (each method's items reuse the prompts its own earlier items cached)")
        lines.append("")
    lines += ["Methods: " + "; ".join(f"`{m}`: {M.DESCRIPTIONS[m]}" for m in _methods_in(summary)
                                       if m in M.DESCRIPTIONS), ""]

    if bad:
        exact_bad = [r for r in bad if r["method"] in M.EXACT]
        lines += ["## MISMATCH: outputs that differ from plain decoding", ""]
        if exact_bad:
            lines += [f"**{len(exact_bad)} output(s) of exact methods differ from plain decoding: a bug.**", ""]
        lines += ["| suite | item | method | first differing token | plain forced tokens |", "|---|---|---|---|---|"]
        for r in bad:
            lines.append(f"| {r['suite']} | {r['item']} | {r['method']} | {r.get('first_difference')} | "
                         f"{fmt(r.get('plain_forced_tokens'))} |")
        lines.append("")
    else:
        lines += ["No MISMATCH: every compared output is token-identical to plain decoding"
                  + (" or leaves it at a near-tie of plain's (below)" if near_tie_divergences(records) else "")
                  + (" (the replay peers' divergences at forced text aside, below)." if expected else "."), ""]
    eos_endings = ignored_eos_endings(records)
    if eos_endings:
        lines += [f"{len(eos_endings)} replay peer output(s) equal plain's but for the last token, plain's end-of-turn "
                  "token: a peer asked for plain's number of tokens decodes with the end of turn banned "
                  "(llama-server's ignore_eos), so it writes its runner-up there: "
                  + ", ".join(f"{r['item']} {r['method']}" for r in eos_endings), ""]
    if expected:
        lines += [f"Replay peers ({', '.join(sorted({r['method'] for r in expected}))}) left plain's tokens on "
                  f"{len(expected)} output(s) exactly where plain's budget forcing inserted text (the close text at "
                  "max_think_tokens, the continue text below min_think_tokens), which their own decoding loops "
                  "cannot do; from there on the runs decode different sequences of the same length, so their "
                  "latency compares budgets, not tokens: "
                  + ", ".join(f"{r['item']} {r['method']} (token {r.get('first_difference')})"
                              for r in expected[:20]), ""]

    ties = near_tie_divergences(records)
    if ties:
        lines += [f"{len(ties)} output(s) left plain decoding's tokens at a near-tie of plain's (their token within "
                  "twice the kernel noise calibration measured of plain's; the backend's multi-row kernels round "
                  "differently from its one-row kernels, so either token is the model's): "
                  + ", ".join(f"{r['item']} {r['method']} (token {r.get('first_difference')}, margin "
                              f"{fmt(r.get('near_tie_margin'), 3)})" for r in ties[:30]), ""]
    cols = ("n", "latency med (s)", "p90 (s)", "ratio", "TTFA med (s)", "TTFA ratio", "think passes",
            "think acc.", "answer passes", "passes ratio", "acc. prefix", "acc. suffix", "whole from draft",
            "draft tok", "think tok", "answer tok", "score", "identical", "near-tie", "tokens agreeing")
    for suite in sorted(summary):
        lines += [f"## {suite}", "", "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for m in sorted(summary[suite], key=lambda m: METHOD_ORDER.get(m, 99)):
            s = summary[suite][m]
            ident = f"{s['identical']}/{s['compared']}" if s["compared"] else "-"
            row = (s["n"], fmt(s["latency_median"]), fmt(s["latency_p90"]), fmt(s["latency_ratio"], 3),
                   fmt(s["ttfa_median"]), fmt(s["ttfa_ratio"], 3), fmt(s["think_passes_mean"], 1),
                   fmt(s["think_accepted_mean"], 1), fmt(s["answer_passes_mean"], 1),
                   fmt(s["answer_passes_ratio"], 3), fmt(s["accepted_prefix_mean"], 1),
                   fmt(s["accepted_suffix_mean"], 1), fmt(s["whole_from_draft"], 2), fmt(s["draft_tokens_mean"], 1), fmt(s["think_tokens_mean"], 1),
                   fmt(s["answer_tokens_mean"], 1), fmt(s["score"], 3), ident,
                   s["near_ties"] if s["compared"] else "-", fmt(s["token_agreement"], 3))
            lines.append(f"| {m} | " + " | ".join(map(str, row)) + " |")
        lines.append("")
    lines += ["Ratios are geometric means over items of (method / plain on the same item). TTFA: wall time to the "
              "first answer text. Think passes: forward passes until the chain of thought closed (prefill included); "
              "think acc.: thinking tokens taken from proposals. Answer passes: forward passes after the chain of "
              "thought closed. Accepted: "
              "answer tokens taken from the newest draft's verified prefix / from suffix proposals. Whole from draft: share of "
              "items whose whole answer came from the draft's prefix in one verify pass. Draft tokens: "
              "tokens decoded in draft lanes (they ride in the thinking passes). Score: pass rate (HumanEval, "
              "ClassEval: all tests pass), LongProc task metric, BFCL call correct.", ""]

    lines += agent_section(latest(records), out)
    lines += projection_section(latest(records), meta, out)
    if records:
        p1 = plot_latency_ratio(summary, out / "latency_ratio.png")
        p2 = plot_accepted_vs_budget(records, out / "accepted_vs_draft.png")
        method = "ssr" if any(r["method"] == "ssr" for r in records) else next(
            (m for m in _methods_in(summary) if m != M.PLAIN), "ssr")
        p3 = plot_item_scatter(records, out / "latency_scatter.png", method=method)
        lines += ["## Plots", "", f"![latency ratio]({p1.name})", "", f"![accepted vs draft]({p2.name})", "",
                  f"![per-item latency]({p3.name})", ""]
    if errors:
        lines += ["## Errors", ""]
        for r in errors[-20:]:
            lines.append(f"- {r['suite']} {r['item']} {r['method']}: {r['error']}")
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def console_summary(results: str | Path) -> str:
    """A short plain-text table for the terminal."""
    summary = summarize(load_records(results))
    rows = []
    for suite in sorted(summary):
        for m in sorted(summary[suite], key=lambda m: METHOD_ORDER.get(m, 99)):
            s = summary[suite][m]
            ident = f"{s['identical']}/{s['compared']}" if s["compared"] else "-"
            rows.append(f"{suite:10} {m:14} n={s['n']:<3} lat={fmt(s['latency_median']):>7}s "
                        f"ratio={fmt(s['latency_ratio'], 3):>6} passes={fmt(s['answer_passes_mean'], 1):>6} "
                        f"score={fmt(s['score'], 2):>5} identical={ident}")
    return "\n".join(rows)


__all__ = ["write_report", "summarize", "mismatches", "console_summary", "latest"]
