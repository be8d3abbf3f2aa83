"""How far to speculate: proposal lengths and draft forks chosen from the measured step costs and acceptance rates.

A proposal's ``i``-th token is accepted, when the ones before it were, with a rate counted online for tokens like it
(``token_key``): its source, the length of the match that proposed it and, for the suffix index's tokens, their
``Support`` there: the share of the context's continuations that were this token and how often the context
continued. A token is counted with its share as prior (``share_prior``: each continuation seen one observation
beside ``PRIOR_RATE``'s one), so a fork in the source text is doubted before anything is measured (replayed agent
steps: tokens that were all of their context's continuations passed 86% of the time, those that were under 40% of
them 8%; docs/log.md), and so is a context seen once. So a proposal of ``k`` tokens yields on average
``1 + r1 + r1 r2 + ... + r1...rk`` tokens per pass (the verifier always adds one of its own). The step that verifies
it costs ``costs(rows, k + 1)`` against ``costs(rows, 1)`` for a plain step, so the policy proposes the ``k`` that
maximises tokens per unit of step cost, and nothing when no ``k`` beats the plain step. Counts are engine-wide, so a
later request prices its proposals with what earlier ones saw.

A draft lane adds a row to every thinking pass, padded to the tokens the thinking lane verifies in it, until the
thinking ends. It is priced over the thinking expected to remain (the mean of what earlier requests thought beyond
this point): it costs the extra row on every pass and its first pass's wider feed (the pending tokens and the
close), and it writes, a pass, as many answer tokens as its own proposals in that width yield; it pays only when
those tokens (times the share of draft tokens the answer accepted, times what an answer token costs with suffix
proposals alone) save more than that. A lane proposes only on the passes where a source matched (counted per phase:
``found_share``); its other passes are one-token passes, where a second row costs what the table says of two rows
of one token. Without that share a wide thinking pass, into which a draft row pads nearly free, would be priced as
if it were every pass (on HumanEval the thinking lane finds a proposal on about one pass in six). A thinking lane
that copies itself several tokens a pass thus finishes before a draft has written much. With a table that prices every
extra row and token as a whole step (``CostTable.linear()``) nothing pays, and SSR decodes exactly as plain decoding
does.

With other requests in the same pass (``Shared``: their rows, their widest feed, how many of them), a choice is
priced as part of the whole step: tokens of every request per cost of the step they share, so a proposal that fits
in the width others already pad to is nearly free, and one that widens the step charges everyone's rows.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .costs import CostTable
from .suffix import Support

if TYPE_CHECKING:
    from .proposals import Proposal

PRIOR_RATE = 0.6  # per-token acceptance assumed before anything was measured
PRIOR_WEIGHT = 4.0  # ... worth this many observed positions
PRIOR_SHARE_WEIGHT = 1.0  # PRIOR_RATE's weight against a suffix token's share, in continuations seen (share_prior)
PRIOR_DRAFT_YIELD = 0.5  # share of draft tokens the answer accepts, before any draft was scored
PRIOR_FOUND = 0.5  # share of a phase's passes where a source has a proposal, before any pass was counted
MATCH_BUCKETS = (1, 2, 4, 8, 16)  # match lengths are counted in buckets: <=1, <=2, <=4, <=8, <=16, more
SHARE_BUCKETS = (0.4, 0.7, 0.999)  # a suffix token's share of its context's continuations: <0.4, <0.7, <1, all
SEEN_BUCKETS = (1, 3)  # how often its context continued in the source: once, 2-3 times, more
THINK_LENGTHS_KEPT = 64  # the newest requests' thinking lengths, for the thinking expected to remain


def source_kind(source: str) -> str:
    """Acceptance is counted per kind of source: every draft's index shares one count."""
    return "draft" if source.startswith("draft:") else source


def smoothed(hits: float, trials: float, prior: float) -> float:
    """``hits`` in ``trials``, with ``prior`` counted as ``PRIOR_WEIGHT`` trials seen before them."""
    return (hits + prior * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)


def share_prior(support: Support) -> float:
    """A suffix token's prior: its share of its context's ``seen`` continuations, each counted as one observation,
    with ``PRIOR_RATE`` counted as ``PRIOR_SHARE_WEIGHT`` more. A context seen once has a share of 1 by construction;
    taken as certain, it had a fresh process verify 16 tokens of which 2 passed (the README's question, where such
    tokens passed about 70% of the time)."""
    return (support.share * support.seen + PRIOR_RATE * PRIOR_SHARE_WEIGHT) / (support.seen + PRIOR_SHARE_WEIGHT)


