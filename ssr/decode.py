"""One request, decoded the SSR way: think (with draft lanes riding in the same batched pass), then verify.

Plain decoding is the same loop with no drafts and no proposals, so both share every rule that decides the output.
The loop is a generator of text deltas; the caller (``SSREngine``) turns them into results and streams.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .accept import Sampler, verify
from .backends.base import Backend
from .chat import ChatFamily
from .config import SSRConfig
from .schema import SchemaProposer, ToolNameGuide
from .suffix import SuffixIndex
from .transcript import CLOSED, CONTINUE, FINISHED, Transcript

SUFFIX_CONTEXT = 32  # tokens of generated tail matched against the suffix index


class Cancelled(Exception):
    """The caller stopped the request; its lanes are already free."""


@dataclass
class Draft:
    """An answer written from a partial chain of thought, in its own lane."""

    index: int
    budget: int  # thinking tokens it saw
    lane: int | None
    feed: list[int]  # tokens to append at the next step
    boot: list[int] = field(default_factory=list)  # earlier draft's tokens, verified in the first step
    boot_probs: list[torch.Tensor | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    bootstrapped: int = 0
    accepted_prefix: int = 0
    accepted_suffix: int = 0

    def record(self) -> dict:
        return {"budget": self.budget, "length": len(self.tokens), "accepted_prefix": self.accepted_prefix,
                "accepted_suffix": self.accepted_suffix, "accepted": self.accepted_prefix + self.accepted_suffix,
                "bootstrapped": self.bootstrapped}


class Request:
    def __init__(self, backend: Backend, tokenizer, family: ChatFamily, config: SSRConfig, prompt_ids: list[int],
                 thinking: bool = True, cancel: threading.Event | None = None,
                 tools: list[dict] | None = None, answer_opening: str = "",
                 guide: ToolNameGuide | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.prompt_ids = list(prompt_ids)
        self.cancel = cancel or threading.Event()
        self.sampler = Sampler(config)
        self.transcript = Transcript(tokenizer, family, config, backend.eos_token_ids, thinking=thinking,
                                     answer_opening=answer_opening)
        self.drafts: list[Draft] = []
        self.live: list[Draft] = []
        self.main: int | None = None
        self.reused = 0  # prompt tokens whose cache came from the previous request
        self.cached: list[int] = []  # main-lane tokens after the prompt that the cache holds
        self.prefix: tuple[Draft, int] | None = None  # draft in the prefix stage and its aligned position
        self.index: SuffixIndex | None = None
        self.schema = SchemaProposer(tools) if tools and config.enabled and config.schema_proposals else None
        self.guide = guide  # part of the decoding rule: plain decoding and SSR both apply it
        self.counts = {"forward_passes": 0, "think_passes": 0, "answer_passes": 0, "verify_passes": 0,
                       "proposed": 0, "accepted_prefix": 0, "accepted_suffix": 0, "proposals_tried": 0,
                       "proposals_accepted": 0, "draft_tokens": 0}
        self.accepted_by_source: dict[str, int] = {}
        self.seconds = {"prefill": 0.0, "think": 0.0, "answer": 0.0}
        self.think_end_at: float | None = None
        self.first_answer_at: float | None = None  # when the first answer text was final (streamed)
        self.start = 0.0
        self._streamed_reasoning = 0
        self._streamed_answer = 0

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[str, str]]:
        """Yield ("reasoning" | "answer", delta) as text becomes final; frees every lane on exit."""
        self.start = time.perf_counter()
        try:
            self.main = self.backend.new_lane(self.prompt_ids)
            self.reused = min(self.backend.length(self.main), len(self.prompt_ids) - 1)  # re-feed >= 1 token
            self.backend.truncate(self.main, self.reused)
            forced = self._pending()  # a forced answer opening when there is no thinking phase
            feed = self.prompt_ids[self.reused:] + forced
            logits = self._step({self.main: feed}, {self.main: 1}, "prefill")[self.main]
            logits = self._guided(logits[-1:], self.transcript.raw_answer(), [])
            status = self._after(self.transcript.push(self._choose(logits[-1])))
            self._sync_main(forced)
            yield from self._deltas()
            while status != FINISHED:
                if self.cancel.is_set():
                    raise Cancelled("request cancelled")
                status = self._think_step() if self.transcript.thinking else self._answer_step()
                yield from self._deltas()
            self.backend.park(self.main)  # an agent's next step may extend this conversation
        finally:
            if self.transcript.finish is None:  # cancelled or failed: nothing worth keeping
                self.backend.release_all()
            self.live.clear()

    def _step(self, feeds, want, phase: str) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        out = self.backend.step(feeds, want)
        self.seconds[phase] += time.perf_counter() - t0
        self.counts["forward_passes"] += 1
        if phase != "prefill":
            self.counts[f"{phase}_passes"] += 1
        return out

    def _choose(self, logits: torch.Tensor) -> int:
        return self.sampler.next_token(logits)[0]

    def _guided(self, logits: torch.Tensor, said: str, proposal: list[int]) -> torch.Tensor:
        """``logits`` rows for the positions after ``said`` and after each prefix of ``proposal``, with the tool-name
        guide applied where it holds."""
        if self.guide is None or self.guide.opening not in said + self.transcript.decode(proposal):
            return logits
        return torch.stack([self.guide.mask(logits[i], said + self.transcript.decode(proposal[:i]))
                            for i in range(logits.shape[0])])

    def _pending(self) -> list[int]:
        return self.transcript.tokens[len(self.cached):]

    def _sync_main(self, fed: list[int]) -> None:
        """Keep the main lane's cache to the longest prefix of what was fed that the transcript still holds."""
        tokens = self.transcript.tokens
        keep = 0
        limit = min(len(fed), len(tokens))
        while keep < limit and fed[keep] == tokens[keep]:
            keep += 1
        self.cached = tokens[:keep]
        self.backend.truncate(self.main, len(self.prompt_ids) + keep)

    def _after(self, status: str) -> str:
        if status == CLOSED:
            self._start_answer()
            return CONTINUE
        return status

    # -- thinking, with draft lanes in the same pass ------------------------------------------------------------------
    def _think_step(self) -> str:
        self._maybe_fork()
        pending = self._pending()
        feeds, want = {self.main: pending}, {self.main: 1}
        for draft in self.live:
            feeds[draft.lane] = draft.feed
            want[draft.lane] = len(draft.boot) + 1
        out = self._step(feeds, want, "think")
        fed = self.cached + pending
        status = self.transcript.push(self._choose(out[self.main][-1]))
        self._sync_main(fed)
        for draft in list(self.live):
            self._advance_draft(draft, out[draft.lane])
        return self._after(status)

    def _maybe_fork(self) -> None:
        cfg = self.config
        if not cfg.enabled or cfg.max_drafts == 0:
            return
        think = self.transcript.think_tokens
        if think < cfg.draft_start:
            return
        if self.drafts and (cfg.draft_interval is None or think - self.drafts[-1].budget < cfg.draft_interval):
            return
        if len(self.live) >= cfg.max_drafts:
            self._retire(self.live[0])
        previous = self.drafts[-1] if self.drafts else None
        boot = previous.tokens[: cfg.max_draft_tokens] if previous is not None and cfg.bootstrap_drafts else []
        draft = Draft(index=len(self.drafts), budget=think, lane=self.backend.fork(self.main),
                      feed=self._pending() + self.transcript.close_ids + boot, boot=list(boot),
                      boot_probs=list(previous.probs[: len(boot)]) if previous is not None else [])
        self.drafts.append(draft)
        self.live.append(draft)

    def _advance_draft(self, draft: Draft, logits: torch.Tensor) -> None:
        logits = self._guided(logits, self.transcript.draft_answer(draft.tokens), draft.boot)
        if draft.boot:
            accepted, token = verify(self.sampler, draft.boot, logits, draft.boot_probs)
            draft.tokens = draft.boot[:accepted] + [token]
            draft.probs = self._probs_of(logits[: accepted + 1])
            draft.bootstrapped = accepted
            base = self.backend.length(draft.lane) - len(draft.boot)
            self.backend.truncate(draft.lane, base + accepted)
            draft.boot, draft.boot_probs = [], []
        else:
            token, probs = self.sampler.next_token(logits[-1])
            draft.tokens.append(token)
            draft.probs.append(probs)
        self.counts["draft_tokens"] += 1
        draft.feed = [draft.tokens[-1]]
        if (token in self.backend.eos_token_ids or len(draft.tokens) >= self.config.max_draft_tokens
                or self._draft_hit_stop(draft)):
            self._retire(draft)

    def _probs_of(self, logits: torch.Tensor) -> list[torch.Tensor | None]:
        """The distribution each bootstrapped token was (in effect) drawn from: the new draft's own."""
        if self.sampler.greedy:
            return [None] * logits.shape[0]
        return list(self.sampler.probs(logits))

    def _draft_hit_stop(self, draft: Draft) -> bool:
        """The draft reached a stop string or closed a required call: the rest of its lane would be wasted."""
        t = self.transcript
        if t.answer_opening and t.call_end(t.draft_answer(draft.tokens)) is not None:
            return True
        if not self.config.stop:
            return False
        tail = t.decode(draft.tokens[-8:])
        return any(s in tail for s in self.config.stop)

    def _retire(self, draft: Draft) -> None:
        if draft.lane is not None:
            self.backend.release(draft.lane)
            draft.lane = None
            self.live.remove(draft)

    # -- the answer: verify proposals from the drafts and the suffix index ---------------------------------------------
    def _start_answer(self) -> None:
        for draft in list(self.live):
            self._retire(draft)
        self.think_end_at = time.perf_counter()
        if not self.config.enabled:
            return
        usable = [d for d in self.drafts if d.tokens]
        if usable and self.config.prefix_accept:
            newest = usable[-1]
            at = self._align(newest)
            if at is not None:
                self.prefix = (newest, at)
        if self.config.suffix_decoding:
            self.index = SuffixIndex(max_match=SUFFIX_CONTEXT)
            sources = self.config.suffix_sources
            if "prompt" in sources:
                self.index.add("prompt", self.prompt_ids)
            if "thinking" in sources:
                self.index.add("thinking", self.transcript.tokens[: self.transcript.answer_start])
            if "drafts" in sources:
                for d in self.drafts:
                    self.index.add(f"draft:{d.index}", self.transcript.close_ids + d.tokens)
            if "answer" in sources:
                self.index.add("answer", self.transcript.tokens[self.transcript.answer_start:])

    def _align(self, draft: Draft) -> int | None:
        """Where in the draft the answer so far ends (by text; the closing token may merge with what follows)."""
        said = self.transcript.raw_answer()
        for j in range(min(len(draft.tokens), 8) + 1):
            if self.transcript.draft_answer(draft.tokens[:j]) == said:
                return j
        return None

    def _propose(self) -> tuple[list[int], list[torch.Tensor | None] | None, tuple[str, Draft | str | None]]:
        room = min(self.config.max_tokens - len(self.transcript.tokens),
                   self.backend.context_window - len(self.prompt_ids) - len(self.transcript.tokens)) - 1
        if room <= 0:
            return [], None, ("none", None)
        if self.prefix is not None:
            draft, at = self.prefix
            size = min(room, self.config.max_verify_tokens)
            chunk = draft.tokens[at: at + size]
            if chunk:
                probs = None if self.sampler.greedy else draft.probs[at: at + size]
                return chunk, probs, ("prefix", draft)
            self.prefix = None
        if self.schema is not None:
            fixed = self.schema.propose(self.transcript.raw_answer())
            if fixed:
                return self.tokenizer.encode(fixed, add_special_tokens=False)[:room], None, ("suffix", "schema")
        if self.index is not None:
            context = (self.prompt_ids + self.transcript.tokens)[-SUFFIX_CONTEXT:]
            found = self.index.propose(context, min(room, self.config.max_suffix_tokens),
                                       min_match=self.config.suffix_min_match, min_prob=self.config.suffix_min_prob)
            if found.tokens:
                return found.tokens, None, ("suffix", found.source)
        return [], None, ("none", None)

    def _answer_step(self) -> str:
        proposal, probs, (stage, origin) = self._propose()
        pending = self._pending()
        fed = self.cached + pending + proposal
        logits = self._step({self.main: pending + proposal}, {self.main: len(proposal) + 1}, "answer")[self.main]
        logits = self._guided(logits, self.transcript.raw_answer(), proposal)
        if proposal:
            self.counts["verify_passes"] += 1
            self.counts["proposals_tried"] += 1
            self.counts["proposed"] += len(proposal)
            accepted, token = verify(self.sampler, proposal, logits, probs)
        else:
            accepted, token = 0, self._choose(logits[-1])
        before = len(self.transcript.tokens)
        status = CONTINUE
        for t in proposal[:accepted] + [token]:
            status = self.transcript.push(t)
            if status != CONTINUE:
                break
        pushed = len(self.transcript.tokens) - before
        taken = min(accepted, pushed)
        self._credit(stage, origin, taken, accepted == len(proposal))
        if self.index is not None and "answer" in self.config.suffix_sources:
            self.index.extend("answer", self.transcript.tokens[before:])
        self._sync_main(fed)
        return status

    def _credit(self, stage: str, origin, taken: int, all_accepted: bool) -> None:
        if stage == "none":
            return
        if taken:
            self.counts["proposals_accepted"] += 1
        if stage == "prefix":
            draft, at = origin, self.prefix[1]
            draft.accepted_prefix += taken
            self.counts["accepted_prefix"] += taken
            self.accepted_by_source["prefix"] = self.accepted_by_source.get("prefix", 0) + taken
            self.prefix = (draft, at + taken) if all_accepted else None
            return
        self.counts["accepted_suffix"] += taken
        self.accepted_by_source[origin] = self.accepted_by_source.get(origin, 0) + taken
        if origin.startswith("draft:"):
            self.drafts[int(origin.split(":")[1])].accepted_suffix += taken

    # -- streaming text ----------------------------------------------------------------------------------------------
    def _deltas(self) -> Iterator[tuple[str, str]]:
        t = self.transcript
        if t.thinking and t.finish is None:
            lag = len(t.close_ids) + 1  # an early close may still be rewound: hold back that many tokens
            text = t.decode(t.tokens[: max(0, len(t.tokens) - lag)]).strip()
            text = text[:-1] if text.endswith("\ufffd") else text
        else:
            text = t.reasoning()
        if len(text) > self._streamed_reasoning:
            yield "reasoning", text[self._streamed_reasoning:]
            self._streamed_reasoning = len(text)
        answer = t.answer()
        if t.finish is None:
            hold = max((len(s) for s in self.config.stop), default=1) - 1
            answer = answer[: len(answer) - hold] if hold else answer
            answer = answer[:-1] if answer.endswith("\ufffd") else answer
        if len(answer) > self._streamed_answer:
            if self.first_answer_at is None:
                self.first_answer_at = time.perf_counter()
            yield "answer", answer[self._streamed_answer:]
            self._streamed_answer = len(answer)

    # -- stats ---------------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        t, c = self.transcript, self.counts
        accepted = c["accepted_prefix"] + c["accepted_suffix"]
        total = time.perf_counter() - self.start
        return {
            "enabled": self.config.enabled,
            "prompt_tokens": len(self.prompt_ids),
            "reused_prompt_tokens": self.reused,
            "think_tokens": t.think_tokens,
            "answer_tokens": len(t.answer_tokens),
            "forced_tokens": t.forced,
            "think_closed_by": t.closed_by,
            "accepted_tokens": accepted,
            "accepted_prefix_tokens": c["accepted_prefix"],
            "accepted_suffix_tokens": c["accepted_suffix"],
            "accepted_by_source": dict(self.accepted_by_source),
            "drafts": [d.record() for d in self.drafts],
            "draft_tokens": c["draft_tokens"],
            "bootstrapped_tokens": sum(d.bootstrapped for d in self.drafts),
            "proposals_tried": c["proposals_tried"],
            "proposals_accepted": c["proposals_accepted"],
            "proposed_tokens": c["proposed"],
            "mean_accepted_per_verify": accepted / c["verify_passes"] if c["verify_passes"] else 0.0,
            "verify_passes": c["verify_passes"],
            "forward_passes": c["forward_passes"],
            "think_forward_passes": c["think_passes"] + 1,  # the prefill chooses the first thinking token
            "answer_forward_passes": c["answer_passes"],
            "plain_forward_passes": t.sampled,
            "forward_passes_saved": t.sampled - c["forward_passes"],
            "seconds": {**{k: round(v, 4) for k, v in self.seconds.items()}, "total": round(total, 4)},
            "time_to_think_end": round(self.think_end_at - self.start, 4) if self.think_end_at else None,
            "time_to_first_answer_token": (round(self.first_answer_at - self.start, 4)
                                           if self.first_answer_at is not None else None),
        }
