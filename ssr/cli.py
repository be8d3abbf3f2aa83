"""The ``ssr`` command: ``ssr chat "question"`` streams a reasoning chat with SSR; ``ssr calibrate`` measures this
machine's step costs; ``ssr serve`` serves a model over an OpenAI-compatible HTTP API; ``ssr bench`` runs
benchmarks (forwarded to the separate ssr-bench package, benchmarks/, when it is installed)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import SSRConfig

DIM, BOLD, RESET = "\033[2m", "\033[1m", "\033[0m"


def _config_args(parser: argparse.ArgumentParser) -> None:
    d = SSRConfig()
    parser.add_argument("--model", default=None, help="model name or local directory (default: the embedded "
                                                      "Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--backend", default="auto", help="auto (llama.cpp for the embedded model when "
                        "llama-cpp-python is installed, else transformers) | transformers | vllm | vllm-server | "
                        "llama.cpp")
    parser.add_argument("--max-think-tokens", type=int, default=d.max_think_tokens)
    parser.add_argument("--min-think-tokens", type=int, default=d.min_think_tokens)
    parser.add_argument("--draft-start", type=int, default=d.draft_start)
    parser.add_argument("--draft-interval", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=None)


def _config(args) -> SSRConfig:
    return SSRConfig(max_think_tokens=args.max_think_tokens, min_think_tokens=args.min_think_tokens,
                     draft_start=args.draft_start, draft_interval=args.draft_interval, max_tokens=args.max_tokens,
                     temperature=args.temperature, seed=args.seed)


def chat(args) -> int:
    from .engine import SSREngine

    color = sys.stdout.isatty() and not args.no_color
    dim, bold, reset = (DIM, BOLD, RESET) if color else ("", "", "")
    from .backends import choose_backend
    from .models import canonical_name

    backend = choose_backend(args.backend, canonical_name(args.model))
    engine = SSREngine.from_pretrained(args.model, backend=backend)
    config = _config(args)
    for enabled in (True, False):  # untimed: a process's first steps pay one-off set-up that neither method owns
        engine.generate(args.question, config=config.override(enabled=enabled, max_tokens=4, draft_start=0))
    weights = getattr(engine.backend, "weights_path", None)
    rewritten = weights and weights != engine.backend.model_path  # ssr.backends.gguf_weights: measured faster here
    print(f"{bold}model:{reset} {engine.model_name} ({backend}"
          + ("; its Q5_0 weights read as Q8_0, the same values, measured faster on this machine" if rewritten else "")
          + f")\n{bold}reasoning:{reset}")
    start, kind, result = time.perf_counter(), "reasoning", None
    for event in engine.stream(args.question, config=config):
        if event.kind == "done":
            result = event.result
            break
        if event.kind != kind:
            print(f"\n\n{bold}answer:{reset}")
            kind = event.kind
        print(f"{dim}{event.text}{reset}" if kind == "reasoning" else event.text, end="", flush=True)
    ssr_seconds = time.perf_counter() - start
    if result is None:
        raise RuntimeError("the stream ended without a result")  # unreachable: "done" ends every stream
    print("\n")
    _print_stats(result.stats, ssr_seconds, bold, reset)
    if not args.no_baseline:
        start = time.perf_counter()
        plain = engine.generate(args.question, config=config.override(enabled=False))
        plain_seconds = time.perf_counter() - start
        print(f"{bold}plain decoding of the same request:{reset} {plain_seconds:.1f} s, "
              f"{plain.stats['forward_passes']} forward passes; output {_agreement(engine, plain, result)}")
        print(f"{bold}SSR latency:{reset} {ssr_seconds / plain_seconds:.2f}x plain "
              f"({100 * (1 - ssr_seconds / plain_seconds):.1f}% saved; answer phase "
              f"{result.stats['seconds']['answer']:.1f} s vs {plain.stats['seconds']['answer']:.1f} s)")
    return 0


def _agreement(engine, plain, result) -> str:
    """SSR's output against plain decoding's, as the backend's exactness rule states it (``ssr.agreement``)."""
    from .agreement import compare

    found = compare(plain.token_ids, plain.near_ties, result.token_ids)
    if found.identical:
        return "identical: True"
    if found.near_tie:
        return (f"identical up to token {found.diverged_at}, a near-tie of plain decoding's (the two tokens' logits "
                f"{found.margin:.3f} apart, within twice the kernel noise measured here, {engine.tie_window:.3f}: "
                "either token is the model's)")
    return f"identical: False (from token {found.diverged_at}; not a near-tie)"


def _print_stats(stats: dict, seconds: float, bold: str, reset: str) -> None:
    drafts = ", ".join(f"budget {d['budget']}: {d['accepted']}/{d['length']} accepted" for d in stats["drafts"])
    think = stats["speculation"]["think"]
    print(f"{bold}SSR:{reset} {seconds:.1f} s; thinking {stats['think_tokens']} tokens "
          f"(closed by {stats['think_closed_by']}; {think['accepted']} of them from proposals, "
          f"{stats['think_forward_passes']} passes), answer {stats['answer_tokens']} tokens "
          f"({stats['accepted_tokens']} from drafts and proposals: prefix {stats['accepted_prefix_tokens']}, "
          f"suffix {stats['accepted_suffix_tokens']}; {stats['answer_forward_passes']} passes)")
    print(f"{bold}forward passes:{reset} {stats['forward_passes']} (plain decoding needs "
          f"{stats['plain_forward_passes']}; saved {stats['forward_passes_saved']}); drafts: {drafts or 'none'}"
          + (f" ({stats['forks_declined']} declined by the cost model)" if stats["forks_declined"] else ""))
    cost = stats.get("cost_model")
    if cost:
        print(f"{bold}cost model{reset} ({cost['source']} on this machine; one step {cost['base_ms']:.0f} ms): an "
              f"extra lane adds {cost['extra_lane']:.2f} of a step; verifying 4 / 8 / 16 tokens costs "
              f"{cost['verify_4']:.2f} / {cost['verify_8']:.2f} / {cost['verify_16']:.2f} steps"
              + (f"; linear kernels {_kernels(cost['kernels'])}" if cost.get("kernels") else ""))