def token_key(source: str, match_len: int, support: Support | None) -> tuple:
    """What a proposed token's acceptance is counted under: its source kind, the bucket of the match that proposed
    it and, for a suffix token, the buckets of its support there."""
    key: tuple = (source_kind(source), bisect_left(MATCH_BUCKETS, match_len))
    if support is None:
        return key
    return (*key, bisect_right(SHARE_BUCKETS, support.share), bisect_left(SEEN_BUCKETS, support.seen))


@dataclass
class AcceptanceCounts:
    """Proposed tokens verified and accepted, per ``token_key``; per phase; and draft yield."""

    tried: dict[tuple, float] = field(default_factory=dict)
    accepted: dict[tuple, float] = field(default_factory=dict)
    phase_tried: dict[str, float] = field(default_factory=dict)  # per phase ("think", "answer"), suffix sources
    phase_accepted: dict[str, float] = field(default_factory=dict)
    phase_passes: dict[str, float] = field(default_factory=dict)  # per phase, passes that looked for a proposal
    phase_found: dict[str, float] = field(default_factory=dict)  # ... and found one (verified or declined)
    draft_tokens: int = 0
    draft_accepted: int = 0
    think_lengths: list[int] = field(default_factory=list)  # thinking tokens of the newest requests that thought

    @staticmethod
    def _tokens(proposal: Proposal) -> list[tuple[tuple, float]]:
        """Each proposed token's key and prior: its share in the source (``share_prior``), ``PRIOR_RATE`` where it
        has no support."""
        if proposal.support:
            return [(token_key(proposal.source, proposal.match_len, s), share_prior(s)) for s in proposal.support]
        return [(token_key(proposal.source, proposal.match_len, None), PRIOR_RATE)] * len(proposal.tokens)

    def rates(self, proposal: Proposal) -> list[float]:
        """Each proposed token's rate of acceptance, given that the tokens before it passed."""
        return [smoothed(self.accepted.get(key, 0.0), self.tried.get(key, 0.0), prior)
                for key, prior in self._tokens(proposal)]

    def phase_rate(self, phase: str) -> float:
        return smoothed(self.phase_accepted.get(phase, 0.0), self.phase_tried.get(phase, 0.0), PRIOR_RATE)

    def record(self, proposal: Proposal, accepted: int, phase: str | None = None) -> None:
        """``accepted`` of the proposal's tokens passed: each of those was tried and accepted, the one after them
        (if any) tried and refused; the rest were never tried. ``phase``: also count it for that phase's suffix
        rate."""
        if not proposal.tokens:
            return
        tried = min(accepted + 1, len(proposal.tokens))
        for i, (key, _) in enumerate(self._tokens(proposal)[:tried]):
            self.tried[key] = self.tried.get(key, 0.0) + 1
            self.accepted[key] = self.accepted.get(key, 0.0) + (i < accepted)
        if phase is not None and proposal.source not in ("prefix", "bootstrap"):
            self.phase_tried[phase] = self.phase_tried.get(phase, 0.0) + tried
            self.phase_accepted[phase] = self.phase_accepted.get(phase, 0.0) + accepted

    def record_found(self, phase: str, found: bool) -> None:
        """A pass of ``phase`` looked for a proposal; ``found``: a source had one."""
        self.phase_passes[phase] = self.phase_passes.get(phase, 0.0) + 1
        self.phase_found[phase] = self.phase_found.get(phase, 0.0) + found

    def found_share(self, phase: str) -> float:
        """Share of ``phase``'s passes on which a source has a proposal."""
        return smoothed(self.phase_found.get(phase, 0.0), self.phase_passes.get(phase, 0.0), PRIOR_FOUND)

    def record_drafts(self, tokens: int, accepted: int) -> None:
        self.draft_tokens += tokens
        self.draft_accepted += accepted

    def record_think(self, tokens: int) -> None:
        self.think_lengths = [*self.think_lengths[1 - THINK_LENGTHS_KEPT:], tokens]

    def think_left(self, so_far: int, budget: int) -> float:
        """Thinking tokens expected after ``so_far``: the mean of what earlier requests that thought longer still
        thought; the rest of the budget before any did."""
        longer = [n - so_far for n in self.think_lengths if n > so_far]
        return sum(longer) / len(longer) if longer else float(max(budget - so_far, 0))

    @property
    def draft_yield(self) -> float:
        return (self.draft_accepted + PRIOR_DRAFT_YIELD * 32) / (self.draft_tokens + 32)


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens a pass yields with ``k`` proposed tokens of per-token acceptance ``rate`` (bonus included)."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass(frozen=True)
class Shared:
    """What the other requests put in the last pass: rows, the widest feed, and how many requests (each yields at
    least one token a pass)."""

    rows: int = 0
    width: int = 1
    requests: int = 0


