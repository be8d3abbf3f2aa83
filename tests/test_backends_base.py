"""ssr/backends/base.py: the backend protocol (every backend class implements all of it) and the lane table's
bookkeeping."""

from __future__ import annotations

import inspect

import pytest
import torch

from scripted import ScriptedBackend
from ssr.backends.base import Backend, missing_members
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.backends.transformers import TransformersBackend
from ssr.backends.vllm import VLLMBackend
from ssr.backends.vllm_server import VLLMServerBackend
from tiny import tiny_model

BACKEND_CLASSES = [TransformersBackend, VLLMBackend, VLLMServerBackend, LlamaCppBackend, ScriptedBackend]


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


@pytest.mark.parametrize("cls", BACKEND_CLASSES, ids=lambda cls: cls.__name__)
def test_every_backend_class_implements_the_whole_protocol(cls):
    """Each backend is a ``Backend`` with nothing abstract left, and its methods take the protocol's arguments (the
    facts its constructor sets are checked on instances: here, and in each backend's own tests)."""
    assert issubclass(cls, Backend) and not inspect.isabstract(cls)
    assert missing_members(cls) == []
    for name, member in vars(Backend).items():
        if inspect.isfunction(member) and not name.startswith("__"):
            assert inspect.signature(getattr(cls, name)).parameters.keys() == \
                inspect.signature(member).parameters.keys(), name


def test_backend_instances_have_every_member(tokenizer):
    assert missing_members(backend()) == []
    assert missing_members(ScriptedBackend(tokenizer, "</think>")) == []


class _ListBackend(Backend):
    """The smallest backend: lanes are token lists (no cache of its own), so only ``Backend``'s bookkeeping runs."""

    model_name, vocab_size, context_window, eos_token_ids = "lists", 1, 100, frozenset()

    def step(self, feeds, want=None):
        self.lanes.check(feeds)
        for lane, feed in feeds.items():
            self.lanes[lane].tokens.extend(feed)
        return {lane: torch.zeros((want or {}).get(lane, len(feed)), 1) for lane, feed in feeds.items()}


def test_lane_table_parks_reuses_and_forks_shared_prefixes():
    b = _ListBackend()
    first = b.new_lane()
    b.step({first: [1, 2, 3, 4]})
    b.park(first)
    again = b.new_lane([1, 2, 9])  # the parked lane, cut to the shared part
    assert again == first and b.length(again) == 2 and b.lanes.parked == {}
    other = b.new_lane([7])
    b.step({other: [7, 7]})
    b.park(again)  # kept while another request is live (the default) ...
    b.park(other)  # ... until the next lane is parked (max_parked 1)
    assert b.live_lanes == 1 and b.lanes.parked == {other: None}
    assert b.length(b.new_lane([5])) == 0 and b.live_lanes == 1  # nothing shared: the parked lane is released
    b.min_shared = 2
    live = b.new_lane()
    b.step({live: [4, 5, 6]})
    fork = b.new_lane([4, 5, 8])  # shares min_shared tokens with a live lane: starts as its fork
    assert fork != live and b.length(fork) == 2 and b.length(live) == 3
    b.park(fork)
    b.release_all()
    assert b.live_lanes == 0 and b.lanes.parked == {}
    with pytest.raises(KeyError, match="no live lane"):
        b.step({fork: [1]})


class _SharingBackend(_ListBackend):
    """Several lanes parked at once (as llama.cpp's sequences, whose forks share the parent's cache)."""

    max_parked = 3


def test_parked_lanes_are_a_prefix_cache_per_salt():
    """A backend keeping several parked lanes serves each new prompt from the one of its salt sharing the most: a
    prompt that extends a parked lane takes it, one that leaves it part way forks it (the parked lane stays for
    later prompts), and a prompt of another salt never sees them; beyond ``max_parked`` the oldest goes."""
    b = _SharingBackend()
    system = [1, 2, 3]
    task1 = b.new_lane(system + [10], salt="a")
    b.step({task1: system + [10, 11]})
    b.park(task1, "a")
    step2 = b.new_lane(system + [50, 10, 11], salt="a")  # leaves the parked lane after the system prompt: a fork
    assert step2 != task1 and b.length(step2) == 3 and b.length(task1) == 5 and task1 in b.lanes.parked
    b.step({step2: [50, 10, 11, 12]})
    b.park(step2, "a")
    step3 = b.new_lane(system + [50, 10, 11, 12, 13], salt="a")  # extends the newest whole: taken
    assert step3 == step2 and b.length(step3) == 7 and list(b.lanes.parked) == [task1]
    b.step({step3: [13]})
    b.park(step3, "a")
    task2 = b.new_lane(system + [20], salt="a")  # the system prompt from either parked lane: both stay parked
    assert b.length(task2) == 3 and set(b.lanes.parked) == {task1, step3}
    b.release(task2)
    other = b.new_lane(system + [10, 11], salt="b")  # another salt: nothing reused, nothing of "a" dropped
    assert b.length(other) == 0 and set(b.lanes.parked) == {task1, step3}
    b.step({other: system})
    b.park(other, "b")
    extra = b.new_lane([9], salt="c")
    b.step({extra: [9]})
    b.park(extra, "c")  # a fourth parked lane: the least recently used (task1; task2 forked step3) goes
    assert list(b.lanes.parked) == [step3, other, extra] and b.live_lanes == 3
