"""Memory bounded by design: a sampled draft token keeps K ids and K probabilities (not a vocabulary row), only the
newest draft keeps them at all, and after many sampled requests with drafts the engine holds what it held at start
(live tensors and their bytes counted through the garbage collector, Python allocations through tracemalloc)."""

from __future__ import annotations

import collections
import gc
import os
import time
import tracemalloc

import torch

import ssr
from ssr import SSRConfig
from ssr.accept import Compact, Sampler
from ssr.drafts import DraftLanes
from ssr.history import OutputHistory
from tiny import prompt_ids, tiny_engine

# sampled, with iterative (bootstrapped, retired) drafts, draft and thinking speculation, prefix acceptance
CONFIG = dict(temperature=1.0, max_think_tokens=10, max_tokens=28, draft_start=1, draft_interval=3, max_drafts=2,
              max_draft_tokens=10, suffix_min_match=1, suffix_min_prob=0.0)
REQUESTS = 200
SSR_ROOT = os.path.dirname(ssr.__file__)


def settle(engine) -> None:
    """Wait until the engine's scheduler thread (where there is one) has let go of the requests that ended: their
    callers can return a moment before it drops them."""
    scheduler = getattr(engine, "scheduler", None)
    deadline = time.monotonic() + 10
    while scheduler is not None and time.monotonic() < deadline:
        load = scheduler.load()
        if not load.get("running") and not load.get("queued"):
            return
        time.sleep(0.01)


def live_tensors() -> tuple[int, int, int]:
    """(tensors, bytes of their distinct storages, ``Compact`` distributions) alive now."""
    gc.collect()
    tensors, compacts, storages = 0, 0, {}
    for obj in gc.get_objects():
        if type(obj) is Compact:
            compacts += 1
        elif issubclass(type(obj), torch.Tensor):  # type(): no proxy's __class__ is asked
            tensors += 1
            if obj.is_mkldnn:  # a packed weight (kernel "packed"): an opaque tensor without a storage to ask
                storages[("mkldnn", id(obj))] = obj.numel() * obj.element_size()
                continue
            storage = obj.untyped_storage()
            storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return tensors, sum(storages.values()), compacts


def ssr_objects() -> collections.Counter:
    """Live objects of SSR's own classes, by class."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()
                               if str(getattr(type(o), "__module__", "")).startswith("ssr"))


def traced_bytes() -> tuple[int, int]:
    """(bytes of live Python allocations, of those made by SSR's own decoding code): the second excludes what
    torch and transformers allocate (and cache) inside a backend step."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    ours = snapshot.filter_traces([tracemalloc.Filter(True, os.path.join(SSR_ROOT, "*")),
                                   tracemalloc.Filter(False, os.path.join(SSR_ROOT, "backends", "*"))])
    return tracemalloc.get_traced_memory()[0], sum(t.size for t in ours.traces)


def test_a_draft_token_keeps_k_ids_and_probabilities_not_a_vocabulary_row():
    vocab = 151936  # Qwen2.5's
    sampler = Sampler(SSRConfig(temperature=0.7, seed=0))
    probs = sampler.probs(torch.randn(3, vocab))
    kept = sampler.compact(probs)
    dense_row = probs[0].element_size() * vocab  # what a token kept before: 607,744 bytes
    assert dense_row == 607744
    assert [c.nbytes for c in kept] == [SSRConfig().draft_support * 8] * 3  # 512 bytes at K = 64
    for c in kept:  # each owns its storage: no row keeps the step's batch (or the vocabulary row) alive
        assert c.ids.untyped_storage().nbytes() == SSRConfig().draft_support * 4
        assert c.values.untyped_storage().nbytes() == SSRConfig().draft_support * 4


