"""One request, decoded the SSR way: think (speculating, with draft lanes in the same batched pass), then answer.

Every step is one backend pass over the request's lanes. ``Decoding.run`` is a generator: it yields a ``Step`` (the
lanes' feeds) where it needs a pass and is sent the logits back, so the engine's scheduler (``ssr.scheduler``) can
put the steps of every live request into one pass. The thinking lane and the answer verify proposals from the
suffix index (and the newest draft, and the tools' schemas) exactly: greedy keeps the longest prefix the model's
argmax agrees with, sampling uses speculative sampling. Each accepted token then goes through the transcript one
by one, so budget forcing, "Wait" continuations, stop strings, EOS and a required call's rules decide the output
as they do in plain decoding, which is the same loop with no drafts and no proposals. How far to speculate comes
from the measured cost table (``ssr.policy``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Generator, Iterator

import torch

from .accept import Sampler, near_maxima, verify
from .backends.base import Backend
from .chat import ChatFamily
from .config import SSRConfig
from .drafts import DraftLanes
from .errors import Cancelled
from .grammar import Constraint, Grammar
from .history import OutputHistory
from .policy import ALONE, Shared, SpeculationPolicy
from .proposals import Context, DraftPrefix, Proposal, SchemaFixed, SuffixSources, first_proposal, tail_of
from .stats import RequestCounts, Speculation
from .transcript import MARKER_WINDOW, Status, Transcript

TIE_CANDIDATES = 3  # tokens noted per near-tie besides the chosen one
DECLINED_SCORED = 16  # tokens of a declined proposal scored in hindsight (the policy's longest proposal)


class Phase(StrEnum):
    """What a pass is for (a str: the stats' per-phase keys are these values)."""

    PREFILL = "prefill"  # the prompt (in chunks while other requests decode), then the first thinking token
    THINK = "think"  # the thinking lane (with its proposal) and the draft lanes
    ANSWER = "answer"  # the answer, on the thinking lane, with its proposal


@dataclass
class Step:
    """One backend pass a request asks for: ``feeds`` and ``want`` as ``Backend.step`` takes them."""

    feeds: dict[int, list[int]]
    want: dict[int, int]
    phase: Phase


Event = tuple[str, str]  # ("reasoning" | "answer", final text delta)
Run = Generator["Step | Event", "dict[int, torch.Tensor] | None", None]


class Decoding:
    """The decoding of one request: its prompt, transcript, thinking lane, draft lanes, proposal sources and counts.

    ``run`` is the decoding loop, a generator the scheduler steps (``ssr.scheduler.Job``)."""

    def __init__(self, backend: Backend, tokenizer, family: ChatFamily, config: SSRConfig, prompt_ids: list[int],
                 policy: SpeculationPolicy, thinking: bool = True, cancel: threading.Event | None = None,
                 tools: list[dict] | None = None, answer_opening: str = "",
                 grammar: Grammar | None = None, history: OutputHistory | None = None,
                 cache_salt: str | None = None) -> None:
        self.backend, self.tokenizer, self.config, self.policy = backend, tokenizer, config, policy
        self.cache_salt = cache_salt  # its lane reuses and is parked among the cached prompts of this salt only
        self.prompt_ids = list(prompt_ids)
        self.cancel = cancel or threading.Event()
        self.sampler = Sampler(config)
        self.transcript = Transcript(tokenizer, family, config, backend.eos_token_ids, thinking=thinking,
                                     answer_opening=answer_opening)
        self.grammar = grammar  # part of the decoding rule, applied by every lane
        self.constraint: Constraint | None = None  # the answer's parser state, from the end of thinking on
        self.counts = RequestCounts()
        self.history = history  # earlier SSR requests' outputs: a suffix source; this output is added at the end
        self.suffix = self._suffix_sources(bool(tools)) if config.enabled else None
        self.drafts = DraftLanes(backend, config, self.sampler, self.transcript, self.suffix, grammar)
        self.schema = SchemaFixed(tools, tokenizer) if tools and config.enabled and config.schema_proposals else None
        self.prefix: DraftPrefix | None = None
        self.thinking_lane: int | None = None  # the thinking lane, which goes on as the answer (while running)
        self.lane_tokens: list[int] = []  # transcript tokens the lane's cache holds after the prompt (some stale)
        self.synced = 0  # lane_tokens[:synced] == transcript.tokens[:synced]
        self.reused = 0  # prompt tokens whose cache came from an earlier request (a parked or running lane)
        self._streamed = ["", ""]
        self.window_cap: int | None = None  # max_tokens the context window allows (set by the engine)
        self.shared: Shared = ALONE  # what other requests put in the last pass (set by the scheduler)
        # where rows depend on the batch (``Backend.row_exact`` False), greedy decoding notes the positions where
        # other tokens' logits come within ``tie_window`` (twice the measured kernel noise) of the chosen one's: index
        # in ``transcript.tokens`` -> [(token, margin below the chosen one), ...]. A batched step may choose any of
        # them there (``ssr.agreement``)
        self.tie_window = 0.0
        self.near_ties: dict[int, list[tuple[int, float]]] = {}
        self._declined: Proposal | None = None  # the last proposal the cost model declined, scored in hindsight
        self._declined_at = 0  # ... from this index of ``transcript.tokens`` on

    @property
    def _lane(self) -> int:
        """The thinking lane, which the steps of ``run`` use (it exists from the start of ``run`` to its end)."""
        if self.thinking_lane is None:
            raise RuntimeError("the request has no thinking lane: it is not running")
        return self.thinking_lane

    def _suffix_sources(self, tools: bool) -> SuffixSources | None:
        cfg = self.config
        if not (cfg.suffix_decoding or cfg.think_speculation or cfg.draft_speculation):
            return None
        suffix = SuffixSources(cfg.suffix_sources, cfg.max_suffix_tokens, cfg.suffix_min_match, cfg.suffix_min_prob,
                               cfg.suffix_max_spec_factor)
        suffix.add_prompt(self.prompt_ids, self.tokenizer, tools)
        if self.history is not None:
            suffix.attach_history(self.history)
        return suffix

    # -- the loop ------------------------------------------------------------------------------------------------------
    def run(self) -> Run:
        """Yield a ``Step`` where a pass is needed (send its logits back) and ("reasoning" | "answer", delta) as
        text becomes final; frees the request's lanes on exit (a finished request parks its thinking lane)."""
        self.counts.start = time.perf_counter()
        try:
            self.thinking_lane = self.backend.new_lane(self.prompt_ids, self.cache_salt)
            self.reused = min(self.backend.length(self.thinking_lane), len(self.prompt_ids) - 1)  # re-feed >= 1 token
            self.backend.truncate(self.thinking_lane, self.reused)
            status = yield from self._prefill()
            yield from self._deltas()
            while status != Status.FINISHED:
                if self.cancel.is_set():
                    raise Cancelled("request cancelled")
                status = yield from (self._think_step() if self.transcript.thinking else self._answer_step())
                yield from self._deltas()
            drafts, counts = self.drafts.all, self.policy.counts
            if self.transcript.think_tokens:
                counts.record_think(self.transcript.think_tokens)
            counts.record_drafts(sum(len(d.tokens) for d in drafts),
                                 sum(d.accepted_prefix + d.accepted_suffix for d in drafts))
        finally:
            self.drafts.drop_probs()
            self.drafts.retire_all()
            if self.thinking_lane is not None:
                if self.transcript.finish is not None:
                    self.backend.park(self.thinking_lane, self.cache_salt)  # an agent's next step may extend it
                    if self.history is not None and self.config.enabled:  # plain decoding leaves no trace
                        self.history.add(self.transcript.tokens)
                else:  # cancelled or failed: nothing worth keeping
                    self.backend.release(self.thinking_lane)
                self.thinking_lane = None

    def _prefill(self):
        forced = self.transcript.tokens  # a forced answer opening when there is no thinking phase
        lane = self._lane
        logits = yield from self._step({lane: self.prompt_ids[self.reused:] + forced}, {lane: 1}, Phase.PREFILL)
        rows = self._constrained(logits[lane], [])
        return self._answer_on_close(self._accept(Proposal([], "none"), rows, Speculation()))

    def _think_step(self):
        self._maybe_fork()
        rows = 1 + len(self.drafts.live)
        proposal = self._proposal(rows, [self.suffix] if self.suffix and self.config.think_speculation else [])
        feeds, want = self._lane_feed(proposal)
        draft_feeds, draft_want = self.drafts.feeds(len(feeds[self._lane]))
        out = yield from self._step({**feeds, **draft_feeds}, {**want, **draft_want}, Phase.THINK)
        status = self._accept(proposal, out[self._lane], self.counts.think)
        self.drafts.advance(out)  # before a close retires them: this pass wrote their tokens too
        return self._answer_on_close(status)

    def _answer_step(self):
        proposal = self._proposal(1, [p for p in (self.prefix, self.schema, self.suffix) if p is not None])
        feeds, want = self._lane_feed(proposal)
        rows = (yield from self._step(feeds, want, Phase.ANSWER))[self._lane]
        rows = self._constrained(rows, proposal.tokens)
        return self._answer_on_close(self._accept(proposal, rows, self.counts.answer))

    # -- proposals, verification, acceptance ---------------------------------------------------------------------------
    def _proposal(self, rows: int, proposers: list) -> Proposal:
        """The first source's proposal, cut to the length the cost model finds worth verifying."""
        t = self.transcript
        self._score_declined()
        room = min(self.config.max_tokens - len(t.tokens),
                   self.backend.context_window - len(self.prompt_ids) - len(t.tokens) - 1)
        if t.thinking:
            room = min(room, self.config.max_think_tokens - t.think_tokens)
        context = Context(tail_of(self.prompt_ids, t.tokens), t.raw_answer() if not t.thinking else "")
        found = first_proposal(proposers, context, room - 1) if proposers else None
        if proposers:  # how often this phase has something to propose: the draft forks' pricing reads it
            self.policy.counts.record_found("think" if t.thinking else "answer", found is not None)
        if found is None:
            return Proposal([], "none")
        proposal = found.cut(self.policy.proposal_length(rows, found, self.shared))
        if not proposal.tokens and self._declined is None:  # learn what verifying it would have accepted
            self._declined, self._declined_at = found.cut(DECLINED_SCORED), len(t.tokens)
        return proposal

    def _score_declined(self) -> None:
        """Score the last declined proposal against the tokens decoded since, as the verifier would have (the
        longest run it matches), once that run is settled: the acceptance counts then learn from proposals the
        cost model did not pay for, so where a step's extra rows are dear (a compute-bound CPU) it still finds the
        sources and match lengths whose proposals pay. Free: no pass is spent."""
        declined, t = self._declined, self.transcript
        if declined is None:
            return
        got = t.tokens[self._declined_at:self._declined_at + len(declined.tokens)]
        run = next((i for i, (a, b) in enumerate(zip(got, declined.tokens)) if a != b), len(got))
        if len(t.tokens) < self._declined_at:  # a rewind took the text back: nothing to score
            self._declined = None
        elif run < len(got) or len(got) == len(declined.tokens):
            self.policy.counts.record(declined, run, phase="think" if t.thinking else "answer")
            self._declined = None

    def _lane_feed(self, proposal: Proposal) -> tuple[dict[int, list[int]], dict[int, int]]:
        """The lane's feed: transcript tokens its cache lacks, then the proposal; one row per proposed token + 1."""
        return ({self._lane: self.transcript.tokens[self.synced:] + proposal.tokens},
                {self._lane: len(proposal.tokens) + 1})

    def _accept(self, proposal: Proposal, rows: torch.Tensor, phase: Speculation) -> Status:
        """Verify ``proposal`` against ``rows``, push what passed through the transcript, and keep the lane's cache
        to what the transcript still holds. Returns the transcript's status after the last token pushed."""
        t = self.transcript
        before = len(t.tokens)
        del self.lane_tokens[self.synced:]
        self.lane_tokens += t.tokens[self.synced:] + proposal.tokens  # what the step fed
        accepted, token = verify(self.sampler, proposal.tokens, rows, proposal.probs)
        run = proposal.tokens[:accepted] + [token]
        ties = self._ties(rows[:len(run)], run)
        status, pushed = Status.CONTINUE, 0
        for tok in run:
            if pushed in ties:
                self.near_ties[len(t.tokens)] = ties[pushed]
            status = t.push(tok)
            pushed += 1
            if status != Status.CONTINUE:
                break
        if status == Status.REWOUND:  # tokens taken back: their notes go with them
            self.near_ties = {i: v for i, v in self.near_ties.items() if i < len(t.tokens)}
        taken = min(accepted, pushed)
        phase.add(len(proposal.tokens), taken)
        if status != Status.CONTINUE and taken:  # a rule ended the phase within or right after an accepted run
            phase.end(f"close:{t.closed_by}" if status == Status.CLOSED else
                      f"finish:{t.finish.reason}" if status == Status.FINISHED and t.finish else str(status))
        if proposal.tokens:
            self.policy.counts.record(proposal, accepted, phase="answer" if phase is self.counts.answer else "think")
            if phase is self.counts.answer:
                self._credit_answer(proposal, taken, whole=accepted == len(proposal.tokens) == taken, bonus=token)
            else:
                self.counts.credit(f"think:{proposal.source}", taken)
        self._grow_sources(before, run[:pushed], status)
        self._sync(before)
        return status

    def _ties(self, rows: torch.Tensor, taken: list[int]) -> dict[int, list[tuple[int, float]]]:
        """Rows (of the tokens ``taken``, a greedy step's argmax of each row) where other tokens lie within
        ``tie_window`` of the best one: those tokens (at most ``TIE_CANDIDATES``) and their margins."""
        if not self.tie_window or not self.sampler.greedy:
            return {}
        return near_maxima(rows, taken, self.tie_window, TIE_CANDIDATES)

    def _answer_on_close(self, status: Status) -> Status:
        """A closed thinking starts the answer, and decoding goes on; any other status is passed on."""
        if status == Status.CLOSED:
            self._start_answer()
            return Status.CONTINUE
        return status

    def _credit_answer(self, proposal: Proposal, taken: int, whole: bool, bonus: int) -> None:
        c = self.counts
        c.proposals_accepted += taken > 0
        c.credit(proposal.source, taken)
        if proposal.source == "prefix" and self.prefix is not None:  # the prefix stage's proposals come from it
            c.accepted_prefix += taken
            self.prefix.draft.accepted_prefix += taken
            self.prefix.advance(taken, whole, bonus)
            return
        c.accepted_suffix += taken
        if proposal.source.startswith("draft:"):
            self.drafts.all[int(proposal.source.split(":")[1])].accepted_suffix += taken

    def _grow_sources(self, before: int, pushed: list[int], status: Status) -> None:
        """New transcript tokens join the suffix index: thinking tokens as "thinking", answer tokens as "answer".
        A close that a "Wait" continuation rewound joins too: the model wrote it and may write it again."""
        if self.suffix is None:
            return
        t = self.transcript
        if status == Status.REWOUND:
            self.suffix.extend("thinking", pushed + t.continue_ids)
            return
        start = min(before, len(t.tokens))
        split = len(t.tokens) if t.answer_start is None else max(t.answer_start, start)
        self.suffix.extend("thinking", t.tokens[start:split])
        self.suffix.extend("answer", t.tokens[split:])

    def _sync(self, before: int) -> None:
        """Truncate the lane to the longest prefix of what it holds that the transcript still holds (rejected
        proposals, forced text and rewinds drop the rest). Work is O(new tokens), not O(length)."""
        tokens, held = self.transcript.tokens, self.lane_tokens
        keep = max(0, min(self.synced, before - MARKER_WINDOW))  # a rewind cuts no further back
        limit = min(len(held), len(tokens) - 1)  # the last token is always fed again: its row is the next choice
        while keep < limit and held[keep] == tokens[keep]:
            keep += 1
        del held[keep:]
        self.synced = keep
        self.backend.truncate(self._lane, len(self.prompt_ids) + keep)

    def _constrained(self, rows: torch.Tensor, proposal: list[int]) -> torch.Tensor:
        """``rows`` for the positions after the answer so far and after each prefix of ``proposal``, masked by the
        request's grammar once the answer has begun."""
        t = self.transcript
        if self.grammar is None or t.answer_start is None:
            return rows
        if self.constraint is None:
            self.constraint = self.grammar.constraint(before=t.answer_residual)
        return self.constraint.rows(rows, t.answer_tokens, proposal)

    def _step(self, feeds, want, phase: Phase):
        t0 = time.perf_counter()
        out = yield Step(feeds, want, phase)
        self.counts.seconds[phase] += time.perf_counter() - t0
        self.counts.forward_passes += 1
        shape = f"{len(feeds)}x{max(len(feed) for feed in feeds.values())}"
        self.counts.pass_shapes[shape] = self.counts.pass_shapes.get(shape, 0) + 1
        if phase != Phase.PREFILL:
            self.counts.passes[phase] += 1
        return out

    # -- drafts --------------------------------------------------------------------------------------------------------
    def _maybe_fork(self) -> None:
        if not self.drafts.due():
            return
        replacing = len(self.drafts.live) >= self.config.max_drafts
        rows = 1 + len(self.drafts.live) - replacing
        t = self.transcript
        pending = t.tokens[self.synced:]
        think_left = self.policy.counts.think_left(t.think_tokens, self.config.max_think_tokens)
        if not self.policy.fork_pays(rows, think_speculation=self.config.think_speculation, shared=self.shared,
                                     think_left=think_left, fork_feed=len(pending) + len(t.close_ids)):
            self.counts.forks_declined += 1
            self.drafts.declined_at = t.think_tokens  # ask again only a whole interval later
            return
        self.drafts.fork(self._lane, pending, tail_of(self.prompt_ids, t.tokens))

    def _start_answer(self) -> None:
        self.drafts.retire_all()
        self.counts.think_end_at = time.perf_counter()
        usable = [d for d in self.drafts.all if d.tokens]
        if usable and self.config.prefix_accept:
            at = self._align(usable[-1].tokens)
            if at is not None:
                self.prefix = DraftPrefix(usable[-1], at, self.config.max_verify_tokens)
        if self.prefix is None:  # no prefix stage will read the drafts' distributions
            self.drafts.drop_probs()
        if self.suffix is not None and not self.config.suffix_decoding:
            self.suffix = None  # the ablation without suffix proposals in the answer

    def _align(self, tokens: list[int]) -> int | None:
        """Where in the draft the answer so far ends (by text; the closing token may merge with what follows)."""
        answer_so_far = self.transcript.raw_answer()
        for j in range(min(len(tokens), 8) + 1):
            if self.transcript.draft_answer(tokens[:j]) == answer_so_far:
                return j
        return None

    # -- streaming text ----------------------------------------------------------------------------------------------
    def _deltas(self) -> Iterator[tuple[str, str]]:
        hold = max((len(s) for s in self.config.stop), default=1) - 1  # a stop string may still cut this much
        for i, (kind, now) in enumerate(zip(("reasoning", "answer"), self.transcript.visible(hold))):
            if len(now) > len(self._streamed[i]):
                if kind == "answer" and self.counts.first_answer_at is None:
                    self.counts.first_answer_at = time.perf_counter()
                yield kind, now[len(self._streamed[i]):]
                self._streamed[i] = now

    def stats(self) -> dict:
        """The stats dict of this request, finished or running (``ssr.stats`` holds the counts it reads)."""
        t, c, drafts = self.transcript, self.counts, self.drafts
        accepted = c.accepted_prefix + c.accepted_suffix
        total = time.perf_counter() - c.start

        def since_start(at: float | None) -> float | None:
            return round(at - c.start, 4) if at is not None else None

        return {
            "enabled": self.config.enabled,
            "prompt_tokens": len(self.prompt_ids),
            "reused_prompt_tokens": self.reused,
            "think_tokens": t.think_tokens,
            "answer_tokens": len(t.answer_tokens),
            "forced_tokens": t.forced,
            "forced_spans": [list(span) for span in t.forced_spans],  # [index in token_ids, length]: replayable
            "think_closed_by": t.closed_by,
            "accepted_tokens": accepted,
            "accepted_prefix_tokens": c.accepted_prefix,
            "accepted_suffix_tokens": c.accepted_suffix,
            "accepted_by_source": dict(c.accepted_by_source),
            "think_accepted_tokens": c.think.accepted,
            "speculation": {"think": c.think.record(), "draft": drafts.speculation.record(),
                            "answer": c.answer.record()},
            "drafts": [d.record() for d in drafts.all],
            "draft_tokens": sum(len(d.tokens) for d in drafts.all),
            "bootstrapped_tokens": sum(d.bootstrapped for d in drafts.all),
            # memory: the drafts' token distributions (sampling; greedy keeps none), ``support`` ids + probabilities
            # each
            "draft_probs_support": None if self.sampler.greedy else self.sampler.support,
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
            "pass_shapes": dict(c.pass_shapes),
            "cost_model": self.policy.summary() if self.config.enabled else None,
            "seconds": {**{k: round(v, 4) for k, v in c.seconds.items()}, "total": round(total, 4)},
            "time_to_think_end": since_start(c.think_end_at),
            "time_to_first_answer_token": since_start(c.first_answer_at),
        }
