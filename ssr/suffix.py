"""Token-level suffix index: proposes draft continuations copied from the prompt, the reasoning, drafts, ...

Reasoning models copy a lot: the answer restates the chain of thought, drafts repeat each other, code echoes the
prompt. ``SuffixIndex`` finds the longest tail of the current context (at most ``max_match`` tokens) that occurs in
one of several growing token sequences ("sources") and proposes the tokens that followed it there, for the target
model to verify.

Design
------
* **One suffix automaton per source.** A suffix automaton is built online: appending a token costs O(1) amortised
  and it has at most 2n states, so sources can grow every decoding step without ever being rescanned. Matching the
  context tail costs O(max_match), and following transitions from the matched state spells only strings that really
  occur, so a proposal is always a true continuation. One automaton per source (not a generalized one) keeps "which
  source did this come from" and the per-source counts trivial; a step costs one walk per source.
* **Counts.** Exact occurrence counts (endpos sizes) are normally filled in by one pass over the suffix links after
  construction. Kept online, every append adds 1 to all states on the suffix-link path of the new end, which is
  O(n) per token on repetitive text (a loop "wait, wait, wait, ..."). We only need counts of strings of at most
  ``max_match + 1`` tokens, so we keep the state of the last ``max_match + 1`` tokens ("window") and walk from there:
  lengths strictly drop along suffix links, so that path has at most ``max_match + 2`` states. Each state also keeps
  the end position of its latest occurrence (``lastpos``), updated on the same walk.
* **Stopping rule.** At each proposed token, the candidates are the tokens that follow the whole string
  (match + tokens proposed so far) in the source. Their probability is estimated within that source, conditioned on
  the last ``<= max_match`` tokens of that string: count(window + token) / number of occurrences of window that are
  followed by a token. This is the exact empirical probability while the string fits in ``max_match`` tokens and an
  order-``max_match`` Markov estimate beyond. We take the most frequent candidate (ties: the most recent occurrence)
  and stop when its probability is below ``min_prob``, where the source ran out, or at ``max_tokens``. Each proposed
  token carries that probability and the count it was estimated from (its ``Support``): the speculation policy
  prices each token's acceptance by them.
* **Which match.** The match is the longest suffix of the context (``min_match <= len <= max_match``) that occurs in
  a source *followed by at least one token*: the text being generated is usually itself a source, where its own
  tail always matches at the very end with nothing to propose. Among equally long matches we prefer the source
  where the match has the most continued occurrences, then the most recently added/extended source.
* **Cheap repeated queries.** ``propose`` remembers, per source, where the previous context's tail matched. When the
  context only grew by a few tokens and the source did not change, only the new tokens are fed (O(new tokens));
  otherwise the last ``max_match`` context tokens are matched afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Support:
    """The evidence for one proposed token: the share of the source's continuations of its context (the window
    before it) that were this token, and how many continuations of that context the source holds."""

    share: float
    seen: int


@dataclass
class Proposal:
    tokens: list[int]  # proposed continuation (may be empty)
    source: str | None  # name of the source the continuation came from ("prompt", "thinking", "draft:0", ...)
    match_len: int  # length of the matched tail
    support: list[Support] = field(default_factory=list, compare=False)  # one a token (not what is proposed)


class Automaton:
    """Online suffix automaton of one token sequence, with counts for strings of at most ``max_match + 1`` tokens.

    States are parallel lists (faster than objects in pure Python). ``cnt[v]`` (occurrences) and ``lastpos[v]``
    (end position of the latest occurrence) are exact for every state whose shortest string has at most
    ``max_match + 1`` tokens, i.e. ``length[link[v]] <= max_match``; the others are never read.
    """

    def __init__(self, max_match: int) -> None:
        self.max_match = max_match
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.cnt = [0]
        self.lastpos = [-1]
        self.last = 0  # state of the whole sequence
        self.win = 0  # state of the last ``win_len`` (= min(n, max_match + 1)) tokens
        self.win_len = 0

    def _new_state(self, length: int, nxt: dict[int, int], link: int, cnt: int, lastpos: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.cnt.append(cnt)
        self.lastpos.append(lastpos)
        return len(self.length) - 1

    def append(self, c: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        pos = len(self.tokens)
        self.tokens.append(c)
        # Standard online construction (Blumer et al.): O(1) amortised.
        cur = self._new_state(length[self.last] + 1, {}, -1, 0, -1)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: its strings of length <= length[p] + 1 move to a clone with the same past occurrences
                clone = self._new_state(length[p] + 1, dict(nxt[q]), link[q], self.cnt[q], self.lastpos[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # Slide the window (the last max_match + 1 tokens) by one token. If the window's state was just split, its
        # clone has the same transitions, so stepping from the old state still lands right.
        cap = self.max_match + 1
        w, wl = nxt[self.win][c], self.win_len + 1
        if wl > cap:
            wl = cap
            if length[link[w]] >= cap:
                w = link[w]
        self.win, self.win_len = w, wl
        # Every suffix of the window gained an occurrence ending at pos: at most max_match + 2 states.
        while w != -1:
            self.cnt[w] += 1
            self.lastpos[w] = pos
            w = link[w]

    def match(self, state: int, length: int, tokens: Sequence[int]) -> tuple[int, int]:
        """Feed ``tokens`` to the matcher at (state, length); return the longest suffix (<= max_match) that occurs."""
        nxt, link, lens, cap = self.next, self.link, self.length, self.max_match
        for c in tokens:
            while state and c not in nxt[state]:
                state = link[state]
                length = lens[state]
            if c in nxt[state]:
                state = nxt[state][c]
                length += 1
                if length > cap:
                    length = cap
                    if lens[link[state]] >= cap:
                        state = link[state]
        return state, length

    def continued(self, state: int) -> int:
        """Occurrences of the strings of ``state`` that are followed by a token (the one at the end is not)."""
        return self.cnt[state] - (self.lastpos[state] == len(self.tokens) - 1)

    def continuation(self, state: int, length: int, max_tokens: int,
                     min_prob: float) -> tuple[list[int], list[Support]]:
        """Greedy most-frequent continuation of the string (state, length), stopping when it gets unlikely; each
        token's support."""
        nxt, link, lens, cnt, lastpos, cap = self.next, self.link, self.length, self.cnt, self.lastpos, self.max_match
        out: list[int] = []
        support: list[Support] = []
        full, win, wl = state, state, length  # the whole string so far; its last <= max_match tokens
        while len(out) < max_tokens and nxt[full]:
            wnext = nxt[win]
            best = max(nxt[full], key=lambda t: (cnt[wnext[t]], lastpos[wnext[t]]))
            seen = self.continued(win)
            if cnt[wnext[best]] < min_prob * seen:
                break
            out.append(best)
            support.append(Support(cnt[wnext[best]] / max(seen, 1), seen))
            full, win, wl = nxt[full][best], wnext[best], wl + 1
            if wl > cap:
                wl = cap
                if lens[link[win]] >= cap:
                    win = link[win]
        return out, support


