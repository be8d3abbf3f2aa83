"""How far to speculate: proposal lengths and draft forks chosen from the measured step costs and acceptance rates.

A proposal of ``k`` tokens whose tokens are each accepted with probability ``a`` yields on average
``1 + a + ... + a^k`` tokens per pass (the verifier always adds one of its own). The step that verifies it costs
``costs(rows, k + 1)`` against ``costs(rows, 1)`` for a plain step, so the policy proposes the ``k`` that maximises
tokens per unit of step cost, and nothing when no ``k`` beats the plain step. Acceptance rates are counted online
per source and match length, engine-wide, so a later request prices its proposals with what earlier ones saw.

A draft lane adds a row to every thinking step, and where the thinking lane verifies several tokens a step, the
draft's row is padded to them: the draft pays only when what it saves in the answer (the share of draft tokens the
answer accepted, times what an answer token costs with suffix proposals alone) exceeds what it adds to the cost of a
thinking token (at the thinking lane's best proposal length, with and without the extra row). With a table that
prices every extra row and token as a whole step (``CostTable.linear()``) nothing pays, and SSR decodes exactly as
plain decoding does.

With other requests in the same pass (``Shared``: their rows, their widest feed, how many of them), a choice is
priced as part of the whole step: tokens of every request per cost of the step they share, so a proposal that fits
in the width others already pad to is nearly free, and one that widens the step charges everyone's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import CostTable

PRIOR_RATE = 0.6  # per-token acceptance assumed before anything was measured
PRIOR_WEIGHT = 4.0  # ... worth this many observed positions
PRIOR_DRAFT_YIELD = 0.5  # share of draft tokens the answer accepts, before any draft was scored
MATCH_BUCKETS = (1, 2, 4, 8, 16)  # match lengths are counted in buckets: <=1, <=2, <=4, <=8, <=16, more


def source_kind(source: str) -> str:
    """Acceptance is counted per kind of source: every draft's index shares one count."""
    return "draft" if source.startswith("draft:") else source


def _bucket(match_len: int) -> int:
    for i, top in enumerate(MATCH_BUCKETS):
        if match_len <= top:
            return i
    return len(MATCH_BUCKETS)


@dataclass
class AcceptanceCounts:
    """Positions verified and tokens accepted, per (source kind, match-length bucket); and draft yield."""

    tried: dict[tuple[str, int], float] = field(default_factory=dict)
    accepted: dict[tuple[str, int], float] = field(default_factory=dict)
    phase_tried: dict[str, float] = field(default_factory=dict)  # per phase ("think", "answer"), suffix sources
    phase_accepted: dict[str, float] = field(default_factory=dict)
    draft_tokens: int = 0
    draft_accepted: int = 0

    def rate(self, source: str, match_len: int) -> float:
        key = (source_kind(source), _bucket(match_len))
        return ((self.accepted.get(key, 0.0) + PRIOR_RATE * PRIOR_WEIGHT)
                / (self.tried.get(key, 0.0) + PRIOR_WEIGHT))

    def phase_rate(self, phase: str) -> float:
        return ((self.phase_accepted.get(phase, 0.0) + PRIOR_RATE * PRIOR_WEIGHT)
                / (self.phase_tried.get(phase, 0.0) + PRIOR_WEIGHT))

    def record(self, source: str, match_len: int, proposed: int, accepted: int, phase: str | None = None) -> None:
        """``accepted`` of ``proposed`` tokens passed: that is ``accepted`` successes in ``min(accepted + 1,
        proposed)`` positions tried (a geometric run). ``phase``: also count it for that phase's suffix rate."""
        if proposed <= 0:
            return
        key, tried = (source_kind(source), _bucket(match_len)), min(accepted + 1, proposed)
        self.tried[key] = self.tried.get(key, 0.0) + tried
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted
        if phase is not None and source not in ("prefix", "bootstrap"):
            self.phase_tried[phase] = self.phase_tried.get(phase, 0.0) + tried
            self.phase_accepted[phase] = self.phase_accepted.get(phase, 0.0) + accepted

    def record_drafts(self, tokens: int, accepted: int) -> None:
        self.draft_tokens += tokens
        self.draft_accepted += accepted

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

    def proposal_length(self, rows: int, source: str, match_len: int, available: int,
                        shared: Shared = ALONE) -> int:
        """How many of ``available`` proposed tokens to verify in a step with ``rows`` lanes of this request and
        ``shared`` of others (0: none)."""
        if available <= 0:
            return 0
        rate = self.counts.rate(source, match_len)
        best_k, best = 0, (shared.requests + 1.0) / self._step(rows, 1, shared)
        for k in range(1, available + 1):
            value = (shared.requests + expected_tokens(rate, k)) / self._step(rows, k + 1, shared)
            if value > best * (1 + 1e-9):
                best_k, best = k, value
        return best_k

    def _step(self, rows: int, width: int, shared: Shared) -> float:
        return self.costs(rows + shared.rows, max(width, shared.width))

    def cost_per_token(self, rows: int, rate: float, max_k: int = 16, shared: Shared = ALONE) -> float:
        """Step cost per token of a lane that proposes at its best length, beside ``rows - 1`` other lanes of its
        request and ``shared``."""
        return min(self._step(rows, k + 1, shared) / expected_tokens(rate, k) for k in range(max_k + 1))

    def fork_pays(self, rows: int, think_speculation: bool = True, shared: Shared = ALONE) -> bool:
        """Whether one more draft lane beside ``rows`` lanes is expected to save more than it costs; the time a
        draft row adds to a shared step delays every request in it."""
        think = self.counts.phase_rate("think") if think_speculation else 0.0
        loss = (self.cost_per_token(rows + 1, think, shared=shared)
                - self.cost_per_token(rows, think, shared=shared)) * (shared.requests + 1)
        gain = self.counts.draft_yield * self.cost_per_token(1, self.counts.phase_rate("answer"))
        return loss <= 0.0 or gain > loss

    def summary(self) -> dict:
        """The cost model's figures, for the stats."""
        c = self.costs
        return {"source": c.meta.get("kind", "measured"), "base_ms": round(c.base_seconds * 1e3, 2),
                "extra_lane": round(c(2, 1) - 1.0, 3), "verify_4": round(c(1, 4), 3), "verify_8": round(c(1, 8), 3),
                "verify_16": round(c(1, 16), 3), "draft_yield": round(self.counts.draft_yield, 3),
                "kernels": c.meta.get("kernels")}
