"""The decoding loop's own work per pass (Python: proposals, verification, the transcript, grammar masks, near-ties),
measured on this CPU: a request's seconds less the seconds its backend steps took, per pass. A projection
(``ssr bench --costs``) prices only the passes' model steps; on a GPU, where a step of a small model is about 16 ms,
this host work comes on top (unless it overlaps the next step, which SSR's loop does not do).

    python benchmarks/gpu/host_overhead.py [--n 3] [--costs FILE#TABLE]     (plain, suffix and ssr, as ssr bench)
"""

from __future__ import annotations

import argparse
import json
import time

from ssr_bench.methods import method_config
from ssr_bench.projection import load_table, price_with
from ssr_bench.runner import base_config
from ssr_bench.suites import load_suite

from ssr import get_engine
from ssr.history import OutputHistory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="HumanEval items")
    parser.add_argument("--costs", default=None, help="price speculation with this table (ssr bench --costs)")
    args = parser.parse_args()
    engine = get_engine()
    if args.costs:
        price_with(engine, load_table(args.costs))
    step = engine.backend.step
    spent = [0.0]

    def timed_step(feeds, want=None):
        t0 = time.perf_counter()
        try:
            return step(feeds, want)
        finally:
            spent[0] += time.perf_counter() - t0

    engine.backend.step = timed_step
    base = base_config("humaneval")
    items = load_suite("humaneval", n=args.n)
    engine.generate(items[0]["messages"], config=base.override(max_tokens=8))  # warm up
    out = {}
    for method in ("plain", "suffix", "ssr"):
        host, passes = 0.0, 0
        engine.history = OutputHistory(engine.history.max_tokens)  # as ssr bench: a method copies only its own
        for item in items:
            engine.backend.release_all()
            spent[0] = 0.0
            t0 = time.perf_counter()
            result = engine.generate(item["messages"], config=method_config(method, base))
            host += time.perf_counter() - t0 - spent[0]
            passes += result.stats["forward_passes"]
        out[method] = {"passes": passes, "host_ms_per_pass": round(1e3 * host / passes, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
