"""SSRConfig: every knob of one generation, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real
from typing import Any

# where suffix proposals come from: this request's drafts, prompt, chain of thought and answer, and the outputs of
# the engine's earlier requests (``ssr.history``)
SUFFIX_SOURCES = ("drafts", "prompt", "thinking", "answer", "history")

SEED_RANGE = (-(2**63), 2**64 - 1)  # the seeds torch's generators take


@dataclass(frozen=True)
class SSRConfig:
    """Budgets, drafting, suffix proposals and sampling for one request.

    ``enabled=False`` is plain decoding through the same backend: the baseline every comparison uses.
    Token budgets count tokens generated after the prompt.
    """

    enabled: bool = True
    # thinking budget
    max_think_tokens: int = 512
    min_think_tokens: int = 0
    # drafting
    draft_start: int = 16
    draft_interval: int | None = None
    max_drafts: int = 2
    max_draft_tokens: int = 256
    bootstrap_drafts: bool = True
    # speculation outside the answer: the thinking lane and the draft lanes verify suffix proposals too
    think_speculation: bool = True
    draft_speculation: bool = True
    # answer phase
    prefix_accept: bool = True
    suffix_decoding: bool = True
    suffix_sources: tuple[str, ...] = SUFFIX_SOURCES
    max_suffix_tokens: int = 16
    suffix_min_match: int = 1
    suffix_min_prob: float = 0.1
    # a match of n tokens earns at most factor x n proposed tokens (SuffixDecoding's max_spec_factor, 1 in vLLM);
    # the policy still prices each token by the acceptance counted at its match length and support (ssr/policy.py)
    suffix_max_spec_factor: float = 3.0
    max_verify_tokens: int = 256
    # sampling and stopping
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    draft_support: int = 64  # sampling: a draft token's proposal distribution is its top-K, renormalised (exact)
    # tool calls: schema-aware proposals where bound tools' JSON schemas fix the next text
    schema_proposals: bool = True
    # bound tools' calls follow a grammar (bound names, schema-valid arguments); a decoding rule, so plain decoding
    # and SSR both apply it. Off: the model writes calls freely and the parser reports the invalid ones
    constrain_tool_calls: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or isinstance(self.stop, list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.suffix_sources, list):
            object.__setattr__(self, "suffix_sources", tuple(self.suffix_sources))
        self._check_types()
        self._validate()

    def _check_types(self) -> None:
        """A ``TypeError`` naming the field for a value of the wrong type (a bool is not a number here; numpy's
        numbers are), before any comparison could fail with one that does not say which field."""
        for f in fields(self):
            value, kind = getattr(self, f.name), f.type
            if value is None and "None" in kind:
                continue
            if kind.startswith("bool"):
                ok, want = isinstance(value, bool), "true or false"
            elif kind.startswith("int"):
                ok, want = isinstance(value, Integral) and not isinstance(value, bool), "an integer"
            elif kind.startswith("float"):
                ok, want = isinstance(value, Real) and not isinstance(value, bool), "a number"
            else:  # the tuples of strings: stop, suffix_sources
                ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
                want = "a string or a list of strings" if f.name == "stop" else "a list of names"
            if not ok:
                raise TypeError(f"SSRConfig: {f.name} must be {want}, got {value!r} ({type(value).__name__})")

    def _validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"SSRConfig: {message}")

        for name in ("temperature", "top_p", "suffix_min_prob", "suffix_max_spec_factor"):
            need(math.isfinite(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)}")
        need(self.max_think_tokens >= 0, f"max_think_tokens must be >= 0, got {self.max_think_tokens}")
        need(0 <= self.min_think_tokens <= self.max_think_tokens,
             f"min_think_tokens must be in [0, max_think_tokens={self.max_think_tokens}], got {self.min_think_tokens}")
        need(self.draft_start >= 0, f"draft_start must be >= 0, got {self.draft_start}")
        need(self.draft_interval is None or self.draft_interval >= 1,
             f"draft_interval must be None or >= 1, got {self.draft_interval}")
        need(self.max_drafts >= 0, f"max_drafts must be >= 0 (0: no drafts), got {self.max_drafts}")
        need(self.max_draft_tokens >= 1, f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        need(self.max_suffix_tokens >= 1, f"max_suffix_tokens must be >= 1, got {self.max_suffix_tokens}")
        need(self.suffix_min_match >= 1, f"suffix_min_match must be >= 1, got {self.suffix_min_match}")
        need(0.0 <= self.suffix_min_prob <= 1.0, f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob}")
        need(self.suffix_max_spec_factor > 0.0,
             f"suffix_max_spec_factor must be > 0, got {self.suffix_max_spec_factor}")
        need(self.max_verify_tokens >= 1, f"max_verify_tokens must be >= 1, got {self.max_verify_tokens}")
        unknown = set(self.suffix_sources) - set(SUFFIX_SOURCES)
        need(not unknown, f"unknown suffix_sources {sorted(unknown)}; choose from {', '.join(SUFFIX_SOURCES)}")
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        need(self.draft_support >= 1, f"draft_support must be >= 1, got {self.draft_support}")
        need(all(self.stop), f"stop strings must be non-empty strings, got {self.stop}")
        need(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             f"seed must be None or in [-2**63, 2**64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def override(self, **changes: Any) -> "SSRConfig":
        """A copy with the given fields changed; ``None`` values mean "keep"."""
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"SSRConfig has no field(s) {sorted(unknown)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


NO_SPECULATION = SSRConfig(enabled=False)  # plain decoding: the same transcript, no drafts and no proposals
