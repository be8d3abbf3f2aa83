"""Draft lanes: answers written from a partial chain of thought, each in its own lane of the same batched pass.

A draft forks the thinking lane, appends the end-of-thinking text and decodes an answer beside the thinking. It
speculates like every lane: the previous draft's tokens (bootstrap, verified under the longer chain of thought) and
suffix proposals (text the thinking already wrote, the prompt) are verified under the draft's own distribution, so
a draft that copies code from the thinking gets ahead by several tokens a pass. Drafts are proposals only: under
sampling each draft token keeps the distribution it was drawn from, for the answer's speculative sampling.

Memory is bounded by design: a draft lane samples (and verifies its own proposals) under its compact distribution
(``ssr.accept.Compact``: the model's top-K, renormalised), which is all a token keeps, K * 8 bytes. Only the
newest draft that wrote tokens keeps them at all (the next draft's bootstrap and the answer's prefix acceptance
read it alone); the others drop theirs as soon as a newer draft writes, and the newest drops them once the answer
no longer can use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .accept import Sampler, nbytes, verify
from .backends.base import Backend
from .config import SSRConfig
from .grammar import Constraint, Grammar
from .proposals import Context, Proposal, SuffixSources, tail_of
from .stats import Speculation


@dataclass
class Draft:
    index: int
    budget: int  # thinking tokens it saw
    lane: int | None
    feed: list[int]  # tokens to append at its next step
    head: list[int]  # the lane's last tokens before its own (thinking tail + end-of-thinking text), for matching
    proposal: Proposal | None = None  # what its next step verifies
    tokens: list[int] = field(default_factory=list)
    probs: list = field(default_factory=list)  # per token, the ``Compact`` distribution it was drawn from (sampling)
    prob_bytes: int = 0  # bytes ``probs`` holds
    bootstrapped: int = 0
    accepted_prefix: int = 0
    accepted_suffix: int = 0
    speculated: int = 0  # of its tokens, how many came from accepted proposals
    constraint: Constraint | None = None  # the request's grammar over this draft's answer

    @property
    def live_lane(self) -> int:
        """Its lane, while it is live (retiring it frees the lane)."""
        if self.lane is None:
            raise RuntimeError(f"draft {self.index} is retired: it has no lane")
        return self.lane

    def drop_probs(self) -> None:
        """Free the token distributions: nothing will verify this draft's tokens under sampling any more."""
        if self.probs:
            self.probs = []
            self.prob_bytes = 0

    def record(self) -> dict:
        return {"budget": self.budget, "length": len(self.tokens), "accepted_prefix": self.accepted_prefix,
                "accepted_suffix": self.accepted_suffix, "accepted": self.accepted_prefix + self.accepted_suffix,
                "bootstrapped": self.bootstrapped, "speculated": self.speculated}