class SuffixIndex:
    """Several growing token sequences, queried for the continuation of the longest matching context tail."""

    def __init__(self, max_match: int = 32) -> None:
        if max_match < 1:
            raise ValueError("max_match must be >= 1")
        self.max_match = max_match
        self._sources: dict[str, Automaton] = {}
        self._recency: dict[str, int] = {}  # source -> tick of its last add/extend (tie-break: most recent wins)
        self._tick = 0
        # Memo of the previous query, so a context that only grew is matched incrementally.
        self._ctx_len = 0
        self._ctx_tail: list[int] = []
        self._matched: dict[str, tuple[int, int, int]] = {}  # source -> (source length, state, match length)

    def add(self, source: str, tokens: Sequence[int] = ()) -> None:
        """Register ``source`` (or extend it if it exists)."""
        if source not in self._sources:
            self._sources[source] = Automaton(self.max_match)
            self._touch(source)
        self.extend(source, tokens)

    def attach(self, source: str, automaton: Automaton) -> None:
        """Register a source whose automaton another owner grows (``ssr.history.OutputHistory``); it is only read."""
        if automaton.max_match != self.max_match:  # its counts cover windows of its own length
            raise ValueError(f"an automaton of max_match {automaton.max_match} in an index of {self.max_match}")
        self._sources[source] = automaton
        self._touch(source)

    def extend(self, source: str, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to an existing source (KeyError if unknown)."""
        automaton = self._sources[source]
        if len(tokens):
            for t in tokens:
                automaton.append(t)
            self._touch(source)

    def _touch(self, source: str) -> None:
        self._tick += 1
        self._recency[source] = self._tick

    def propose(
        self, context: Sequence[int], max_tokens: int, min_match: int = 2, min_prob: float = 0.1
    ) -> Proposal:
        """Continuation of the longest tail of ``context`` (``min_match``..``max_match`` tokens) found in a source."""
        min_match = max(min_match, 1)
        n, k = len(context), len(self._ctx_tail)
        grown = self._ctx_len <= n <= self._ctx_len + self.max_match and (
            list(context[self._ctx_len - k : self._ctx_len]) == self._ctx_tail
        )
        new, tail = context[self._ctx_len :], context[-self.max_match :]
        best_key, best = None, None
        for name, automaton in self._sources.items():
            size = len(automaton.tokens)
            memo = self._matched.get(name)
            if grown and memo is not None and memo[0] == size:
                state, length = automaton.match(memo[1], memo[2], new)
            else:
                state, length = automaton.match(0, 0, tail)
            self._matched[name] = (size, state, length)
            if length and not automaton.next[state]:  # only occurs at the very end: nothing follows it
                state = automaton.link[state]
                length = automaton.length[state]
            if length < min_match:
                continue
            key = (length, automaton.continued(state), self._recency[name])
            if best_key is None or key > best_key:
                best_key, best = key, (name, automaton, state, length)
        self._ctx_len, self._ctx_tail = n, list(tail)
        if best is None:
            return Proposal([], None, 0)
        name, automaton, state, length = best
        tokens, support = automaton.continuation(state, length, max_tokens, min_prob)
        return Proposal(tokens, name, length, support)
