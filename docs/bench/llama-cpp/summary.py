"""Totals over the items every method finished, per results folder: latency, tokens/s (whole request and decode
only, i.e. less the prompt's prefill), ratio to plain, identity with plain, forward passes, score.

    .venv/bin/python docs/bench/llama-cpp/summary.py docs/bench/llama-cpp/humaneval docs/bench/llama-cpp/bfcl

The harness runs plain first on each item and parks its lane, so SSR (next) finds the whole prompt cached and
prefills one token; "with plain's prefill added back" charges SSR the prefill plain paid, which is the comparison
with a fresh prompt. The llama.cpp peer (Llama.generate) keeps only its own previous call's prefix.
"""
import json
import statistics as st
import sys
from pathlib import Path


def load(path: Path) -> dict:
    out = {}
    for line in open(path):
        r = json.loads(line)
        if not r.get("error"):
            out[(r["item"], r["method"])] = r
    return out


def prefill(r: dict) -> float:
    return r.get("prefill_s") or 0.0 if r["method"] == "llama.cpp" else (r.get("seconds") or {}).get("prefill", 0.0)


for folder in sys.argv[1:]:
    recs = load(Path(folder) / "results.jsonl")
    methods = list(dict.fromkeys(m for _, m in recs))
    items = sorted(i for i in {i for i, _ in recs} if all((i, m) in recs for m in methods))
    print(f"## {folder}: {len(items)} items with every method ({', '.join(methods)})")
    total = {m: sum(recs[i, m]["latency_s"] for i in items) for m in methods}
    for m in methods:
        rs = [recs[i, m] for i in items]
        lat, tok, pre = total[m], sum(r["n_tokens"] for r in rs), sum(prefill(r) for r in rs)
        passes = [r["forward_passes"] for r in rs if r.get("forward_passes") is not None]
        line = (f"{m:10} total {lat:7.1f} s {tok:6d} tok {tok / lat:6.2f} tok/s, decode only {tok / (lat - pre):6.2f} "
                f"tok/s (prefill {pre:5.1f} s); vs plain {lat / total['plain']:.3f}")
        if "llama.cpp" in total:
            line += f", vs llama.cpp {lat / total['llama.cpp']:.3f}"
        line += (f"; identical to plain {sum(1 for r in rs if r.get('identical_to_plain'))}/{len(rs)}; "
                 f"passes {sum(passes) if passes else '-'}; score {st.mean(r.get('score', 0) for r in rs):.2f}")
        print(line)
        if m not in ("plain", "llama.cpp"):
            back = sum(prefill(recs[i, "plain"]) - prefill(recs[i, m]) for i in items)
            fair = lat + back
            line = (f"{'':10} with plain's prefill added back (+{back:.1f} s): {fair:.1f} s, {tok / fair:.2f} tok/s, "
                    f"vs plain {fair / total['plain']:.3f}")
            if "llama.cpp" in total:
                line += f", vs llama.cpp {fair / total['llama.cpp']:.3f}"
            print(line)
