"""Does the engine's work per token grow with the length of the chain of thought? (``python -m ssr_bench.long_chain``)

A tiny random Qwen2 (hidden 64, 2 layers) with the real 151k vocabulary and tokenizer thinks for ``max(lengths)``
tokens, plain and SSR, streamed through ``SSREngine`` as an application would. The model is so small that the
engine's own work (transcript, streaming, sampling, proposals) is a large share of each step, so any part of it that
grows with the chain shows. Each push into the transcript is timestamped; per-token time at length L is the mean over
the ``window`` tokens before L, split into the backend's forward passes and the rest (the engine). A cProfile of the
window before the last one shows what dominates at the longest length.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import torch

VOCAB_SIZE = 151936  # the default model's embedding rows (the tokenizer has 151665 tokens)
PROMPT = "Explain step by step why the sum of two odd numbers is even."


class _MaskedBackend:
    """The backend with EOS banned, so that a random model thinks to the budget; every step is timed."""

    def __init__(self, backend, banned: list[int]) -> None:
        self._backend, self._banned = backend, banned
        self.steps: list[tuple[float, float]] = []  # (start, seconds) of each forward pass

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def step(self, feeds, want=None):
        t0 = time.perf_counter()
        out = self._backend.step(feeds, want)
        for logits in out.values():
            logits[..., self._banned] = float("-inf")
        self.steps.append((t0, time.perf_counter() - t0))
        return out


def build_engine(max_length: int, seed: int = 0):
    """A random two-layer Qwen2 with the real vocabulary, on the transformers backend, with the real tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from ssr.backends.transformers import TransformersBackend
    from ssr.chat import QWEN2_INSTRUCT
    from ssr.costs import CostTable
    from ssr.engine import SSREngine
    from ssr.models import DEFAULT_MODEL, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=max(9000, max_length + 1024), initializer_range=0.3,
                         tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643)
    model = Qwen2ForCausalLM(config).float().eval()
    eos = [151643, 151645]
    backend = _MaskedBackend(TransformersBackend(model, "tiny-qwen2-151k", eos, 151643), eos)
    # a flat cost table: every SSR path runs all along, whatever this machine's costs
    return SSREngine(backend, tokenizer, family=QWEN2_INSTRUCT, model_name="tiny-qwen2-151k",
                     costs=CostTable.flat()), backend


def _run(engine, backend, config, lengths, window: int, profile_top: int) -> dict[str, Any]:
    """Stream one request, timestamping every transcript push; profile the window before the last one."""
    from ssr import transcript

    pushes: list[float] = []
    profiler = cProfile.Profile()
    longest = max(lengths)
    original = transcript.Transcript.push

    def push(self, token):
        status = original(self, token)
        pushes.append(time.perf_counter())
        if len(pushes) == longest - 2 * window:
            profiler.enable()
        elif len(pushes) == longest - window:
            profiler.disable()
        return status

    backend.steps.clear()
    transcript.Transcript.push = push
    try:
        start = time.perf_counter()
        result = None
        for event in engine.stream(PROMPT, config=config):
            if event.kind == "done":
                result = event.result
        wall = time.perf_counter() - start
    finally:
        transcript.Transcript.push = original
        profiler.disable()
    rows = {}
    for length in lengths:
        a, b = max(0, length - window - 1), min(length, len(pushes)) - 1
        t0, t1 = pushes[a], pushes[b]
        forward = sum(s for t, s in backend.steps if t0 < t <= t1)
        steps = sum(1 for t, _ in backend.steps if t0 < t <= t1)
        rows[length] = {"per_token_ms": 1e3 * (t1 - t0) / (b - a), "backend_ms": 1e3 * forward / (b - a),
                        "engine_ms": 1e3 * (t1 - t0 - forward) / (b - a), "tokens_per_step": (b - a) / max(steps, 1)}
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_top)
    stats = result.stats if result is not None else {}
    return {"lengths": rows, "think_tokens": stats.get("think_tokens"), "wall_s": wall,
            "ratio": {k: rows[longest][k] / rows[min(lengths)][k] for k in ("per_token_ms", "engine_ms")},
            "profile": text.getvalue()}


def per_token_engine_time(lengths=(256, 2048, 8192), window: int = 128, seed: int = 0, profile_top: int = 15,
                          modes=("plain", "ssr")) -> dict:
    """Per-token wall time (total, backend forward passes, engine rest) at each chain length, plain and SSR, the
    ratio longest/shortest, and a cProfile top list (self time) at the longest length."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation (ms per op on a shared CPU)
    try:
        return _measure(lengths, window, seed, profile_top, modes)
    finally:
        torch.set_num_threads(threads)


def _measure(lengths, window, seed, profile_top, modes) -> dict:
    from ssr.config import SSRConfig

    longest = max(lengths)
    engine, backend = build_engine(longest, seed)
    budget = dict(max_think_tokens=longest, min_think_tokens=longest, max_tokens=longest + 16)
    configs = {"plain": SSRConfig(enabled=False, **budget), "ssr": SSRConfig(**budget)}
    engine.generate(PROMPT, config=configs["plain"].override(max_think_tokens=8, min_think_tokens=8, max_tokens=12))
    return {mode: _run(engine, backend, configs[mode], lengths, window, profile_top) for mode in modes}


def to_markdown(results: dict) -> str:
    lines = ["| mode | chain length | per token (ms) | backend (ms) | engine rest (ms) | tokens / step |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in results.items():
        for length, row in r["lengths"].items():
            lines.append(f"| {mode} | {length} | {row['per_token_ms']:.3f} | {row['backend_ms']:.3f} | "
                         f"{row['engine_ms']:.3f} | {row['tokens_per_step']:.2f} |")
    lines.append("")
    for mode, r in results.items():
        lines.append(f"{mode}: longest/shortest per token {r['ratio']['per_token_ms']:.2f}x, engine rest "
                     f"{r['ratio']['engine_ms']:.2f}x ({r['think_tokens']} thinking tokens, {r['wall_s']:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,2048,8192", help="chain lengths to time (comma-separated)")
    parser.add_argument("--window", type=int, default=128, help="tokens averaged before each length")
    parser.add_argument("--modes", default="plain,ssr")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    results = per_token_engine_time(tuple(int(x) for x in args.lengths.split(",")), window=args.window,
                                    modes=tuple(args.modes.split(",")))
    print(to_markdown(results))
    if not args.no_profile:
        for mode, r in results.items():
            print(f"\n## cProfile, {mode}, the {args.window} tokens before the last window\n```\n"
                  f"{r['profile'].strip()}\n```")


if __name__ == "__main__":
    main()
