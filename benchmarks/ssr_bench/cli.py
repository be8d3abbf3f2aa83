"""``ssr bench``: run suites x methods, write JSON lines + a Markdown report with plots; ``--micro`` for the
engine microbenchmarks (calibration table, batched step, one-pass verification, memory). ``ssr bench ...`` (which
``ssr.cli`` forwards to ``main``) and ``python -m ssr_bench ...`` are the same command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import methods as M
from . import micro
from .agent import FRONTS
from .suites import NEEDS_DATA, SUITES, data_dir_from


BUDGETS = ("max_think_tokens", "min_think_tokens", "draft_start", "draft_interval", "max_drafts", "max_draft_tokens",
           "max_suffix_tokens", "max_tokens")


def _split(values: list[str] | None) -> list[str]:
    return [s.strip() for v in values or [] for s in v.split(",") if s.strip()]


def backend_kwargs(pairs: list[str], option: str = "--backend-arg") -> dict:
    """``["max_model_len=4096", "enforce_eager=true", "dtype=float32"]`` -> keyword arguments (values as JSON where
    they parse); ``option``: the flag that gave them, for the error."""
    import json

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{option} wants KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--suite", action="append", metavar="NAME",
                        help=f"suite(s), repeatable or comma list: {', '.join(SUITES)}, or all "
                             "(default: humaneval; smoke preset: humaneval,bfcl)")
    parser.add_argument("--methods", action="append", metavar="LIST",
                        help=f"comma list from {', '.join(M.METHODS)} or all (plain always runs: it is the "
                             "reference); all = every method that runs on --backend (the default)")
    parser.add_argument("--n", type=int, default=None, help="items per suite (default: all; smoke preset: 1)")
    parser.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--backend-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="backend argument, repeatable; values parse as JSON where they can (vLLM: "
                             "--backend-arg max_model_len=4096 --backend-arg enforce_eager=true); the vLLM peers "
                             "get the same engine arguments")
    parser.add_argument("--out", default="bench-results", help="output directory (results.jsonl, report.md, PNGs)")
    parser.add_argument("--preset", choices=("default", "smoke"), default="default",
                        help="budgets; smoke = a couple of items with tiny budgets (CI)")
    parser.add_argument("--micro", action="store_true", help="run the engine microbenchmarks instead (cost table, batched step, verify pass, RSS)")
    parser.add_argument("--micro-parts", default="abcd", help="which microbenchmarks to run (default: abcd; e: step cost against the context)")
    parser.add_argument("--micro-contexts", default=",".join(map(str, micro.CONTEXTS)), metavar="LIST",
                        help="part e: the lane lengths (tokens) to step at (default %(default)s)")
    parser.add_argument("--micro-rows", default=",".join(map(str, micro.ROWS)), metavar="LIST",
                        help="part e: the rows a step computes (default %(default)s; 1,2,4,8,16 for step shapes)")
    parser.add_argument("--concurrency", default=None, metavar="LIST",
                        help="load mode instead: N requests at once for each N of the comma list (e.g. 1,2,4,8,16), "
                             "plain vs SSR: throughput, p50/p95 latency, time vs one by one (load.md, load.png)")
    parser.add_argument("--data-dir", default=None,
                        help="benchmark data folder for classeval and longproc (default: $SSR_BENCH_DATA; "
                             "no other default)")
    parser.add_argument("--agent-front", choices=FRONTS, default="engine",
                        help="the agent suite's loop: SSREngine.generate per step, ChatSSR in LangChain's "
                             "create_agent, or the SSR LLM in a LlamaIndex FunctionAgent")
    parser.add_argument("--agent-steps", type=int, default=None, help="the agent suite's step limit (default 8)")
    parser.add_argument("--prompt-cache", choices=["cold", "warm"], default="cold",
                        help="cold: every item from an empty prompt cache; warm: each method keeps the prompts its "
                             "own earlier items cached (the engine's cache salt per method), as one session running "
                             "conversation after conversation (an agent's system prompt and tools) does")
    parser.add_argument("--costs", default=None, metavar="FILE#TABLE",
                        help="price speculation with another machine's cost table (benchmarks/gpu's gpu_costs.json "
                             "and a table name) and report each method's passes priced with it: a projection")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from --out's results")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true")
    g = parser.add_argument_group("budgets (override the preset for every suite)")
    for name in BUDGETS:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    parser.set_defaults(func=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    from .report import console_summary, write_report
    from .runner import PRESET_METHODS, PRESET_N, PRESET_SUITES, BenchRun, run_bench

    out = Path(args.out)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["SSR_BENCH_THREADS"] = str(args.threads)  # for the RSS child processes
    overrides = {k: getattr(args, k) for k in BUDGETS if getattr(args, k) is not None}
    if args.concurrency:
        from .load import run_load

        levels = [int(n) for n in _split([args.concurrency])]
        run_load(out, levels, model=args.model, backend=args.backend, overrides=overrides,
                 backend_kwargs=backend_kwargs(args.backend_arg), progress=not args.no_progress)
        print((out / "load.md").read_text())
        return 0
    if args.micro:
        result = micro.run_micro(out, model=args.model, backend=args.backend, preset=args.preset, n=args.n,
                                 parts=args.micro_parts, log=lambda s: print(s, file=sys.stderr, flush=True),
                                 overrides=overrides, backend_kwargs=backend_kwargs(args.backend_arg),
                                 contexts=tuple(int(c) for c in _split([args.micro_contexts])),
                                 rows=tuple(int(r) for r in _split([args.micro_rows])))
        print((out / "micro.md").read_text())
        return 0 if result else 1
    suites = _split(args.suite) or list(PRESET_SUITES[args.preset])
    if suites == ["all"]:
        suites = list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    if not args.report_only and set(suites) & set(NEEDS_DATA):
        try:  # before any model loads
            data_dir_from(args.data_dir)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        preset = [m for m in PRESET_METHODS[args.preset] if m == "all" or m in M.backend_methods(args.backend)]
        methods = M.parse_methods(_split(args.methods) or preset, args.backend)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.report_only:
        run = BenchRun(suites=suites, methods=methods, out=out, n=args.n if args.n is not None else PRESET_N[args.preset],
                       model=args.model, backend=args.backend, preset=args.preset, overrides=overrides,
                       data_dir=args.data_dir, progress=not args.no_progress,
                       backend_kwargs=backend_kwargs(args.backend_arg), agent_front=args.agent_front,
                       agent_steps=args.agent_steps, costs=args.costs, prompt_cache=args.prompt_cache)
        run_bench(run)
    results = out / "results.jsonl"
    report = write_report(results)
    print(console_summary(results))
    print(f"report: {report}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m ssr_bench") -> int:
    """``python -m ssr_bench ...``, and ``ssr bench ...`` (which forwards here with ``prog="ssr bench"``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input (a data folder, a model, a config value): its message, no traceback
        parser.exit(2, f"{prog}: error: {exc}\n")
