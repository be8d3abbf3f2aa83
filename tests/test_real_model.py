"""The embedded default model (Qwen2.5-Coder-0.5B-Instruct, float32): exactness, counts, streaming, bad input."""

from __future__ import annotations

import asyncio
import time

import pytest

from ssr import SSRConfig, SSREngine
from ssr.costs import CostTable

pytestmark = pytest.mark.real_model

BUDGET = dict(max_think_tokens=48, max_tokens=112, draft_start=8)
PROMPTS = [
    "Write a Python function is_even(n) that returns True when n is even.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def pairs(default_engine):
    out = []
    for prompt in PROMPTS:
        plain = default_engine.generate(prompt, config=SSRConfig(enabled=False, **BUDGET))
        ssr = default_engine.generate(prompt, config=SSRConfig(**BUDGET))
        out.append((prompt, plain, ssr))
    return out


def test_greedy_identity_real_model(pairs):
    for prompt, plain, ssr in pairs:
        assert ssr.token_ids == plain.token_ids, prompt
        assert ssr.answer == plain.answer


def test_reasoning_and_answer_are_split(pairs):
    for _, plain, _ in pairs:
        assert plain.reasoning and plain.answer
        assert "</think>" not in plain.answer and "<think>" not in plain.reasoning
        assert "def " in plain.answer


def test_draft_accepted_needs_few_verify_passes(default_engine, pairs):
    """Counts, not times: accepted draft tokens replace answer steps one for one. The counts must not depend on the
    machine's measured costs, so this engine (sharing the loaded model) prices every step alike: every proposal
    and draft is taken."""
    prompt, plain, _ = pairs[0]
    flat = SSREngine(default_engine.backend, default_engine.tokenizer, family=default_engine.family,
                     costs=CostTable.flat())
    ssr = flat.generate(prompt, config=SSRConfig(**BUDGET))
    assert ssr.token_ids == plain.token_ids
    s = ssr.stats
    assert s["accepted_tokens"] >= 0.8 * s["answer_tokens"]
    assert s["answer_forward_passes"] <= s["answer_tokens"] // 4
    assert plain.stats["answer_forward_passes"] == plain.stats["answer_tokens"]
    assert s["forward_passes_saved"] == plain.stats["forward_passes"] - s["forward_passes"]


def test_forced_close_and_stop_string_identity(default_engine):
    prompt = PROMPTS[1]
    for cfg in (dict(max_think_tokens=10, max_tokens=60, draft_start=4), dict(BUDGET, stop=("return",))):
        plain = default_engine.generate(prompt, config=SSRConfig(enabled=False, **cfg))
        ssr = default_engine.generate(prompt, config=SSRConfig(**cfg))
        assert ssr.token_ids == plain.token_ids
        assert ssr.answer == plain.answer
    assert "return" not in ssr.answer and ssr.finish_reason == "stop"


def test_async_stream_matches_and_cancel_frees_lanes(default_engine):
    config = SSRConfig(**BUDGET)

    async def collect():
        chunks = {"reasoning": "", "answer": ""}
        result = None
        async for event in default_engine.astream(PROMPTS[0], config=config):
            if event.kind == "done":
                result = event.result
            else:
                chunks[event.kind] += event.text
        return chunks, result

    async def cancel_early():
        stream = default_engine.astream(PROMPTS[0], config=config)
        async for _ in stream:
            break
        await stream.aclose()
        await asyncio.sleep(0.5)

    chunks, result = asyncio.run(collect())
    assert chunks["reasoning"] == result.reasoning and chunks["answer"] == result.answer
    asyncio.run(cancel_early())
    for _ in range(300):  # the cancelled request stops at its next pass boundary and releases every lane
        load = default_engine.load_stats()
        if load["running"] == 0 and load["live_lanes"] == 0:
            break
        time.sleep(0.1)
    assert load["running"] == 0 and load["live_lanes"] == 0, load


def test_bad_input_gives_clear_errors(default_engine):
    with pytest.raises(ValueError, match="empty"):
        default_engine.generate("")
    with pytest.raises(ValueError, match="empty"):
        default_engine.generate([])
    with pytest.raises(ValueError, match="context window"):
        default_engine.generate(list(range(10, 10 + default_engine.context_window)))
    with pytest.raises(ValueError, match="unknown model"):
        SSREngine.from_pretrained("no-such-model-anywhere")
    with pytest.raises(ValueError, match="max_think_tokens"):
        SSRConfig(max_think_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        default_engine.generate("hi", top_p=0.0)
    with pytest.raises(ValueError, match="unknown backend"):
        SSREngine.from_pretrained(None, backend="nope")


def test_every_end_of_text_token_ends_the_answer(default_engine):
    """The embedded checkpoint's generation config names only <|im_end|>; <|endoftext|> must end a turn too (the
    0.5B model sometimes writes it and then a made-up next user turn)."""
    tok = default_engine.tokenizer
    ends = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert ends <= default_engine.backend.eos_token_ids