def _kernels(table) -> str:
    from .calibrate import kernels_text

    return kernels_text(table)


def calibrate(args) -> int:
    """Measure (again) the kernel choice and the step-cost table of the model on this machine, and cache them."""
    from .backends import choose_backend, load_backend
    from .calibrate import NOISY, cache_path, calibrated, kernels_text, markdown
    from .models import backend_model_path, canonical_name

    name = canonical_name(args.model)
    chosen = choose_backend(args.backend, name)
    backend = load_backend(chosen, backend_model_path(chosen, args.model), name)
    table = calibrated(backend, refresh=True)
    kernels = table.meta.get("kernels")
    print(f"model: {name} ({chosen}, {table.meta.get('dtype')}, {table.meta.get('device')}); "
          f"machine: {table.meta.get('machine')}")
    weights = getattr(backend, "weights_path", None)
    if weights:
        print(f"weights: {weights}")
    print(f"linear kernel per input rows: {kernels_text(kernels) if kernels else 'not chosen by this backend'}")
    print(f"step cost relative to one lane decoding one token ({1e3 * table.base_seconds:.1f} ms, "
          f"context {table.meta.get('context')} tokens):\n")
    print(markdown(table))
    if "noise" in table.meta:
        print(f"\nkernel noise (rows depend on the batch): {table.meta['noise']:.4f}; near-tie window "
              f"{2 * table.meta['noise']:.4f}")
    if table.meta.get("spread", 0) > NOISY:
        print(f"\nnot cached: repetitions of a point differ by {100 * table.meta['spread']:.0f}% (median), so other "
              "processes shared the machine; measure again when it is idle")
    else:
        print(f"\ncached in {cache_path(backend, context=table.meta['context'], rows=table.rows, widths=table.widths)}")
    return 0


def serve(args) -> int:
    """Serve the model over an OpenAI-compatible HTTP API until interrupted (Ctrl-C)."""
    try:
        import uvicorn

        from .serve import run
        del uvicorn  # only its presence is checked here
    except ImportError as exc:
        raise SystemExit(f"ssr serve needs the serve extra: pip install \"ssr[serve]\" ({exc})") from None
    run(model=args.model, backend=args.backend, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("SSR_API_KEY") or None, config=_config(args),
        served_model_name=args.served_model_name, timeout=args.timeout, max_queue=args.max_queue,
        max_running=args.max_running, log_level=args.log_level)
    return 0


BENCH_INSTALL = "pip install -e ./benchmarks"  # from the repository root: the ssr-bench distribution


def bench(argv: list[str]) -> int:
    """``ssr bench ...``: the harness is the ssr-bench package (benchmarks/), kept apart from the engine, so it is
    imported only here."""
    try:
        from ssr_bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "ssr_bench":  # installed, but one of its own dependencies is missing: say which
            raise
        raise SystemExit(f"ssr bench needs the ssr-bench package; install it from the SSR repository root with: "
                         f"{BENCH_INSTALL}") from None
    return bench_main(argv, prog="ssr bench")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show llama.cpp's own log lines (as SSR_VERBOSE=1 does); errors are always shown")
    parser = argparse.ArgumentParser(prog="ssr", description=__doc__, parents=[common])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("chat", parents=[common],
                            help="a reasoning chat with SSR, compared with plain decoding")
    p.add_argument("question")
    _config_args(p)
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding comparison")
    p.add_argument("--no-color", action="store_true")
    p.set_defaults(func=chat)
    p = commands.add_parser("calibrate", parents=[common],
                            help="measure this machine's step costs (and linear kernels) for a model")
    p.add_argument("--model", default=None, help="model name or local directory (default: the embedded model)")
    p.add_argument("--backend", default="auto", help="auto | transformers | vllm | vllm-server | llama.cpp")
    p.set_defaults(func=calibrate)
    p = commands.add_parser("serve", parents=[common],
                            help="an OpenAI-compatible HTTP server (chat completions, streaming, tools)")
    _config_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: "
                                                   "$SSR_API_KEY; none: no key)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the engine's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds a request may take, queue included (408)")
    p.add_argument("--max-queue", type=int, default=None, help="requests that may wait to start (503 past it)")
    p.add_argument("--max-running", type=int, default=None, help="requests decoded together")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=serve)
    p = commands.add_parser("bench", add_help=False, help="benchmark SSR against plain decoding and peers (the "
                            f"ssr-bench package: {BENCH_INSTALL}); ssr bench --help")
    p.set_defaults(func=lambda args: bench([]))  # `ssr bench ...` is forwarded before parsing, above
    args = parser.parse_args(argv)
    if getattr(args, "verbose", False):
        os.environ["SSR_VERBOSE"] = "1"  # read by every llama.cpp backend this process (and its children) loads
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"ssr: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
