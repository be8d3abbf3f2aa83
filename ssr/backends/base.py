"""The protocol every backend implements, and the lane bookkeeping they share.

A backend runs forward passes over *lanes*: independent token sequences that share one model (the thinking
stream, each draft, the answer). It knows nothing of drafts, acceptance or requests: it appends tokens to lanes in
one batched pass and reports the logits at the positions asked for. The engine's scheduler puts the lanes of every
live request into one ``step``, so lanes of several requests are live at once and each request frees its own.

Every backend subclasses ``Backend``: the class lists everything the engine uses of a backend, and implements the
lane bookkeeping once (lane ids, each lane's tokens, the parked lane and prefix reuse, in a ``LaneTable``), so a
backend writes only ``step`` and its own cache operations (``_open``, ``_cut``, ``_free``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, get_type_hints

import torch


@dataclass(kw_only=True)
class Lane:
    """One lane's state: its committed tokens; a backend's subclass adds where its cache holds them."""

    tokens: list[int] = field(default_factory=list)


LaneT = TypeVar("LaneT", bound=Lane)  # a backend's lane state: ``Lane`` or its own subclass


class LaneTable(Generic[LaneT]):
    """A backend's live lanes by id, and the parked ones: lanes kept from finished requests for later prompts that
    start with their tokens (a prefix cache), each under its request's cache salt, least recently used first. It
    holds no cache: the backend frees a lane's cache when the lane leaves the table."""

    def __init__(self) -> None:
        self._lanes: dict[int, LaneT] = {}
        self._ids = itertools.count()  # never reused: a stale id fails loudly
        self.parked: dict[int, str | None] = {}  # lane -> its salt, least recently parked or forked first

    def add(self, state: LaneT) -> int:
        lane = next(self._ids)
        self._lanes[lane] = state
        return lane

    def pop(self, lane: int) -> LaneT:
        state = self._lanes.pop(lane)
        self.parked.pop(lane, None)
        return state

    def clear(self) -> list[LaneT]:
        states, self._lanes, self.parked = list(self._lanes.values()), {}, {}
        return states

    def __getitem__(self, lane: int) -> LaneT:
        return self._lanes[lane]

    def __len__(self) -> int:
        return len(self._lanes)

    def values(self):
        return self._lanes.values()

    def items(self):
        return self._lanes.items()

    def check(self, feeds: dict[int, list[int]]) -> None:
        """Refuse a step that names a lane that is not live, before any work."""
        unknown = set(feeds) - set(self._lanes)
        if unknown:
            raise KeyError(f"step(): no live lane {sorted(unknown)}")

    def best_parked(self, prefix: list[int], salt: str | None) -> tuple[int | None, int]:
        """The parked lane of ``salt`` sharing the most leading tokens with ``prefix`` (the newest among equals) and
        how many ((None, 0): none shares any)."""
        common, lane = max(((common_prefix(self._lanes[lane].tokens, prefix), lane)
                            for lane, s in self.parked.items() if s == salt), default=(0, None))
        return (lane, common) if common else (None, 0)

    def longest_shared(self, prefix: list[int]) -> tuple[int | None, int]:
        """The running lane (not parked) sharing the most leading tokens with ``prefix`` (the newest among equals),
        and how many."""
        common, lane = max(((common_prefix(s.tokens, prefix), lane) for lane, s in self._lanes.items()
                            if lane not in self.parked), default=(0, None))
        return lane, common


