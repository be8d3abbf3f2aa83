"""Measure SSR on vLLM against plain vLLM decoding and vLLM's own CPU speculative methods.

    python -m ssr_bench.vllm_bench --model PATH [--methods native,plain,ssr,ngram,suffix] [--prompts 2]
    python -m ssr_bench.vllm_bench --model PATH --overhead      # per-step cost of the backend's mechanisms
    python -m ssr_bench.vllm_bench --model PATH --interleaved   # native / plain / SSR alternating, one process

Each method runs in its own subprocess (one vLLM engine per process), the same prompts, float32, greedy:

* ``native``: ``LLM.generate`` (vLLM's own decoding loop) of as many tokens as SSR's plain mode produced;
* ``plain``: ``SSRConfig(enabled=False)`` through the "vllm" backend (the engine's baseline, one step per token);
* ``ssr``: SSR through the "vllm" backend;
* ``ngram`` / ``suffix``: vLLM's speculative decoding (prompt lookup; Arctic suffix decoding, if installed) of the
  same prompt ids and token count.

``--overhead`` times, on one prompt: vLLM's own decode step, a backend step on one lane (a session chunk), the same
through a fresh prefix-cached request per step (the mechanism not chosen), and a backend step over 3 lanes.
Prints one JSON line per measurement. Keep runs small on shared CPUs (VLLM_CPU_KVCACHE_SPACE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that merges two sorted lists into one sorted list.",
]
ENGINE = dict(max_model_len=2048, seed=0, dtype="float32", max_num_seqs=16)


def _config(args):
    from ssr import SSRConfig

    return dict(max_think_tokens=args.think, max_tokens=args.max_tokens, draft_start=args.draft_start,
                max_draft_tokens=args.max_tokens), SSRConfig


def run_engine_method(args) -> None:
    from ssr import SSREngine

    cfg, SSRConfig = _config(args)
    engine = SSREngine.from_pretrained(model=args.model, backend="vllm", enforce_eager=args.eager, **ENGINE)
    engine.generate(PROMPTS[0], config=SSRConfig(enabled=False, **{**cfg, "max_tokens": 8}))  # warm up
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        config = SSRConfig(enabled=args.method == "ssr", **cfg)
        t0 = time.perf_counter()
        res = engine.generate(prompt, config=config)
        wall = time.perf_counter() - t0
        st = res.stats
        print(json.dumps({"method": args.method, "prompt": i, "seconds": round(wall, 3), "tokens": len(res.token_ids),
                          "prompt_ids": engine.encode(prompt), "token_ids": res.token_ids,
                          "forward_passes": st["forward_passes"], "accepted": st["accepted_tokens"],
                          "think_tokens": st["think_tokens"], "answer_tokens": st["answer_tokens"],
                          "engine_steps": engine.backend.engine_steps}), flush=True)


def run_vllm_method(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif args.method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": 16}
    llm = LLM(model=args.model, enforce_eager=args.eager, enable_prefix_caching=True, speculative_config=spec,
              disable_log_stats=True, **ENGINE)
    jobs = [json.loads(line) for line in open(args.jobs)]
    llm.generate([TokensPrompt(prompt_token_ids=jobs[0]["prompt_ids"])], SamplingParams(max_tokens=8), use_tqdm=False)
    for job in jobs:
        params = SamplingParams(max_tokens=job["tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=job["prompt_ids"])], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        print(json.dumps({"method": args.method, "prompt": job["prompt"], "seconds": round(wall, 3),
                          "tokens": len(out[0].outputs[0].token_ids)}), flush=True)


def run_overhead(args) -> None:
    """Per-step cost: vLLM's decode step vs the backend's session step vs fresh prefix-cached requests."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ssr.backends.vllm import VLLMBackend

    b = VLLMBackend(args.model, enforce_eager=args.eager, **ENGINE)
    engine = b._engine
    prompt = b.tokenizer.encode(PROMPTS[0]) * 4
    n = args.steps

    def native():
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        b.llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1), use_tqdm=False)
        t0 = time.perf_counter()
        out = b.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return (time.perf_counter() - t0) / n, list(out[0].outputs[0].token_ids)

    def sessions(lanes: int):
        root = b.new_lane()
        tok = int(b.step({root: prompt})[root][-1].argmax())
        ids = [root] + [b.fork(root) for _ in range(lanes - 1)]
        first = b.step({i: [tok] for i in ids})  # forks start their sessions
        toks = {i: int(first[i][-1].argmax()) for i in ids}
        gen = []
        t0 = time.perf_counter()
        for _ in range(n):
            out = b.step({i: [toks[i]] for i in ids})
            toks = {i: int(out[i][-1].argmax()) for i in ids}
            gen.append(toks[root])
        dt = (time.perf_counter() - t0) / n
        b.release_all()
        return dt, gen

    def fresh():
        toks = list(prompt)
        t0 = time.perf_counter()
        for k in range(n):
            rid = f"fresh-{time.monotonic_ns()}-{k}"
            out = engine.run([engine.chunk(rid, toks, False, 1, None)])[rid]
            toks.append(int(out.new_logprobs.logprob_token_ids[0][1]))
        return (time.perf_counter() - t0) / n

    rows = []
    for rep in range(args.reps):
        nat, ref = native()
        one, gen = sessions(1)
        three, _ = sessions(3)
        fr = fresh()
        rows.append((nat, one, three, fr))
        print(json.dumps({"rep": rep, "native_ms": round(nat * 1e3, 1), "session_1lane_ms": round(one * 1e3, 1),
                          "session_3lanes_ms": round(three * 1e3, 1), "fresh_request_ms": round(fr * 1e3, 1),
                          "same_tokens": gen[: n - 2] == ref[2:n]}), flush=True)
    med = [statistics.median(col) for col in zip(*rows)]
    print(json.dumps({"median_ms": {"native": round(med[0] * 1e3, 1), "session_1lane": round(med[1] * 1e3, 1),
                                    "session_3lanes": round(med[2] * 1e3, 1), "fresh_request": round(med[3] * 1e3, 1)},
                      "ratio_to_native": {"session_1lane": round(med[1] / med[0], 2),
                                          "session_3lanes": round(med[2] / med[0], 2),
                                          "fresh_request": round(med[3] / med[0], 2)}}), flush=True)
    b.close()


