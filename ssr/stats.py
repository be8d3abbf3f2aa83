"""The stats record every result carries: what was generated, what speculation proposed and accepted, per phase,
what it cost in forward passes against plain decoding, and where the time went."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    # passes by shape, "{lanes}x{tokens of the widest lane}" -> passes: what ``CostTable.price`` prices (a run
    # decoded here priced with another machine's table: ``ssr_bench.projection``)
    pass_shapes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "think": 0.0, "answer": 0.0})
    start: float = field(default_factory=time.perf_counter)
    think_end_at: float | None = None
    first_answer_at: float | None = None

    def credit(self, source: str, taken: int) -> None:
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + taken
