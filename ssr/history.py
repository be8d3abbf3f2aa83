"""What earlier requests generated, as one suffix source every later request of the engine can copy from.

An agent's steps and a service's answers repeat each other: the same tool-call scaffolding at every step, the same
reply to the same tool result, a file's text written back. SuffixDecoding keeps a global suffix tree over earlier
outputs for this (vLLM's ``suffix`` method caches earlier requests the same way); here it is one suffix automaton
over the outputs, a separator between them, shared read-only by the requests that run while it grows. Proposals
from it are verified like any other, so they never change the output.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from .suffix import Automaton

SEPARATOR = -1  # between outputs: no context contains it, so no match spans two outputs
DEFAULT_MAX_TOKENS = 32768  # about 15 MB of automaton


class OutputHistory:
    """The token ids of the latest outputs, at most ``max_tokens`` of them (0: keep none)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_match: int = 32) -> None:
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.max_tokens, self.max_match = max_tokens, max_match
        self._outputs: deque[list[int]] = deque()
        self._size = 0  # tokens held, separators included
        self.automaton = Automaton(max_match)

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Sequence[int]) -> None:
        """Record one finished output. Past ``max_tokens`` the oldest outputs go until half the room is free, and
        the automaton is built anew (an automaton cannot forget); requests that hold the old one keep reading it."""
        room = self.max_tokens // 2 - 1  # one output keeps at most half the room (its tail), separator included
        tokens = list(tokens)[max(0, len(tokens) - room):] if room > 0 else []
        if not tokens:
            return
        self._outputs.append(tokens)
        self._size += len(tokens) + 1
        if self._size <= self.max_tokens:
            self._append(self.automaton, tokens)
            return
        while self._size > self.max_tokens // 2:  # the newest output fits in half the room: it stays
            self._size -= len(self._outputs.popleft()) + 1
        self.automaton = Automaton(self.max_match)
        for output in self._outputs:
            self._append(self.automaton, output)

    def clear(self) -> None:
        self._outputs.clear()
        self._size = 0
        self.automaton = Automaton(self.max_match)

    @staticmethod
    def _append(automaton: Automaton, tokens: list[int]) -> None:
        for t in tokens:
            automaton.append(t)
        automaton.append(SEPARATOR)
