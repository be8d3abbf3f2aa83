"""Proposal sources behind one interface: ``propose(context, room) -> Proposal | None``.

The thinking lane, the draft lanes and the answer all ask the same sources for tokens to verify: the newest draft
from where the answer so far ends in it (``DraftPrefix``), the text the bound tools' schemas fix (``SchemaFixed``),
and one suffix index over the prompt, the chain of thought, the drafts, the answer and earlier requests' outputs
(``SuffixSources``). A source only proposes; the verifier decides every token, so no source can change the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from .history import SEPARATOR, OutputHistory
from .schema import SchemaProposer
from .suffix import SuffixIndex, Support

SUFFIX_CONTEXT = 32  # tokens of a lane's tail matched against the suffix index


@dataclass
class Proposal:
    tokens: list[int]
    source: str  # "prefix", "schema", "prompt", "prompt-json", "thinking", "answer", "draft:<i>", "bootstrap"
    match_len: int = 0  # how long a context tail the source matched (suffix sources)
    probs: list | None = None  # the draft's own distributions (dense or ``ssr.accept.Compact``); None: point masses
    support: list[Support] | None = None  # suffix sources: each token's share and count in its source

    def cut(self, k: int) -> "Proposal":
        return Proposal(self.tokens[:k], self.source, self.match_len, None if self.probs is None else self.probs[:k],
                        None if self.support is None else self.support[:k])


@dataclass
class Context:
    """What a lane has written so far, as its proposers need it."""

    tail: list[int]  # the last <= SUFFIX_CONTEXT token ids of the lane (prompt included)
    text: str = ""  # the lane's answer text so far ("" while thinking)


class Proposer(Protocol):
    def propose(self, context: Context, room: int) -> Proposal | None:
        """Up to ``room`` tokens that may follow ``context``, or None."""


def tail_of(head: list[int], tokens: list[int], size: int = SUFFIX_CONTEXT) -> list[int]:
    """The last ``size`` ids of ``head + tokens``, without building the whole list."""
    if len(tokens) >= size:
        return tokens[-size:]
    return head[max(0, len(head) - (size - len(tokens))):] + tokens


class SuffixSources:
    """One suffix index over every source the config names; sources grow as lanes write."""

    def __init__(self, sources: tuple[str, ...], max_tokens: int, min_match: int, min_prob: float,
                 spec_factor: float = 1.0) -> None:
        self.sources = sources
        self.max_tokens, self.min_match, self.min_prob = max_tokens, min_match, min_prob
        self.spec_factor = spec_factor
        self.index = SuffixIndex(max_match=SUFFIX_CONTEXT)

    def wants(self, source: str) -> bool:
        return ("drafts" if source.startswith("draft:") else source.removesuffix("-json")) in self.sources

    def add_prompt(self, prompt_ids: list[int], tokenizer, tools: bool) -> None:
        """The prompt as the source "prompt" and, where tools are bound, its JSON-escaped text as "prompt-json".

        An agent's call copies prompt text into a JSON string (a file it read, written back with an edit): there
        every newline and quote is an escape, so the call's tokens match the prompt's raw tokens only between two
        escapes. The escaped view is registered first, so at an equally long match the raw prompt wins (the
        thinking quotes it raw); inside a call's string the escapes make the escaped view's match the longer."""
        if tools and self.wants("prompt-json"):
            text = tokenizer.decode(prompt_ids)
            escaped = json.dumps(text, ensure_ascii=False)[1:-1]
            if escaped != text:
                self.index.add("prompt-json", tokenizer.encode(escaped, add_special_tokens=False))
        self.extend("prompt", prompt_ids)

    def extend(self, source: str, tokens: list[int]) -> None:
        if self.wants(source) and tokens:
            self.index.add(source, tokens)

    def attach_history(self, history: OutputHistory) -> None:
        """Earlier requests' outputs as the source "history" (when the config names it)."""
        if self.wants("history") and len(history):
            self.index.attach("history", history.automaton)

    def propose(self, context: Context, room: int) -> Proposal | None:
        found = self.index.propose(context.tail, min(room, self.max_tokens), min_match=self.min_match,
                                   min_prob=self.min_prob)
        # SuffixDecoding's cap: a short match earns a short proposal; an earlier output ends at its separator
        tokens = found.tokens[: max(int(found.match_len * self.spec_factor), 1)]
        if SEPARATOR in tokens:
            tokens = tokens[: tokens.index(SEPARATOR)]
        if not tokens:
            return None
        return Proposal(tokens, found.source or "", found.match_len, support=found.support[:len(tokens)])


class DraftPrefix:
    """The newest draft, verified from where the answer so far ends in it, chunk by chunk, until it disagrees.
    When it is done the draft's token distributions are freed: nothing verifies its tokens under them again."""

    def __init__(self, draft, at: int, max_tokens: int) -> None:
        self.draft, self.at, self.max_tokens = draft, at, max_tokens  # draft: an ``ssr.drafts.Draft``
        self.tokens = draft.tokens
        self.done = False

    @property
    def probs(self) -> list:
        return self.draft.probs

    def propose(self, context: Context, room: int) -> Proposal | None:
        if self.done:
            return None
        chunk = self.tokens[self.at: self.at + min(room, self.max_tokens)]
        if not chunk:
            self._finish()
            return None
        probs = self.draft.probs[self.at: self.at + len(chunk)]
        # without the draft's distributions (greedy) its tokens are point masses, which is exact all the same
        return Proposal(chunk, "prefix", 0, probs if len(probs) == len(chunk) else None)

    def _finish(self) -> None:
        self.done = True
        self.draft.drop_probs()

    def advance(self, taken: int, whole: bool, bonus: int) -> None:
        """``taken`` tokens of the last chunk went into the answer, then the verifier's own ``bonus`` token. The
        stage goes on only if the chunk passed whole and the bonus token is the draft's next one as well."""
        self.at += taken
        if whole and self.at < len(self.tokens) and self.tokens[self.at] == bonus:
            self.at += 1
        else:
            self._finish()


class SchemaFixed:
    """Text that the bound tools' JSON schemas fix after the answer so far (keys, names, punctuation)."""

    def __init__(self, tools: list[dict], tokenizer) -> None:
        self.schema, self.tokenizer = SchemaProposer(tools), tokenizer

    def propose(self, context: Context, room: int) -> Proposal | None:
        fixed = self.schema.propose(context.text)
        if not fixed:
            return None
        return Proposal(self.tokenizer.encode(fixed, add_special_tokens=False)[:room], "schema")


def first_proposal(proposers: list[Proposer], context: Context, room: int) -> Proposal | None:
    """The first source that has something to propose, in priority order."""
    if room <= 0:
        return None
    for proposer in proposers:
        found = proposer.propose(context, room)
        if found is not None and found.tokens:
            return found
    return None