def run_interleaved(args) -> None:
    """native, plain and SSR in ONE process, alternating per prompt, so shared-CPU load hits them alike."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ssr import SSREngine

    cfg, SSRConfig = _config(args)
    engine = SSREngine.from_pretrained(model=args.model, backend="vllm", enforce_eager=args.eager, **ENGINE)
    llm = engine.backend.llm
    engine.generate(PROMPTS[0], config=SSRConfig(enabled=False, **{**cfg, "max_tokens": 8}))
    totals = {"native": 0.0, "plain": 0.0, "ssr": 0.0}
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        for rep in range(args.reps):
            t0 = time.perf_counter()
            plain = engine.generate(prompt, config=SSRConfig(enabled=False, **cfg))
            tp = time.perf_counter() - t0
            ids = engine.encode(prompt)
            params = SamplingParams(max_tokens=len(plain.token_ids), temperature=0.0, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            tn = time.perf_counter() - t0
            t0 = time.perf_counter()
            ssr = engine.generate(prompt, config=SSRConfig(**cfg))
            ts = time.perf_counter() - t0
            totals["native"] += tn
            totals["plain"] += tp
            totals["ssr"] += ts
            print(json.dumps({"prompt": i, "rep": rep, "tokens": len(plain.token_ids), "native_s": round(tn, 2),
                              "plain_s": round(tp, 2), "ssr_s": round(ts, 2),
                              "identical": ssr.token_ids == plain.token_ids,
                              "think": ssr.stats["think_tokens"], "answer": ssr.stats["answer_tokens"],
                              "ssr_passes": ssr.stats["forward_passes"], "plain_passes": plain.stats["forward_passes"],
                              "accepted": ssr.stats["accepted_tokens"]}), flush=True)
    print(json.dumps({"plain_vs_native": round(totals["plain"] / totals["native"], 3),
                      "ssr_vs_native": round(totals["ssr"] / totals["native"], 3),
                      "ssr_vs_plain": round(totals["ssr"] / totals["plain"], 3)}), flush=True)


def drive(args) -> None:
    """Run every method in its own process and print the ratios."""
    import tempfile

    here = [sys.executable, "-m", "ssr_bench.vllm_bench", "--model", args.model, "--prompts", str(args.prompts),
            "--think", str(args.think), "--max-tokens", str(args.max_tokens), "--draft-start", str(args.draft_start)]
    if args.eager:
        here.append("--eager")
    results: dict[str, list[dict]] = {}
    methods = args.methods.split(",")
    engine_methods = [m for m in methods if m in ("plain", "ssr")] or ["plain"]
    for m in ["plain"] + [x for x in engine_methods if x != "plain"]:
        out = subprocess.run(here + ["--method", m], capture_output=True, text=True)
        results[m] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        if not results[m]:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"method {m} failed")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as jobs:
        for r in results["plain"]:
            jobs.write(json.dumps({"prompt": r["prompt"], "prompt_ids": r["prompt_ids"], "tokens": r["tokens"]}) + "\n")
    for m in [x for x in methods if x not in ("plain", "ssr")]:
        out = subprocess.run(here + ["--method", m, "--jobs", jobs.name], capture_output=True, text=True)
        results[m] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        if not results[m]:
            print(f"method {m}: no result\n{out.stderr[-2000:]}", file=sys.stderr)
            results.pop(m)
    summary = {}
    for m, rows in results.items():
        summary[m] = {"seconds": round(sum(r["seconds"] for r in rows), 2), "tokens": sum(r["tokens"] for r in rows)}
    if "ssr" in results:
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(results["plain"], results["ssr"]))
        summary["ssr"]["identical_to_plain"] = same
        summary["ssr"]["accepted"] = sum(r["accepted"] for r in results["ssr"])
        summary["ssr"]["forward_passes"] = sum(r["forward_passes"] for r in results["ssr"])
        summary["plain"]["forward_passes"] = sum(r["forward_passes"] for r in results["plain"])
    base = summary.get("native", summary["plain"])["seconds"]
    for m in summary:
        summary[m]["time_vs_native"] = round(summary[m]["seconds"] / base, 3)
    for m, rows in results.items():
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k not in ("prompt_ids", "token_ids")}))
    print(json.dumps(summary, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/ssr/qwen2.5-coder-0.5b-instruct"))
    p.add_argument("--methods", default="native,plain,ssr,ngram,suffix")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--jobs", help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--think", type=int, default=96, help="max_think_tokens (budget forcing)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--draft-start", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile warm-up)")
    p.add_argument("--overhead", action="store_true")
    p.add_argument("--interleaved", action="store_true", help="native/plain/ssr alternating in one process")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.overhead:
        run_overhead(args)
    elif args.interleaved:
        run_interleaved(args)
    elif args.method in ("plain", "ssr"):
        run_engine_method(args)
    elif args.method:
        run_vllm_method(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
