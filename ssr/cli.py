"""The ``ssr`` command: ``ssr chat "question"`` streams a reasoning chat with SSR; ``ssr bench`` runs benchmarks."""

from __future__ import annotations

import argparse
import sys
import time

from .config import SSRConfig

DIM, BOLD, RESET = "\033[2m", "\033[1m", "\033[0m"


def _config_args(parser: argparse.ArgumentParser) -> None:
    d = SSRConfig()
    parser.add_argument("--model", default=None, help="model name or local directory (default: the embedded "
                                                      "Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--backend", default="transformers", help="transformers | vllm | vllm-server")
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
    engine = SSREngine.from_pretrained(args.model, backend=args.backend)
    config = _config(args)
    print(f"{bold}model:{reset} {engine.model_name} ({args.backend})\n{bold}reasoning:{reset}")
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
    print("\n")
    _print_stats(result.stats, ssr_seconds, bold, reset)
    if not args.no_baseline:
        start = time.perf_counter()
        plain = engine.generate(args.question, config=config.override(enabled=False))
        plain_seconds = time.perf_counter() - start
        same = plain.token_ids == result.token_ids
        print(f"{bold}plain decoding of the same request:{reset} {plain_seconds:.1f} s, "
              f"{plain.stats['forward_passes']} forward passes; output identical: {same}")
        print(f"{bold}SSR latency:{reset} {ssr_seconds / plain_seconds:.2f}x plain "
              f"({100 * (1 - ssr_seconds / plain_seconds):.1f}% saved; answer phase "
              f"{result.stats['seconds']['answer']:.1f} s vs {plain.stats['seconds']['answer']:.1f} s)")
    return 0


def _print_stats(stats: dict, seconds: float, bold: str, reset: str) -> None:
    drafts = ", ".join(f"budget {d['budget']}: {d['accepted']}/{d['length']} accepted" for d in stats["drafts"])
    print(f"{bold}SSR:{reset} {seconds:.1f} s; thinking {stats['think_tokens']} tokens "
          f"(closed by {stats['think_closed_by']}), answer {stats['answer_tokens']} tokens, "
          f"{stats['accepted_tokens']} from drafts and proposals "
          f"(prefix {stats['accepted_prefix_tokens']}, suffix {stats['accepted_suffix_tokens']})")
    print(f"{bold}forward passes:{reset} {stats['forward_passes']} (plain decoding needs "
          f"{stats['plain_forward_passes']}; saved {stats['forward_passes_saved']}); answer phase "
          f"{stats['answer_forward_passes']} passes, {stats['verify_passes']} of them verifying; drafts: "
          f"{drafts or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssr", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("chat", help="a reasoning chat with SSR, compared with plain decoding")
    p.add_argument("question")
    _config_args(p)
    p.add_argument("--no-baseline", action="store_true", help="skip the plain-decoding comparison")
    p.add_argument("--no-color", action="store_true")
    p.set_defaults(func=chat)
    try:
        from .bench.cli import add_parser
    except ImportError:  # the bench extra is not installed
        add_parser = None
    if add_parser is not None:
        add_parser(commands)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"ssr: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
