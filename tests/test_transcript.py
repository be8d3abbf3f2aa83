"""Transcript's incremental text equals full decoding at every step, and its decoding work per token stays flat.

Each case pushes the same tokens through a Transcript and through a reference whose text views decode everything
from scratch (what Transcript did before it decoded incrementally), and compares every public text method, the
streaming view and the state after every push. Also ``json_object_end``, the JSON scan the transcript's
rules use.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ssr.chat import QWEN2_INSTRUCT, ChatFamily
from ssr.config import SSRConfig
from ssr.transcript import CLOSED, FINISHED, REWOUND, Transcript, json_object_end
from tiny import TINY_FAMILY, TOOL_VOCAB, tiny_tokenizer

QWEN_PATH = Path.home() / ".cache/ssr/qwen2.5-coder-0.5b-instruct"
QWEN_EOS = frozenset({151643, 151645})
OPENING = '<tool_call>\n{"name": "f", "arguments":'


class FullText:
    """The non-incremental text view: ``decode(tokens[start:end])`` from scratch on every call."""

    def __init__(self, decode, tokens, start=0):
        self.decode, self.tokens, self.start = decode, tokens, start

    def truncate(self, n):
        pass

    def text(self, end=None):
        return self.decode(self.tokens[self.start: len(self.tokens) if end is None else max(end, self.start)])


class Reference(Transcript):
    text_view = FullText


def reference_visible(t: Transcript, hold: int) -> tuple[str, str]:
    """``Request._deltas``' text before streaming moved into Transcript, by full decodes; one change: an answer
    shorter than ``hold`` shows nothing (the old slice ``answer[: len(answer) - hold]`` went negative and showed
    text that a stop string could still remove)."""
    if t.thinking and t.finish is None:
        lag = len(t.close_ids) + 1
        text = t.decode(t.tokens[: max(0, len(t.tokens) - lag)]).strip()
        text = text[:-1] if text.endswith("\ufffd") else text
    else:
        text = t.reasoning()
    answer = t.answer()
    if t.finish is None:
        answer = answer[: max(0, len(answer) - hold)] if hold else answer
        answer = answer[:-1] if answer.endswith("\ufffd") else answer
    return text, answer


STATE = ("tokens", "thinking", "answer_start", "answer_residual", "reasoning_text", "closed_by", "finish", "forced")


def check(t: Transcript, ref: Transcript, hold: int) -> None:
    for name in STATE:
        assert getattr(t, name) == getattr(ref, name), name
    full = t.decode(t.tokens)
    raw = "" if t.answer_start is None else t.answer_residual + t.decode(t.tokens[t.answer_start:])
    assert t.raw_answer() == ref.raw_answer() == raw
    assert t.answer() == ref.answer()
    assert t.reasoning() == ref.reasoning()
    if t.answer_start is None and not t.reasoning_text:
        assert t.reasoning() == full.strip()
    assert t.visible(hold) == reference_visible(ref, hold)
    assert t.call_end(t.raw_answer()) == ref.call_end(ref.raw_answer())


def run(tokenizer, family: ChatFamily, tokens: list[int], eos=frozenset(), thinking: bool = True,
        opening: str = "", **config) -> list[str]:
    """Push ``tokens`` until the transcript finishes, checking after every push; returns the statuses."""
    cfg = SSRConfig(**{"max_think_tokens": 10_000, "max_tokens": 20_000, **config})
    hold = max((len(s) for s in cfg.stop), default=1) - 1
    t, ref = (cls(tokenizer, family, cfg, eos, thinking=thinking, answer_opening=opening) for cls in (Transcript,
                                                                                                    Reference))
    check(t, ref, hold)
    statuses = []
    for token in tokens:
        status = t.push(token)
        assert ref.push(token) == status
        statuses.append(status)
        check(t, ref, hold)
        if status == FINISHED:
            break
    return statuses


@pytest.fixture(scope="module")
def qwen():
    if not QWEN_PATH.exists():
        pytest.skip("the default model's tokenizer is not cached")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN_PATH)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


MIXED = ("Let me think about 𠜎𠜱 and 🧑‍🚀👩🏽‍🔬 — 你好，世界。我们今天讨论量子计算 ñé ü ß Ω 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "
         "<tool_call> done")


def test_multibyte_text_really_splits_characters(qwen):
    ids = encode(qwen, MIXED)
    assert any(qwen.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))


def test_real_text_close_answer_and_stop(qwen):
    ids = encode(qwen, MIXED + "\n</think>\n\nThe answer is 42 🎉 你好世界 STOP and more")
    statuses = run(qwen, QWEN2_INSTRUCT, ids, QWEN_EOS, stop=("STOP", "世界 S"))
    assert CLOSED in statuses and statuses[-1] == FINISHED


def test_real_text_min_think_rewind(qwen):
    ids = encode(qwen, "𠜎 short </think> 🧑‍🚀 again </think>\n\nanswer 你好 " + MIXED)
    statuses = run(qwen, QWEN2_INSTRUCT, ids, QWEN_EOS, min_think_tokens=12)
    assert REWOUND in statuses and CLOSED in statuses


def test_forced_text_is_located_in_the_tokens(qwen):
    """``forced_spans`` says where each forced text lies in the tokens (the benchmark's replay peers insert it there):
    the continue text after a rewind, the close text at the budget; the spans hold every forced token."""
    cfg = SSRConfig(max_think_tokens=30, min_think_tokens=12, max_tokens=60)
    t = Transcript(qwen, QWEN2_INSTRUCT, cfg, QWEN_EOS)
    for token in encode(qwen, "short </think> " + MIXED * 2):
        if t.push(token) == CLOSED:
            break
    assert t.closed_by == "budget" and len(t.forced_spans) == 2
    (at_continue, n_continue), (at_close, n_close) = t.forced_spans
    assert t.tokens[at_continue:at_continue + n_continue] == t.continue_ids
    assert t.tokens[at_close:at_close + n_close] == t.close_ids and at_close + n_close == len(t.tokens)
    assert n_continue + n_close == t.forced


def test_real_text_budget_eos_and_length(qwen):
    ids = encode(qwen, MIXED * 3)
    assert run(qwen, QWEN2_INSTRUCT, ids, QWEN_EOS, max_think_tokens=23).count(CLOSED) == 1  # budget close
    assert CLOSED in run(qwen, QWEN2_INSTRUCT, ids[:17] + [151645] + ids, QWEN_EOS)  # EOS closes the thinking
    assert run(qwen, QWEN2_INSTRUCT, ids, QWEN_EOS, max_think_tokens=50, max_tokens=31)[-1] == FINISHED


@pytest.mark.parametrize("thinking", [True, False])
def test_real_required_call_end(qwen, thinking):
    body = ' {"x": "世界🙂𠜎", "y": [1, {"z": "}\\""}]}}\n</tool_call> trailing 🎉'
    ids = (encode(qwen, "I call f 🧑‍🚀</think>") if thinking else []) + encode(qwen, body)
    statuses = run(qwen, QWEN2_INSTRUCT, ids, QWEN_EOS, thinking=thinking, opening=OPENING)
    assert statuses[-1] == FINISHED


def random_qwen_tokens(qwen, rng: random.Random, n: int) -> list[int]:
    """Byte pieces (lead and continuation bytes: half-written and invalid characters), any token, special and added
    tokens, pieces of multi-byte text, and now and then the close marker."""
    specials = [i for i in qwen.added_tokens_decoder if i not in QWEN_EOS]  # EOS would end most answers early
    marker = encode(qwen, "</think>")
    text = encode(qwen, MIXED)
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.35:
            out.append(rng.randrange(256))
        elif r < 0.6:
            out.append(rng.randrange(len(qwen)))
        elif r < 0.7:
            out.append(rng.choice(specials))
        elif r < 0.97:
            at = rng.randrange(len(text))
            out.extend(text[at: at + rng.randrange(1, 6)])
        else:
            out.extend(marker)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_qwen_sequences(qwen, seed):
    rng = random.Random(seed)
    cfg = [dict(), dict(min_think_tokens=40, stop=("ab", "\ufffd")), dict(max_think_tokens=60, stop=("你",)),
           dict(stop=("<tool_call>",))][seed % 4]
    opening = OPENING if seed % 3 == 2 else ""
    run(qwen, QWEN2_INSTRUCT, random_qwen_tokens(qwen, rng, 400), QWEN_EOS, opening=opening, **cfg)


@pytest.mark.parametrize("seed", range(20))
def test_random_tiny_sequences(seed):
    rng = random.Random(seed)
    tok = tiny_tokenizer(TOOL_VOCAB)
    weights = [0.5 if t in ("<eos>", "</think>") else 1.0 for t in TOOL_VOCAB]
    ids = rng.choices(range(len(TOOL_VOCAB)), weights=weights, k=200)
    cfg = [dict(), dict(min_think_tokens=30, stop=("ab",)), dict(max_think_tokens=25, stop=("a b", "zz")),
           dict(stop=("}",), max_tokens=120)][seed % 4]
    run(tok, TINY_FAMILY, ids, frozenset({0}), thinking=seed % 5 != 4,
        opening='<tool_call>\n{"name": "ab", "arguments":' if seed % 3 == 0 else "", **cfg)


class CountingTokenizer:
    """A tokenizer whose decode calls and decoded tokens are counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.tokens = tokenizer, 0, 0

    def encode(self, *args, **kwargs):
        return self.tokenizer.encode(*args, **kwargs)

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_decoding_work_per_token_does_not_grow(qwen):
    """Pushes 3000-3100 of a long thinking (streamed, reasoning read every step) and of a long answer decode no
    more tokens than pushes 100-200 (old code: every push decoded the whole chain of thought)."""
    tok = CountingTokenizer(qwen)
    cfg = SSRConfig(max_think_tokens=4000, max_tokens=10_000, stop=("never",))
    t = Transcript(tok, QWEN2_INSTRUCT, cfg, QWEN_EOS)
    text = encode(qwen, MIXED + " and so on, step by step; 42 = 6 × 7. ")
    per_window: dict[str, float] = {}

    def push_window(phase: str, start: int, stop: int) -> None:
        calls, tokens = tok.calls, tok.tokens
        for i in range(start, stop):
            t.push(text[i % len(text)])
            t.visible(3)
            t.reasoning()
            t.raw_answer()
        per_window[f"{phase}{start}"] = (tok.tokens - tokens) / (stop - start)
        assert tok.calls - calls <= 8 * (stop - start)

    for a, b in ((0, 100), (100, 200), (200, 3000), (3000, 3100)):
        push_window("think", a, b)
    assert per_window["think3000"] <= per_window["think100"] + 2
    assert t.push(151645) == CLOSED
    for a, b in ((0, 100), (100, 200), (200, 3000), (3000, 3100)):
        push_window("answer", a, b)
    assert per_window["answer3000"] <= per_window["answer100"] + 2
    assert per_window["think3000"] < 40 and per_window["answer3000"] < 40, per_window


@pytest.mark.parametrize("seed", range(3))
def test_incremental_text_forwards_and_back(qwen, seed):
    """Any sequence of lengths, growing and shrinking, reads exactly the full decode of that prefix."""
    from ssr.transcript import IncrementalText

    rng = random.Random(seed)
    tokens = random_qwen_tokens(qwen, rng, 600)
    decode = lambda ids: qwen.decode(ids, skip_special_tokens=True)  # noqa: E731
    view, end = IncrementalText(decode, tokens, start=seed), seed
    for _ in range(400):
        end = max(0, min(len(tokens), end + rng.choice([1, 1, 1, 2, 5, 70, -1, -3])))
        assert view.text(end) == decode(tokens[seed:end])


def test_incremental_text_decoder_that_rewrites_earlier_text():
    """A decoder whose text for a token depends on the next one (here " a" followed by "b" becomes "AB") is caught
    within the context window and decoded again from the start."""
    from ssr.transcript import IncrementalText

    tok = tiny_tokenizer()
    decode = lambda ids: tok.decode(ids).replace(" ab", "AB")  # noqa: E731
    rng = random.Random(0)
    tokens = rng.choices([tok.convert_tokens_to_ids(c) for c in (" ", "a", "b", "c")], k=300)
    view = IncrementalText(decode, tokens)
    for end in range(len(tokens) + 1):
        assert view.text(end) == decode(tokens[:end])


def test_rewind_keeps_the_streamed_view(qwen):
    """A min_think_tokens rewind cuts tokens the lagging streamed view has not read: it is not decoded again."""
    tok = CountingTokenizer(qwen)
    t = Transcript(tok, QWEN2_INSTRUCT, SSRConfig(min_think_tokens=2000, max_think_tokens=3000), QWEN_EOS)
    filler = encode(qwen, MIXED)
    for i in range(1000):
        t.push(filler[i % len(filler)])
        t.visible(0)
    statuses = [t.push(i) for i in encode(qwen, " so</think>")]
    assert statuses[-1] == REWOUND
    before = tok.tokens
    t.visible(0)
    assert tok.tokens - before < 40


def test_json_object_end():
    assert json_object_end('x{"a": {"b": "}"}} tail', 1) == 18
    assert json_object_end('{"a": "\\"}"', 0) is None  # the brace is inside the string
    assert json_object_end('{"a": [1, {"b": 2}]}', 0) == 20
    assert json_object_end('{"a": 1', 0) is None and json_object_end("{}", -1) is None
