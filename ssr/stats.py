"""The stats record every result carries: what was generated, what speculation proposed and accepted, per phase,
what it cost in forward passes against plain decoding, and where the time went."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decode import Decoding

PHASES = ("think", "draft", "answer")


@dataclass
class Speculation:
    """One phase's proposals: steps run, steps that verified a proposal, tokens proposed and accepted."""

    steps: int = 0
    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    ended: dict[str, int] = field(default_factory=dict)  # rules that ended a phase at an accepted proposed token

    def end(self, rule: str) -> None:
        self.ended[rule] = self.ended.get(rule, 0) + 1

    def add(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        if proposed:
            self.verify_steps += 1
            self.proposed += proposed
            self.accepted += accepted

    def record(self) -> dict:
        return {"steps": self.steps, "verify_steps": self.verify_steps, "proposed": self.proposed,
                "accepted": self.accepted, "ended": dict(self.ended)}


@dataclass
class RequestCounts:
    forward_passes: int = 0
    passes: dict[str, int] = field(default_factory=lambda: {"think": 0, "answer": 0})
    think: Speculation = field(default_factory=Speculation)
    answer: Speculation = field(default_factory=Speculation)
    proposals_accepted: int = 0  # answer proposals with at least one token taken
    accepted_prefix: int = 0
    accepted_suffix: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    forks_declined: int = 0  # drafts the config asked for that the cost model found too expensive
    seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "think": 0.0, "answer": 0.0})
    start: float = field(default_factory=time.perf_counter)
    think_end_at: float | None = None
    first_answer_at: float | None = None

    def credit(self, source: str, taken: int) -> None:
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + taken


def request_stats(request: Decoding) -> dict:
    """The stats dict of a finished (or running) request (``ssr.decode.Decoding``)."""
    t, c, drafts = request.transcript, request.counts, request.drafts
    accepted = c.accepted_prefix + c.accepted_suffix
    total = time.perf_counter() - c.start

    def since_start(at: float | None) -> float | None:
        return round(at - c.start, 4) if at is not None else None

    return {
        "enabled": request.config.enabled,
        "prompt_tokens": len(request.prompt_ids),
        "reused_prompt_tokens": request.reused,
        "think_tokens": t.think_tokens,
        "answer_tokens": len(t.answer_tokens),
        "forced_tokens": t.forced,
        "think_closed_by": t.closed_by,
        "accepted_tokens": accepted,
        "accepted_prefix_tokens": c.accepted_prefix,
        "accepted_suffix_tokens": c.accepted_suffix,
        "accepted_by_source": dict(c.accepted_by_source),
        "think_accepted_tokens": c.think.accepted,
        "speculation": {"think": c.think.record(), "draft": drafts.speculation.record(), "answer": c.answer.record()},
        "drafts": [d.record() for d in drafts.all],
        "draft_tokens": sum(len(d.tokens) for d in drafts.all),
        "bootstrapped_tokens": sum(d.bootstrapped for d in drafts.all),
        # memory: the drafts' token distributions (sampling; greedy keeps none), ``support`` ids + probabilities each
        "draft_probs_support": None if request.sampler.greedy else request.sampler.support,
        "draft_probs_peak_bytes": drafts.probs_peak_bytes,
        "draft_probs_held_bytes": drafts.probs_held_bytes,
        "forks_declined": c.forks_declined,
        "proposals_tried": c.answer.verify_steps,
        "proposals_accepted": c.proposals_accepted,
        "proposed_tokens": c.answer.proposed,
        "mean_accepted_per_verify": accepted / c.answer.verify_steps if c.answer.verify_steps else 0.0,
        "verify_passes": c.answer.verify_steps,
        "forward_passes": c.forward_passes,
        "think_forward_passes": c.passes["think"] + 1,  # the prefill chooses the first thinking token
        "answer_forward_passes": c.passes["answer"],
        "plain_forward_passes": t.sampled,
        "forward_passes_saved": t.sampled - c.forward_passes,
        "cost_model": request.policy.summary() if request.config.enabled else None,
        "seconds": {**{k: round(v, 4) for k, v in c.seconds.items()}, "total": round(total, 4)},
        "time_to_think_end": since_start(c.think_end_at),
        "time_to_first_answer_token": since_start(c.first_answer_at),
    }
