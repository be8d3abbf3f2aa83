"""What SSR would save on another machine, projected from runs decoded here: ``ssr bench --costs FILE#TABLE``.

The speculation policy prices its choices with that machine's cost table (as it would there: on a GPU, where an
extra row costs almost nothing, it forks drafts and verifies long proposals that a 2-core CPU declines), every
request counts its passes by shape (lanes x tokens per lane, ``pass_shapes``), and each record is priced with the
same table: ``projected_steps``, in that machine's one-token steps. The tokens, acceptances and passes are real
(decoded here); only the seconds are projected, so the report labels them so, beside the run's own.

A table file is what ``benchmarks/gpu/calibrate_shapes.py`` writes (``{"tables": {name: {"base_ms", "rows",
"widths", "cost"}}}``, name after ``#``) or a calibration cache entry (``CostTable.to_dict``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ssr.costs import CostTable

from .figures import fmt, geomean, mean, pyplot, save


def load_table(spec: str) -> CostTable:
    """``FILE#NAME`` (a table of a file holding several) or ``FILE`` (one table) -> the ``CostTable``, named."""
    path, _, name = spec.partition("#")
    whole = json.loads(Path(path).read_text())
    data, tables = whole, whole.get("tables")
    if tables is not None:
        if name not in tables:
            raise ValueError(f"--costs {spec!r}: name one of the tables in {path} after '#': {sorted(tables)}")
        data = tables[name]
    elif name:
        raise ValueError(f"--costs {spec!r}: {path} holds one table; drop '#{name}'")
    meta = {**data.get("meta", {}), "kind": "projection", "table": name or Path(path).stem,
            "device": whole.get("device", data.get("meta", {}).get("device", "?"))}
    base = data["base_seconds"] if "base_seconds" in data else data.get("base_ms", 0.0) / 1e3
    return CostTable.from_dict({**data, "base_seconds": base, "meta": meta})


def price_with(engine, table: CostTable) -> CostTable:
    """Make ``engine``'s policy price with ``table``; the kernel noise stays this backend's (the tokens are decoded
    here, so its near-ties are this machine's). Returns the table the policy holds."""
    noise = engine.costs.meta.get("noise")
    priced = replace(table, meta={**table.meta, **({"noise": noise} if noise is not None else {})})
    engine.policy.costs = priced
    return priced


def projected_steps(record: dict[str, Any], table: CostTable) -> float | None:
    """The record's passes priced with ``table`` (None for a record without pass shapes: a peer's)."""
    shapes = record.get("pass_shapes")
    return round(table.price(shapes), 3) if shapes else None


def summarize(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (suite, method): items, mean projected steps, their ratio to plain's (geometric mean over items, as the
    latency ratios), passes, wide passes (more than one lane or token), forks taken, mean proposal length and tokens
    accepted per verifying pass."""
    rows = [r for r in records if r.get("projected_steps") is not None]
    plain = {(r["suite"], r["item"]): r["projected_steps"] for r in rows if r["method"] == "plain"}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for suite, method in dict.fromkeys((r["suite"], r["method"]) for r in rows):
        mine = [r for r in rows if r["suite"] == suite and r["method"] == method]
        spec = [(r.get("speculation") or {}).get(p) or {} for r in mine for p in ("think", "answer")]
        verified = sum(s.get("verify_steps", 0) for s in spec)
        out[suite, method] = {
            "n": len(mine),
            "steps": mean([r["projected_steps"] for r in mine]),
            "ratio": geomean([r["projected_steps"] / plain[suite, r["item"]] for r in mine
                              if plain.get((suite, r["item"]))]),
            "passes": mean([r.get("forward_passes") or 0 for r in mine]),
            "wide": mean([sum(n for shape, n in r["pass_shapes"].items() if shape != "1x1") for r in mine]),
            "forks": mean([r.get("drafts") or 0 for r in mine]),
            "proposal": sum(s.get("proposed", 0) for s in spec) / verified if verified else 0.0,
            "accepted": sum(s.get("accepted", 0) for s in spec) / verified if verified else 0.0,
        }
    return out


def section(records: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> list[str]:
    """The report's projection section (none for a run without ``--costs``), with its plot."""
    projection = meta.get("projection")
    summary = summarize(records)
    if not projection or not summary:
        return []
    table = projection.get("meta", {})
    base_ms = round(1e3 * projection.get("base_seconds", 0.0), 2)
    lines = ["## Projection (not measured): this run's passes priced with another machine's cost table", "",
             f"Table `{table.get('table')}` ({table.get('device', '?')}; one step {base_ms} ms). The policy "
             "priced every choice with it while decoding here, so the forks and proposal lengths are the ones it "
             "makes there; the tokens, acceptances and passes are this run's, the seconds are projected (projected "
             "steps x one step; a prefill longer than the table's widest column is extrapolated from its last two).",
             "", "| suite | method | n | projected steps | projected s | ratio to plain | passes | wide passes | "
             "forks | mean proposal | accepted / verify pass |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (suite, method), s in summary.items():
        lines.append(f"| {suite} | {method} | {s['n']} | {fmt(s['steps'], 1)} | {fmt(s['steps'] * base_ms / 1e3)} | "
                     f"{fmt(s['ratio'], 3)} | {fmt(s['passes'], 1)} | {fmt(s['wide'], 1)} | {fmt(s['forks'])} | "
                     f"{fmt(s['proposal'], 1)} | {fmt(s['accepted'])} |")
    return lines + ["", f"![projected ratio]({plot(summary, out / 'projection.png', table).name})", ""]


def plot(summary: dict[tuple[str, str], dict[str, Any]], path: Path, table: dict[str, Any]) -> Path:
    suites = list(dict.fromkeys(suite for suite, _ in summary))
    methods = [m for m in dict.fromkeys(m for _, m in summary) if m != "plain"]
    fig, ax = pyplot().subplots(figsize=(max(5, 1.2 * len(suites) * max(1, len(methods))), 3.6))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        ax.bar([i + j * width for i in range(len(suites))],
               [(summary.get((s, m)) or {}).get("ratio") or 0.0 for s in suites], width=width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(suites))])
    ax.set_xticklabels(suites)
    ax.set_ylabel("projected steps / plain's (geo. mean)")
    ax.set_title(f"Projected under {table.get('table')} ({table.get('device', '?')})\n(lower is better)")
    ax.legend(fontsize=7)
    return save(fig, path)