def test_draft_distributions_peak_within_one_draft(monkeypatch):
    """Per request: only the newest draft that wrote keeps distributions (the older ones free theirs as it writes),
    so they never hold more than one draft's tokens x K x 8 bytes; greedy keeps none."""
    engine = tiny_engine(3, attention=0.3, scale=0.6)
    k = min(SSRConfig().draft_support, engine.backend.vocab_size)
    checked = []
    append = DraftLanes._append

    def checked_append(self, draft, new, probs):
        append(self, draft, new, probs)
        writers = [d for d in self.all if d.tokens]
        for d in self.all:
            if writers and d is not writers[-1]:
                assert d.probs == [] and d.prob_bytes == 0, d.record()
        if writers and not self.sampler.greedy:
            assert len(writers[-1].probs) == len(writers[-1].tokens)
            assert writers[-1].prob_bytes == len(writers[-1].tokens) * k * 8
        checked.append(len(writers))

    monkeypatch.setattr(DraftLanes, "_append", checked_append)
    peaks, drafts = [], 0
    for seed in range(30):
        s = engine.generate(prompt_ids("ab"), config=SSRConfig(seed=seed, **CONFIG)).stats
        assert s["draft_probs_support"] == SSRConfig().draft_support
        longest = max((d["length"] for d in s["drafts"]), default=0)
        assert s["draft_probs_peak_bytes"] <= longest * k * 8
        peaks.append(s["draft_probs_peak_bytes"])
        drafts += len(s["drafts"])
    assert drafts > 30 and max(peaks) > 0 and max(checked) >= 2  # several drafts wrote in one request
    greedy = engine.generate(prompt_ids("ab"), config=SSRConfig(**{**CONFIG, "temperature": 0.0})).stats
    assert greedy["draft_tokens"] > 0 and greedy["draft_probs_peak_bytes"] == 0
    assert greedy["draft_probs_support"] is None


def test_memory_after_200_sampled_requests_with_drafts_is_back_to_its_start():
    engine = tiny_engine(3, attention=0.3, scale=0.6)
    engine.history = OutputHistory(max_tokens=0)  # a cache that grows by design (bounded: test_history.py), not a leak
    seen = {"drafts": 0, "bootstrapped": 0, "prefix": 0, "draft_tokens": 0, "held_at_end": 0}

    def run(seeds) -> None:
        for seed in seeds:
            s = engine.generate(prompt_ids("ab"), config=SSRConfig(seed=seed, **CONFIG)).stats
            seen["drafts"] += len(s["drafts"])
            seen["bootstrapped"] += s["bootstrapped_tokens"]
            seen["prefix"] += s["accepted_prefix_tokens"]
            seen["draft_tokens"] += s["draft_tokens"]
            seen["held_at_end"] += s["draft_probs_held_bytes"]

    run(range(30))  # warm-up: what is built once (acceptance-rate tables, lazily imported modules, library caches)
    settle(engine)
    engine.backend.release_all()  # the parked lane's cache (kept for the next request's prefix) goes
    start_objects = ssr_objects()
    tracemalloc.start()
    try:
        start_tensors, start_python = live_tensors(), traced_bytes()
        run(range(30, 30 + REQUESTS // 2))
        settle(engine)
        engine.backend.release_all()
        half_python = traced_bytes()
        run(range(30 + REQUESTS // 2, 30 + REQUESTS))
        settle(engine)
        engine.backend.release_all()
        end_tensors, end_python = live_tensors(), traced_bytes()
    finally:
        tracemalloc.stop()
    # the requests really drafted, bootstrapped and accepted prefixes under sampling
    assert seen["drafts"] > REQUESTS and seen["bootstrapped"] > 0 and seen["prefix"] > 0, seen
    assert start_tensors[2] == 0  # no distribution outlives its request
    assert end_tensors == start_tensors, (start_tensors, end_tensors)  # same tensors, same bytes, no Compact left
    assert not ssr_objects() - start_objects  # no object of SSR's classes more than at the start
    # Python allocations (SSR's code's, all): what settles once (free lists, torch's and transformers' caches)
    # settles within the first 100 requests; the next 100 add nothing (a leak of one small object per request
    # would be 100 x >= 56 bytes)
    assert end_python[1] - half_python[1] < 4 * 1024, (start_python, half_python, end_python)
    assert end_python[0] - half_python[0] < 32 * 1024, (start_python, half_python, end_python)
    assert end_python[1] - start_python[1] < 64 * 1024, (start_python, half_python, end_python)
    assert end_python[0] - start_python[0] < 256 * 1024, (start_python, half_python, end_python)