ALONE = Shared()


class SpeculationPolicy:
    def __init__(self, costs: CostTable, counts: AcceptanceCounts | None = None) -> None:
        self.costs = costs
        self.counts = counts or AcceptanceCounts()

    def proposal_length(self, rows: int, proposal: Proposal, shared: Shared = ALONE) -> int:
        """How many of the proposal's tokens to verify in a step with ``rows`` lanes of this request and ``shared``
        of others (0: none)."""
        best_k, best = 0, (shared.requests + 1.0) / self._step(rows, 1, shared)
        expected, run = 1.0, 1.0  # tokens a pass yields verifying the first k; the chance all k pass
        for k, rate in enumerate(self.counts.rates(proposal), 1):
            run *= rate
            expected += run
            value = (shared.requests + expected) / self._step(rows, k + 1, shared)
            if value > best * (1 + 1e-9):
                best_k, best = k, value
        return best_k

    def _step(self, rows: int, width: int, shared: Shared) -> float:
        return self.costs(rows + shared.rows, max(width, shared.width))

    def best_pass(self, rows: int, rate: float, max_k: int = 16, shared: Shared = ALONE) -> tuple[float, float, int]:
        """A lane's best proposal length beside ``rows - 1`` other lanes of its request and ``shared``: the pass's
        cost, the tokens it yields, and its width (the lowest cost per token)."""
        return min(((self._step(rows, k + 1, shared), expected_tokens(rate, k), k + 1) for k in range(max_k + 1)),
                   key=lambda c: c[0] / c[1])

    def mean_pass(self, rows: int, rate: float, found: float, max_k: int = 16,
                  shared: Shared = ALONE) -> tuple[float, float, int]:
        """A lane's mean pass beside ``rows - 1`` other lanes of its request and ``shared``, when a share ``found`` of
        its passes has a proposal (verified at the best length) and the rest feed one token: the mean cost, the
        mean tokens, and the width of its proposing passes."""
        cost, tokens, width = self.best_pass(rows, rate, max_k, shared)
        one = self._step(rows, 1, shared)
        return found * cost + (1 - found) * one, found * tokens + (1 - found), width

    def cost_per_token(self, rows: int, rate: float, found: float = 1.0, max_k: int = 16,
                       shared: Shared = ALONE) -> float:
        """Step cost per token of a lane that proposes at its best length on a share ``found`` of its passes,
        beside ``rows - 1`` other lanes of its request and ``shared``."""
        cost, tokens, _ = self.mean_pass(rows, rate, found, max_k, shared)
        return cost / tokens

    def fork_pays(self, rows: int, think_speculation: bool = True, shared: Shared = ALONE,
                  think_left: float = float("inf"), fork_feed: int = 1) -> bool:
        """Whether one more draft lane beside ``rows`` lanes is expected to save more than it costs over the
        ``think_left`` thinking tokens expected to remain, its first pass feeding ``fork_feed`` tokens; the time a
        draft row adds to a shared step delays every request in it."""
        if think_left <= 0:
            return False  # the thinking is expected to end now: a draft would write nothing
        c = self.counts
        think = c.phase_rate("think") if think_speculation else 0.0
        think_found = c.found_share("think") if think_speculation else 0.0
        answer, answer_found = c.phase_rate("answer"), c.found_share("answer")
        cost, think_tokens, width = self.mean_pass(rows + 1, think, think_found, shared=shared)
        row = (cost / think_tokens - self.cost_per_token(rows, think, think_found, shared=shared)) * (
            shared.requests + 1)
        first = (self._step(rows + 1, max(width, fork_feed), shared) - cost) * (shared.requests + 1)
        # a draft fills a wide pass with its own proposal, where it has one; else it writes a token a pass
        wide = answer_found * expected_tokens(answer, width - 1) + (1 - answer_found)
        draft_tokens = (think_found * wide + (1 - think_found)) / think_tokens  # written per thinking token
        saved = draft_tokens * c.draft_yield * self.cost_per_token(1, answer, answer_found)
        loss = row + first / think_left  # per thinking token
        return loss <= 0.0 or saved > loss

    def summary(self) -> dict:
        """The cost model's figures, for the stats."""
        c = self.costs
        return {"source": c.meta.get("kind", "measured"), "base_ms": round(c.base_seconds * 1e3, 2),
                "extra_lane": round(c(2, 1) - 1.0, 3), "verify_4": round(c(1, 4), 3), "verify_8": round(c(1, 8), 3),
                "verify_16": round(c(1, 16), 3), "draft_yield": round(self.counts.draft_yield, 3),
                "kernels": c.meta.get("kernels")}