class Backend(ABC, Generic[LaneT]):
    """Everything the engine, its scheduler and the calibration use of a backend.

    Lane methods are implemented here over ``self.lanes``; a subclass implements ``step`` and the hooks that act
    on its cache, over its own lane state (``Backend[MyLane]``, ``MyLane`` a ``Lane`` subclass). ``min_shared``: a
    new request whose prompt shares at least this many leading tokens with a live lane starts as a fork of it
    (None: never)."""

    model_name: str
    vocab_size: int
    context_window: int  # tokens a lane may hold
    eos_token_ids: frozenset[int]
    tokenizer: Any = None  # the Hugging Face tokenizer whose ids the lanes hold (``SSREngine.from_pretrained``)
    config: Any = None  # the model's config: its ``model_type`` tells the chat family; None: unknown
    dtype: Any = None  # with ``device`` and ``cost_version``: part of the cost table's cache key
    device: Any = None
    cost_version: str | None = None  # a backend whose step code changed costs gets a new key (re-measured)
    min_shared: int | None = None
    # lanes kept from finished requests (a prefix cache; see ``park``). Above 1 only where a fork shares its parent's
    # cache (llama.cpp's sequences): ``new_lane`` then forks a parked lane instead of taking it
    max_parked = 1
    # whether a row's logits are the same bits whatever else is in the step (llama.cpp's ``exact`` mode; not the
    # transformers backend, whose kernels differ by row count). Where not, SSR's greedy tokens may leave plain
    # decoding's only at near-ties, and calibration measures how far a logit moves with the step's shape
    # (``ssr.calibrate.measure_noise``)
    row_exact: bool = True
    # whether a released lane's cache cells stay taken while another lane is live (llama.cpp's exact mode keeps
    # them so that a row's attention sees the cells it would see alone); calibration then empties the cache
    # between its groups of steps instead of forking them all from one prefilled context
    released_cells_linger: bool = False
    lanes: LaneTable[LaneT]

    def __init__(self) -> None:
        self.lanes = LaneTable()

    # -- the forward pass ----------------------------------------------------------------------------------------
    @abstractmethod
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Append ``feeds[lane]`` to each lane in ONE batched forward pass.

        Returns, per fed lane, float32 logits of shape ``[k, vocab]`` for the last ``k = want.get(lane, len(feed))``
        fed positions (row ``i`` predicts the token after the ``i``-th of those positions).
        """

    # -- lanes ---------------------------------------------------------------------------------------------------
    def new_lane(self, prefix: list[int] | None = None, salt: str | None = None) -> int:
        """A lane for a new request (other requests' lanes may be live). It already holds the longest cached
        prefix of ``prefix`` it can (``length`` says how many tokens): the parked lane of the same ``salt`` sharing
        the most (forked where the prompt leaves it part way and more than one lane may stay parked, so that it
        stays parked; else taken and cut), or a fork of a running lane sharing at least
        ``min_shared`` tokens; else it is empty. Requests with other salts never share parked lanes (vLLM's
        ``cache_salt``)."""
        prefix = prefix or []
        lane: int | None = None
        parked, common = self.lanes.best_parked(prefix, salt)
        if parked is not None:
            if common == self.length(parked) or self.max_parked == 1:
                del self.lanes.parked[parked]
                self.truncate(parked, common)
                lane = parked
            else:
                lane = self.fork(parked)
                self.truncate(lane, common)
                self.lanes.parked[parked] = self.lanes.parked.pop(parked)  # used now: the last to go
        elif self.max_parked == 1:  # one parked lane (the default): a request that shares none of it drops it
            self._release_parked()
        if parked is None and self.min_shared is not None:
            source, common = self.lanes.longest_shared(prefix)
            if source is not None and common >= self.min_shared:
                lane = self.fork(source)
                self.truncate(lane, common)
        if lane is None:
            lane = self.lanes.add(self._open(None))
        if not self._keep_parked():
            self._release_parked()
        return lane

    def park(self, lane: int, salt: str | None = None) -> None:
        """End of a request whose other lanes are already released: ``lane`` joins the parked lanes under ``salt``
        (for a later request's prefix), the least recently used leaving beyond ``max_parked``, where ``_keep_parked``
        says so; else it and every parked lane are released. No running lane is touched."""
        for old in list(self.lanes.parked)[: max(len(self.lanes.parked) - self.max_parked + 1, 0)]:
            self.release(old)
        if self._keep_parked():
            self.lanes.parked[lane] = salt
        else:
            self._release_parked()
            self.release(lane)

    def _release_parked(self) -> None:
        for old in list(self.lanes.parked):
            self.release(old)

    def fork(self, parent: int) -> int:
        """A new lane holding a copy of ``parent``'s tokens (its cache, up to the fork point)."""
        source = self.lanes[parent]
        state = self._open(source)
        state.tokens = list(source.tokens)
        return self.lanes.add(state)

    def truncate(self, lane: int, length: int) -> None:
        """Forget every token of ``lane`` after its first ``length`` tokens (rejected proposals)."""
        state, length = self.lanes[lane], max(length, 0)
        if length < len(state.tokens):
            self._cut(state, length)
            del state.tokens[length:]

    def length(self, lane: int) -> int:
        """Number of tokens the lane holds."""
        return len(self.lanes[lane].tokens)

    def release(self, lane: int) -> None:
        """Free the lane and its memory now."""
        self._free(self.lanes.pop(lane))

    def release_all(self) -> None:
        """Free every lane of every request, the parked ones too (calibration, shutdown)."""
        self._free_all(self.lanes.clear())

    @property
    def memory_bytes(self) -> int | None:
        """Bytes its cache holds now, where the backend knows (load reports); None: it does not say."""
        return None

    @property
    def live_lanes(self) -> int:
        """Lanes live now, the parked ones included."""
        return len(self.lanes)

    def close(self) -> None:
        """Free every lane and whatever else the backend holds (the engine's ``close``)."""
        self.release_all()

    # -- the hooks on the backend's cache ----------------------------------------------------------------------
    def _open(self, parent: LaneT | None) -> LaneT:
        """The state of a new lane: an empty cache, or (``parent``) a copy of the parent's; ``tokens`` are set by
        the caller. This default suits a backend that holds no cache of its own."""
        return Lane()  # type: ignore[return-value]  # right for Backend[Lane]; a subclassed lane overrides this

    def _cut(self, state: LaneT, length: int) -> None:
        """Drop the cache of the lane's tokens from ``length`` on (called before its ``tokens`` are cut)."""

    def _free(self, state: LaneT) -> None:
        """Free the cache of a lane that has left the table."""

    def _free_all(self, states: list[LaneT]) -> None:
        """Free the caches of every lane (they have left the table)."""
        for state in states:
            self._free(state)

    def _keep_parked(self) -> bool:
        """Whether parked lanes may stay (asked by ``park`` once older lanes beyond ``max_parked`` are released, and
        by ``new_lane`` once the new lane is live)."""
        return True


def missing_members(backend) -> list[str]:
    """The members of the protocol ``backend`` (a class or an instance) lacks: a class shows its methods and
    defaults, an instance also the facts its constructor sets (the tests check every backend)."""
    names = set(get_type_hints(Backend)) | {name for name in vars(Backend) if not name.startswith("_")}
    if isinstance(backend, type):
        names -= {name for name in get_type_hints(Backend) if not hasattr(Backend, name)}
    return sorted(name for name in names if not hasattr(backend, name))


# end-of-text / end-of-turn markers of the chat families: a model that emits one has ended its turn
END_OF_TEXT = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>")


def stop_token_ids(tokenizer, *eos_values) -> frozenset[int]:
    """Every token that ends generation: the ``eos_token_id`` values of the model's configs (an int, a list or
    None each), the tokenizer's EOS and its end-of-text tokens (``tokenizer`` None: the configs' ids only)."""
    ids: set[int] = set()
    for value in eos_values:
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= end_of_text_ids(tokenizer)
    return frozenset(ids)


def end_of_text_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's end-of-text special tokens. Hub generation configs list them as EOS (Qwen2.5:
    ``<|im_end|>`` and ``<|endoftext|>``), but a converted checkpoint's config may name only one, and a model that
    emits the other would go on writing a made-up next turn."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    special |= {t.content if hasattr(t, "content") else str(t)
                for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in END_OF_TEXT if t in special and t in vocab}


def rows_wanted(lane: int, feed: list[int], want: dict[int, int]) -> int:
    """How many logit rows ``step`` returns for ``lane`` (default: one per fed token), checked."""
    if not feed:
        raise ValueError(f"step(): lane {lane} was fed no tokens")
    rows = want.get(lane, len(feed))
    if not 1 <= rows <= len(feed):
        raise ValueError(f"step(): want[{lane}]={rows} must be in 1..{len(feed)}")
    return rows


def common_prefix(held: list[int], prefix: list[int]) -> int:
    """How many leading tokens ``held`` and ``prefix`` share (a parked lane's reusable part)."""
    limit = min(len(held), len(prefix))
    n = 0
    while n < limit and held[n] == prefix[n]:
        n += 1
    return n
