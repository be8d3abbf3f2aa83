"""The thinking lane's generated tokens and what they mean: thinking, forced text, answer, and when to stop.

Plain decoding and SSR push the same tokens through the same transcript, so budget forcing, stop strings and
``max_tokens`` act identically in both. Text is decoded incrementally (``IncrementalText``), so the work per pushed
token does not grow with the length of the chain of thought.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from . import harmony
from .chat import ChatFamily
from .config import SSRConfig
from .toolcalls import ToolCallParse, parse_tool_calls


class Status(StrEnum):
    """What the token ``Transcript.push`` took did to the generation (a str: compares equal to its value)."""

    CONTINUE = "continue"  # nothing ended: decode on
    CLOSED = "closed"  # the thinking closed (by the model, EOS or the budget): the answer begins
    REWOUND = "rewound"  # a close before min_think_tokens was replaced by the "Wait" continuation
    FINISHED = "finished"  # the generation ended: EOS, a stop string, a required call's end or max_tokens


CONTINUE, CLOSED, REWOUND, FINISHED = Status.CONTINUE, Status.CLOSED, Status.REWOUND, Status.FINISHED  # the short names
CONTEXT = 4  # tokens decoded ahead of the new ones, for decoders whose text for a token depends on what precedes it
STEP = 64  # most tokens decoded in one window when catching up
MARKER_WINDOW = 8  # the close marker is looked for in the last this many tokens, so a rewind cuts no further back


class IncrementalText:
    """``decode(tokens[start:end])``, kept up to date as ``tokens`` grows by decoding only a short window each time.

    The prefix/read-offset scheme of vLLM's incremental detokenizer. Text is final up to the last point where a
    decoded window did not end in U+FFFD: there a byte-level decoder has no half-written character pending, so later
    tokens cannot change it. Each update decodes the tokens since that point, with ``CONTEXT`` tokens before them, and
    takes the text beyond what those context tokens alone decode to. For byte-level and concatenating decoders (Qwen,
    GPT-2 style; tests/tiny.py) the text is exactly the full decode at every length, a trailing U+FFFD included while
    a character is incomplete; a decoder that rewrites earlier text within the context is caught and decoded from the
    start. ``tokenizers.decoders.DecodeStream`` does the same in Rust, but hides its pending tokens, cannot go back,
    and skips the transformers tokenizer's own decode options. Only appends are incremental: cutting tokens before
    the last final point starts again from scratch.
    """

    def __init__(self, decode, tokens: list[int], start: int = 0) -> None:
        self._decode, self.tokens, self.start = decode, tokens, start
        self.reset()

    def reset(self) -> None:
        self._final = ""  # text of tokens[start:read]; no later token changes it
        self._read = self.start
        self._context = self.start  # each window decodes tokens[context:end]
        self._context_text = ""  # decode(tokens[context:read])
        self._end = self.start  # tokens read so far
        self._text = ""  # decode(tokens[start:end])

    def truncate(self, n: int) -> None:
        """Forget what was read beyond token ``n`` (the token list was cut there, or a shorter text is wanted):
        back to the last final point if that is not beyond ``n``, else from scratch."""
        if n < self._read:
            self.reset()
        elif n < self._end:
            self._end, self._text = self._read, self._final

    def text(self, end: int | None = None) -> str:
        """``decode(tokens[start:end])`` (``end`` None: all tokens)."""
        end = len(self.tokens) if end is None else max(end, self.start)
        self.truncate(end)
        while self._end < end:
            self._advance(min(end, self._end + STEP))
        return self._text

    def _advance(self, end: int) -> None:
        window = self._decode(self.tokens[self._context:end])
        if not window.startswith(self._context_text):  # a decoder that rewrote earlier text: decode from the start
            self.reset()
            window = self._decode(self.tokens[self.start:end])
        new = window[len(self._context_text):]
        self._end = end
        if window.endswith("\ufffd"):  # a character may still be incomplete: keep these tokens pending
            self._text = self._final + new
            return
        self._final += new
        self._text = self._final
        self._read = end
        self._context = max(self.start, end - CONTEXT)
        self._context_text = self._decode(self.tokens[self._context:end])


@dataclass
class Finish:
    reason: str  # "stop" or "length"
    answer_end: int | None = None  # character offset where a stop string starts in the raw answer


class Transcript:
    """Tokens change only through ``push`` (and the forced text it adds) and ``_rewind``; the text views rely on it."""

    text_view = IncrementalText  # tests swap in a full decode to compare against

    def __init__(self, tokenizer, family: ChatFamily, config: SSRConfig, eos_ids: frozenset[int],
                 thinking: bool = True, answer_opening: str = "") -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.config = config
        self.eos_ids = eos_ids
        self.marker = family.think_close
        self.answer_opening = answer_opening  # forced start of the answer (e.g. a required tool call's wrapper)
        self.close_ids = tokenizer.encode(family.close_text + answer_opening, add_special_tokens=False)
        self.continue_ids = tokenizer.encode(family.continue_text, add_special_tokens=False)
        self.tokens: list[int] = []
        self._all = self.text_view(self.decode, self.tokens)  # every token: the reasoning, the close
        self._shown = self.text_view(self.decode, self.tokens)  # the thinking text a stream may show (lags behind)
        self._answer = None if thinking else self.text_view(self.decode, self.tokens)
        self.thinking = thinking
        self.answer_start = 0 if not thinking else None  # index of the first answer token
        self.answer_residual = ""  # text after the close marker inside the closing token(s)
        self.reasoning_text = ""
        self.closed_by: str | None = None if thinking else "none"
        self.finish: Finish | None = None
        self.sampled = 0  # tokens the model chose (each one costs a forward pass in plain decoding)
        self.forced = 0
        self.forced_spans: list[tuple[int, int]] = []  # (index in tokens, length) of each forced text, in order
        self._head = "" if thinking else family.answer_prefill  # harmony: the prompt's text that opens the answer
        self._parsed: tuple[str, harmony.HarmonyParse] | None = None  # harmony: the last answer text parsed
        if not thinking and answer_opening:
            self._append_forced(tokenizer.encode(answer_opening, add_special_tokens=False))

    # -- counts ----------------------------------------------------------------------------------------------------
    @property
    def think_tokens(self) -> int:
        return len(self.tokens) if self.answer_start is None else self.answer_start

    @property
    def answer_tokens(self) -> list[int]:
        return [] if self.answer_start is None else self.tokens[self.answer_start:]

    def decode(self, tokens: list[int]) -> str:
        """Token text; harmony's markers are special tokens, and its thinking closes on one, so they are kept."""
        return self.tokenizer.decode(tokens, skip_special_tokens=not self.family.harmony)

    # -- pushing tokens --------------------------------------------------------------------------------------------
    def push(self, token: int) -> Status:
        """Add one model-chosen token; returns CONTINUE, CLOSED, REWOUND (early close replaced) or FINISHED."""
        self.sampled += 1
        if self.thinking and token in self.eos_ids:
            return self._close_thinking(by="eos")  # a chain of thought must close before the answer ends
        self.tokens.append(token)
        if self.thinking:
            if self._ends_with_marker():
                if self.think_tokens < self.config.min_think_tokens:
                    return self._rewind()
                return self._mark_closed(by="model")
            if self.think_tokens >= self.config.max_think_tokens:
                return self._close_thinking(by="budget")
            return self._check_length()
        if token in self.eos_ids:
            self.finish = Finish("stop")
            return FINISHED
        if self._check_stop() or self._check_call_end():
            return FINISHED
        return self._check_length()

    def _check_length(self) -> Status:
        if len(self.tokens) >= self.config.max_tokens:
            self.finish = Finish("length")
            if self.thinking:
                self.reasoning_text = self._all.text()
            return FINISHED
        return CONTINUE

    def _ends_with_marker(self) -> bool:
        tail = self.decode(self.tokens[-MARKER_WINDOW:])
        if self.marker not in tail:
            return False
        return self.marker not in self.decode(self.tokens[-MARKER_WINDOW:-1])

    def _rewind(self) -> Status:
        """min_think_tokens: drop the tokens that spelled the close marker and continue thinking instead."""
        at = self._all.text().rfind(self.marker)
        cut = len(self.tokens) - 1
        while cut > 0 and len(self.decode(self.tokens[:cut])) > at:
            cut -= 1
        del self.tokens[cut:]
        self.forced_spans = [span for span in self.forced_spans if span[0] < cut]
        self._all.truncate(cut)
        self._shown.truncate(cut)  # usually kept: it lags behind the tokens that spelled the marker
        self._append_forced(self.continue_ids)
        return REWOUND

    def _close_thinking(self, by: str) -> Status:
        self._append_forced(self.close_ids)
        return self._mark_closed(by)

    def _append_forced(self, ids: list[int]) -> None:
        if ids:
            self.forced_spans.append((len(self.tokens), len(ids)))
        self.tokens.extend(ids)
        self.forced += len(ids)

    def _mark_closed(self, by: str) -> Status:
        text = self._all.text()
        at = text.rfind(self.marker)
        reasoning = text[:at]
        for k in range(len(self.marker) - 1, 0, -1):  # a budget can cut the model off mid-way through "</think>"
            if by != "model" and reasoning.endswith(self.marker[:k]):
                reasoning = reasoning[:-k]
                break
        self.reasoning_text = reasoning
        self.answer_residual = text[at + len(self.marker):]
        self.answer_start = len(self.tokens)
        self._answer = self.text_view(self.decode, self.tokens, start=self.answer_start)
        self.thinking = False
        self.closed_by = by
        if by == "model" and self.answer_opening:  # forced closes carry the opening in close_ids already
            self._append_forced(self.tokenizer.encode(self._separator() + self.answer_opening,
                                                      add_special_tokens=False))
        if len(self.tokens) >= self.config.max_tokens:
            self.finish = Finish("length")
            return FINISHED
        return CLOSED

    def _separator(self) -> str:
        """What the family's close text puts between the marker and the answer, less what the model already wrote."""
        between = self.family.close_text[self.family.close_text.rfind(self.marker) + len(self.marker):]
        return between[len(self.answer_residual):] if between.startswith(self.answer_residual) else ""

    def _check_stop(self) -> bool:
        if not self.config.stop:
            return False
        raw = self.raw_answer()
        window = len(self.decode(self.tokens[-1:])) + max(len(s) for s in self.config.stop)
        hits = [i for s in self.config.stop if (i := raw.find(s, max(0, len(raw) - window))) >= 0]
        if hits:
            self.finish = Finish("stop", answer_end=min(hits))
            return True
        return False

    def _check_call_end(self) -> bool:
        """A required call ends the answer once its JSON object closes (one call per turn, as with guided decoding
        of a required call in vLLM); text the closing token carries beyond the brace is cut like a stop string's."""
        end = self.call_end(self.raw_answer())
        if end is None:
            return False
        self.finish = Finish("stop", answer_end=end)
        return True

    def call_end(self, raw: str) -> int | None:
        """Where a required call's JSON object closes in answer text ``raw``; None without one or while it is open."""
        at = raw.find(self.answer_opening) if self.answer_opening else -1
        return json_object_end(raw, raw.find("{", at)) if at >= 0 else None

    def draft_answer(self, tokens: list[int]) -> str:
        """A draft's answer text: what its forced close leaves after the marker, then its own tokens."""
        return self.answer_residual_of(self.close_ids) + self.decode(tokens)

    def answer_residual_of(self, ids: list[int]) -> str:
        """Text after the close marker in ``ids`` (e.g. a draft's forced close text)."""
        text = self.decode(ids)
        at = text.rfind(self.marker)
        return text[at + len(self.marker):] if at >= 0 else ""

    # -- text --------------------------------------------------------------------------------------------------------
    def raw_answer(self) -> str:
        """Answer text as generated (leading whitespace kept), before stop-string truncation."""
        if self._answer is None:  # set with answer_start, when the answer begins
            return ""
        return self.answer_residual + self._answer.text()

    def answer(self) -> str:
        raw = self.raw_answer()
        if self.finish is not None and self.finish.answer_end is not None:
            raw = raw[: self.finish.answer_end]
        if self.family.harmony:
            return self._harmony(raw).content
        return raw.lstrip()

    def tool_calls(self, tools: list[dict] | None, id_seed: str | None = None) -> ToolCallParse:
        """The answer's tool calls, in the family's format (harmony: commentary messages to ``functions.NAME``)."""
        if not self.family.harmony:
            return parse_tool_calls(self.answer(), tools, id_seed)
        parsed = harmony.parse(self._head + self.raw_answer(), tools, id_seed)
        return ToolCallParse(parsed.content, parsed.tool_calls, parsed.invalid_tool_calls)

    def _harmony(self, raw: str) -> harmony.HarmonyParse:
        """The harmony parse of answer text ``raw`` (kept: streaming asks for the same text again and again)."""
        if self._parsed is None or self._parsed[0] != raw:
            self._parsed = (raw, harmony.parse(self._head + raw))
        return self._parsed[1]

    def reasoning(self) -> str:
        if self.answer_start is None and not self.reasoning_text:
            return self._all.text().strip()
        return self.reasoning_text.strip()

    def visible(self, hold: int) -> tuple[str, str]:
        """(reasoning, answer) text that a stream may show now and never take back.

        While thinking, the last ``len(close_ids) + 1`` tokens are held back (an early close may still be rewound);
        while the answer is unfinished, its last ``hold`` characters are (a stop string may still start there).
        A trailing U+FFFD is an incomplete character and is held back too.
        """
        if self.thinking and self.finish is None:
            lag = len(self.close_ids) + 1
            reasoning = self._shown.text(max(0, len(self.tokens) - lag)).strip()
            reasoning = reasoning[:-1] if reasoning.endswith("\ufffd") else reasoning
        else:
            reasoning = self.reasoning()
        answer = self.answer()
        if self.finish is None:
            answer = answer[: max(0, len(answer) - hold)]
            answer = answer[:-1] if answer.endswith("\ufffd") else answer
        return reasoning, answer


def json_object_end(text: str, start: int) -> int | None:
    """The offset just past the JSON object that opens at ``text[start]``; None while it is still open."""
    if start < 0:
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