class DraftLanes:
    """Every draft of one request: forks, per-step feeds, verification of their proposals, retirement."""

    def __init__(self, backend: Backend, config: SSRConfig, sampler: Sampler, transcript, suffix: SuffixSources | None,
                 grammar: Grammar | None = None) -> None:
        self.backend, self.config, self.sampler, self.transcript = backend, config, sampler, transcript
        self.suffix, self.grammar = suffix, grammar
        self.all: list[Draft] = []
        self.live: list[Draft] = []
        self.speculation = Speculation()  # the draft lanes' steps, proposals and accepted tokens
        self.declined_at: int | None = None  # thinking tokens when the cost model last declined a fork
        self.probs_peak_bytes = 0  # the most bytes the drafts' distributions held at once

    @property
    def probs_held_bytes(self) -> int:
        """Bytes the drafts' token distributions hold now."""
        return sum(d.prob_bytes for d in self.all)

    def due(self) -> bool:
        """Whether the config asks for a new draft at this point of the thinking."""
        cfg, think = self.config, self.transcript.think_tokens
        if not cfg.enabled or cfg.max_drafts == 0 or think < cfg.draft_start:
            return False
        marks = [d.budget for d in self.all[-1:]] + ([] if self.declined_at is None else [self.declined_at])
        return not marks or (cfg.draft_interval is not None and think - max(marks) >= cfg.draft_interval)

    def fork(self, parent: int, pending: list[int], head: list[int]) -> Draft:
        """A new draft lane from the thinking lane (whose cache lacks ``pending``), bootstrapped from the last one."""
        cfg, t = self.config, self.transcript
        if len(self.live) >= cfg.max_drafts:
            self.retire(self.live[0])
        previous = self.all[-1] if self.all else None
        bootstrap = previous.tokens[: cfg.max_draft_tokens] if previous is not None and cfg.bootstrap_drafts else []
        draft = Draft(index=len(self.all), budget=t.think_tokens, lane=self.backend.fork(parent),
                      feed=pending + t.close_ids, head=tail_of(head, t.close_ids))
        if self.grammar is not None:
            draft.constraint = self.grammar.constraint(before=t.answer_residual_of(t.close_ids))
        if previous is not None and bootstrap:  # without the draft's distributions (greedy) its tokens are point
            probs = previous.probs[: len(bootstrap)]  # masses, exact all the same
            draft.proposal = Proposal(list(bootstrap), "bootstrap", 0, probs if len(probs) == len(bootstrap) else None)
        self.all.append(draft)
        self.live.append(draft)
        if self.suffix is not None:
            self.suffix.extend(f"draft:{draft.index}", t.close_ids)
        return draft

    def feeds(self, width: int) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Each live draft's feed for the next step, with suffix proposals filling the step's ``width`` (tokens
        the padded batch computes anyway)."""
        feeds, want = {}, {}
        for draft in self.live:
            if draft.proposal is None and self.suffix is not None and self.config.draft_speculation:
                room = min(width - len(draft.feed), self.config.max_draft_tokens - len(draft.tokens) - 1)
                context = Context(tail_of(draft.head, draft.tokens))
                draft.proposal = self.suffix.propose(context, room) if room > 0 else None
            proposal = draft.proposal.tokens if draft.proposal is not None else []
            feeds[draft.live_lane] = draft.feed + proposal
            want[draft.live_lane] = len(proposal) + 1
        return feeds, want

    def advance(self, out: dict[int, torch.Tensor]) -> None:
        """Verify each live draft's proposal under its own logits; append what it wrote; retire finished drafts."""
        for draft in list(self.live):
            proposal = draft.proposal or Proposal([], "none")
            draft.proposal = None
            rows = out[draft.live_lane]
            if draft.constraint is not None:
                rows = draft.constraint.rows(rows, draft.tokens, proposal.tokens)
            if self.sampler.greedy:
                accepted, token = verify(self.sampler, proposal.tokens, rows)
                probs = []  # greedy keeps no distributions
            else:  # draw (and accept proposals) under the compact distributions the tokens will keep
                targets = self.sampler.compact(self.sampler.probs(rows))
                accepted, token = verify(self.sampler, proposal.tokens, rows, proposal.probs, targets=targets)
                probs = targets[: accepted + 1]
                del targets
            new = proposal.tokens[:accepted] + [token]
            self.speculation.add(len(proposal.tokens), accepted)
            if proposal.source == "bootstrap":
                draft.bootstrapped = accepted
            else:
                draft.speculated += accepted
            lane = draft.live_lane
            self.backend.truncate(lane, self.backend.length(lane) - (len(proposal.tokens) - accepted))
            del proposal  # a bootstrap's distributions (the previous draft's) are no longer needed by this lane
            self._append(draft, new, probs)

    def _append(self, draft: Draft, new: list[int], probs: list) -> None:
        eos = self.backend.eos_token_ids
        end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        end = min(end, self.config.max_draft_tokens - len(draft.tokens))
        draft.tokens += new[:end]
        # only the newest draft with tokens is read from now on (bootstrap, prefix acceptance): the others free theirs
        if end and not self.sampler.greedy and not any(d.tokens for d in self.all[draft.index + 1:]):
            draft.probs += probs[:end]
            draft.prob_bytes += sum(nbytes(p) for p in probs[:end])
            for older in self.all[: draft.index]:
                older.drop_probs()
            self.probs_peak_bytes = max(self.probs_peak_bytes, self.probs_held_bytes)
        draft.feed = [draft.tokens[-1]]
        if self.suffix is not None:
            self.suffix.extend(f"draft:{draft.index}", new[:end])
        if end < len(new) or draft.tokens[-1] in eos or len(draft.tokens) >= self.config.max_draft_tokens \
                or self._hit_stop(draft):
            self.retire(draft)

    def _hit_stop(self, draft: Draft) -> bool:
        """The draft reached a stop string or closed a required call: the rest of its lane would be wasted."""
        t = self.transcript
        if t.answer_opening and t.call_end(t.draft_answer(draft.tokens)) is not None:
            return True
        if not self.config.stop:
            return False
        tail = t.decode(draft.tokens[-8:])
        return any(s in tail for s in self.config.stop)

    def retire(self, draft: Draft) -> None:
        if draft.lane is not None:
            self.backend.release(draft.lane)
            draft.lane = None
            self.live.remove(draft)

    def retire_all(self) -> None:
        """The thinking ended: every lane goes. Only the newest draft with tokens keeps its distributions, for the
        answer's prefix acceptance, and none does where that is off."""
        for draft in list(self.live):
            self.retire(draft)
        usable = [d for d in self.all if d.tokens]
        for draft in self.all:
            if not self.config.prefix_accept or not usable or draft is not usable[-1]:
                draft.drop_probs()

    def drop_probs(self) -> None:
        """Free every draft's distributions (the answer is done with the drafts)."""
        for draft in self.all:
            draft.drop_probs()
