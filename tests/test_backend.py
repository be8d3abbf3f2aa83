"""The backend protocol: every backend class implements all of it. Then the transformers backend's lanes on a tiny
model: every lane's logits equal a plain forward pass over that lane's tokens, whatever else shares the batch; the
cache buffers grow O(log n) times and a step's copying does not grow with the sequence length (counted, never
timed)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from scripted import ScriptedBackend
from ssr.backends.base import Backend, missing_members
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.backends.transformers import TransformersBackend
from ssr.backends.vllm import VLLMBackend
from ssr.backends.vllm_server import VLLMServerBackend
from tiny import tiny_model

ATOL = 1e-4
BACKEND_CLASSES = [TransformersBackend, VLLMBackend, VLLMServerBackend, LlamaCppBackend, ScriptedBackend]


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


@torch.no_grad()
def reference(b: TransformersBackend, tokens: list[int], k: int = 1) -> torch.Tensor:
    """Logits of the last ``k`` positions of one plain forward pass over ``tokens`` (no cache, no batch)."""
    return b.model(input_ids=torch.tensor([tokens])).logits[0, -k:].float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=1e-4)


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
    assert again == first and b.length(again) == 2 and b.lanes.parked is None
    other = b.new_lane([7])
    b.step({other: [7, 7]})
    b.park(again)  # kept while another request is live (the default) ...
    b.park(other)  # ... until the next lane is parked
    assert b.live_lanes == 1 and b.lanes.parked == other
    assert b.length(b.new_lane([5])) == 0 and b.live_lanes == 1  # nothing shared: the parked lane is released
    b.min_shared = 2
    live = b.new_lane()
    b.step({live: [4, 5, 6]})
    fork = b.new_lane([4, 5, 8])  # shares min_shared tokens with a live lane: starts as its fork
    assert fork != live and b.length(fork) == 2 and b.length(live) == 3
    b.park(fork)
    b.release_all()
    assert b.live_lanes == 0 and b.lanes.parked is None
    with pytest.raises(KeyError, match="no live lane"):
        b.step({fork: [1]})


def test_step_want_and_lengths():
    b = backend()
    lane = b.new_lane()
    out = b.step({lane: [3, 5, 6, 7]}, {lane: 2})
    assert out[lane].shape == (2, b.vocab_size) and out[lane].dtype == torch.float32
    assert close(out[lane], reference(b, [3, 5, 6, 7], 2))
    assert b.length(lane) == 4
    out = b.step({lane: [8]})
    assert close(out[lane], reference(b, [3, 5, 6, 7, 8]))
    with pytest.raises(ValueError):
        b.step({lane: []})
    with pytest.raises(ValueError):
        b.step({lane: [3]}, {lane: 2})
    assert b.length(lane) == 5  # a refused step changes nothing


def test_fork_truncate_release_and_uneven_feeds():
    b = backend()
    main = b.new_lane()
    b.step({main: [3, 5, 6]})
    draft = b.fork(main)
    assert b.length(draft) == 3 and b.live_lanes == 2
    # lanes fed different numbers of tokens in one pass: the short one's padding is hidden
    out = b.step({main: [7, 8, 9], draft: [10]}, {main: 3})
    assert close(out[main], reference(b, [3, 5, 6, 7, 8, 9], 3))
    assert close(out[draft], reference(b, [3, 5, 6, 10]))
    # a lane that is not fed keeps its tokens; the other continues past the padding
    out = b.step({draft: [11, 12]})
    assert close(out[draft], reference(b, [3, 5, 6, 10, 11, 12], 2))
    out = b.step({main: [13]})
    assert close(out[main], reference(b, [3, 5, 6, 7, 8, 9, 13]))
    # truncate forgets the rejected tokens; the hole stays hidden
    b.truncate(main, 4)
    assert b.length(main) == 4
    out = b.step({main: [14], draft: [15]})
    assert close(out[main], reference(b, [3, 5, 6, 7, 14]))
    assert close(out[draft], reference(b, [3, 5, 6, 10, 11, 12, 15]))
    # a second fork, then release the middle row: the remaining lanes are unaffected
    third = b.fork(draft)
    b.release(draft)
    assert b.live_lanes == 2
    out = b.step({main: [4], third: [5]})
    assert close(out[main], reference(b, [3, 5, 6, 7, 14, 4]))
    assert close(out[third], reference(b, [3, 5, 6, 10, 11, 12, 15, 5]))
    b.release_all()
    assert b.live_lanes == 0


def test_truncate_crops_trailing_columns():
    b = backend()
    main = b.new_lane()
    b.step({main: [3, 4, 5]})
    draft = b.fork(main)
    b.step({main: [6], draft: [7, 8, 9, 10]})
    assert b._columns == 7
    b.release(draft)  # the draft held the last columns: nobody sees them now
    assert b._columns == 4 and b._cache.length == 4
    b.truncate(main, 2)
    assert b._columns == 2
    out = b.step({main: [11]})
    assert close(out[main], reference(b, [3, 4, 11]))


def test_parked_lane_prefix_reuse():
    b = backend()
    lane = b.new_lane()
    b.step({lane: [3, 4, 5, 6]})
    draft = b.fork(lane)
    b.step({draft: [7]})
    b.release(draft)  # a request frees its drafts, then parks its thinking lane
    b.park(lane)
    assert b.live_lanes == 1
    again = b.new_lane([3, 4, 5, 9, 9])
    assert again == lane and b.length(again) == 3
    out = b.step({again: [9, 9]})
    assert close(out[again], reference(b, [3, 4, 5, 9, 9], 2))
    b.park(again)
    other = b.new_lane([8, 8])  # nothing in common: a fresh, empty lane
    assert b.length(other) == 0 and b.live_lanes == 1
    out = b.step({other: [8, 8]})
    assert close(out[other], reference(b, [8, 8], 2))


def test_requests_share_the_cache_and_steps_compute_only_fed_rows():
    """Lanes of several requests: a prefill of the newest lane alone computes its row only, a lane stepped while
    others wait equals the lane alone, and a request that parks while others are live is released."""
    rng = random.Random(1)
    shared, alone = backend(1), backend(1)
    first = shared.new_lane()
    shared.step({first: [rng.randrange(3, 16) for _ in range(6)]})
    prompt = [rng.randrange(3, 16) for _ in range(5)]
    second = shared.new_lane(prompt)  # another request joins while the first is live
    assert shared.length(second) == 0 and shared.live_lanes == 2
    ref = alone.new_lane()
    assert close(shared.step({second: prompt})[second], alone.step({ref: prompt})[ref])
    for i in range(6):  # the two requests stepped together, or the second alone
        feed = [rng.randrange(3, 16) for _ in range(1 + i % 2)]
        feeds = {second: feed, **({first: [rng.randrange(3, 16)]} if i % 2 else {})}
        assert close(shared.step(feeds)[second], alone.step({ref: feed})[ref]), i
    shared.park(first)  # the other request is live: nothing is kept
    assert shared.live_lanes == 1 and shared.new_lane([9]) != first


def test_new_lanes_joining_a_filled_cache_prefill_together():
    """Two requests join a cache whose columns another lane holds and prefill in one pass with different lengths:
    their hidden past columns must be zeros, never uninitialised memory (0 x NaN is NaN)."""
    rng = random.Random(0)
    b = backend(1)
    b.step({b.new_lane(): [rng.randrange(3, 16) for _ in range(40)]})
    short, long = [rng.randrange(3, 16) for _ in range(10)], [rng.randrange(3, 16) for _ in range(25)]
    l1, l2 = b.new_lane(short), b.new_lane(long)
    out = b.step({l1: short, l2: long}, {l1: 1, l2: 1})
    assert close(out[l1], reference(b, short)) and close(out[l2], reference(b, long))


def test_a_new_request_forks_the_live_lane_sharing_its_prefix():
    rng = random.Random(2)
    b = backend(1)
    system = [rng.randrange(3, 16) for _ in range(20)]
    first = b.new_lane(system + [3])
    b.step({first: system + [3, 4, 5]})
    second = b.new_lane(system + [9, 9])  # shares the 20-token system prompt with the live lane
    assert second != first and b.length(second) == 20 and b.live_lanes == 2
    assert close(b.step({second: [9, 9]})[second], reference(b, system + [9, 9], 2))
    assert b.length(b.new_lane([3] * 10)) == 0  # too little in common: an empty lane


def test_columns_of_ended_requests_are_compacted():
    b, ref = backend(1), backend(1)
    old = b.new_lane()
    b.step({old: [5] * 300})  # a long request ...
    lane, alone = b.new_lane(), ref.new_lane()
    b.step({lane: [3, 4, 5]}), ref.step({alone: [3, 4, 5]})
    assert b._columns == 303
    b.release(old)  # ... ends: its 300 columns are dropped
    assert b._columns == 3 and b.length(lane) == 3
    assert close(b.step({lane: [6, 7]})[lane], ref.step({alone: [6, 7]})[alone])


def test_lane_beside_others_equals_alone():
    """A lane's logits do not depend on what else is in the batch (float32, up to rounding)."""
    rng = random.Random(0)
    alone, crowded = backend(1), backend(1)
    a = alone.new_lane()
    c = crowded.new_lane()
    prompt = [rng.randrange(3, 16) for _ in range(9)]
    assert close(alone.step({a: prompt})[a], crowded.step({c: prompt})[c])
    others = []
    for i in range(12):
        if i % 3 == 0:
            others.append(crowded.fork(c))
        if i == 7:
            crowded.release(others.pop(0))
        feed = [rng.randrange(3, 16) for _ in range(1 + i % 3)]
        feeds = {c: feed, **{o: [rng.randrange(3, 16) for _ in range(rng.randrange(1, 5))] for o in others}}
        got = crowded.step(feeds)[c]
        assert close(got, alone.step({a: feed})[a]), i
        if i % 4 == 3:  # a rejected proposal in both
            alone.truncate(a, alone.length(a) - 1)
            crowded.truncate(c, crowded.length(c) - 1)


def test_growth_is_logarithmic_and_step_copying_constant():
    b = backend()
    lane = b.new_lane()
    b.step({lane: [3, 4, 5]})
    growths, per_step = b.cache_growths, []
    for i in range(2000):
        before, grew = b.bytes_copied, b.cache_growths
        b.step({lane: [3 + i % 13]}, {lane: 1})
        if b.cache_growths == grew:
            per_step.append(b.bytes_copied - before)
    assert b.cache_growths - growths <= 11  # 3 -> 2003 columns: capacity doubles 4 -> 2048
    assert len(set(per_step)) == 1  # a step without growth writes the same bytes at 10 or 2000 tokens
    assert per_step[0] > 0
    assert b.bytes_copied < 4 * 2003 * per_step[0]  # growth copies amortise to O(1) per token


def test_speculative_pattern_growth_bounded():
    """Verify-and-reject steps (fork, feed several, truncate) keep growths logarithmic and per-token bytes flat."""
    b = backend()
    main = b.new_lane()
    b.step({main: [3, 4, 5]})
    draft = b.fork(main)
    start = b.cache_growths
    costs = []
    for i in range(300):
        before = b.bytes_copied
        grew = b.cache_growths
        b.step({main: [6, 7, 8], draft: [9]})
        b.truncate(main, b.length(main) - 2)
        if b.cache_growths == grew:
            costs.append(b.bytes_copied - before)
    assert b.cache_growths - start <= 10
    assert max(costs) == min(costs)


@torch.no_grad()
def test_buffered_cache_matches_dynamic_cache():
    """``BufferedCache`` as transformers' decoders use ``past_key_values``: same logits as ``DynamicCache`` through
    prefill, decoding, ``crop`` and ``batch_select_indices``, and the sizes the mask code asks for."""
    from transformers import DynamicCache

    from ssr.backends.transformers import BufferedCache

    model = tiny_model(4)
    ours, theirs = BufferedCache(model.config.num_hidden_layers), DynamicCache(config=model.config)

    def both(ids):
        ids = torch.tensor(ids)
        a = model(input_ids=ids, past_key_values=ours, use_cache=True).logits
        b = model(input_ids=ids, past_key_values=theirs, use_cache=True).logits
        assert torch.allclose(a, b, atol=ATOL, rtol=1e-4)

    both([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    both([[5], [6]])
    assert ours.get_seq_length() == theirs.get_seq_length() == 6
    assert ours.get_mask_sizes(2, 0) == theirs.get_mask_sizes(2, 0) == (8, 0)
    ours.crop(-2)
    theirs.crop(-2)
    assert ours.get_seq_length() == 4
    both([[7, 8], [9, 10]])
    ours.batch_select_indices(torch.tensor([1]))
    theirs.batch_select_indices(torch.tensor([1]))
    both([[11]])
    assert ours.layers[0].keys.shape == theirs.layers[0].keys.shape == (1, 1, 7, 32)


def test_auto_backend_is_llama_cpp_for_the_embedded_model_when_installed(monkeypatch):
    """``"auto"`` picks llama.cpp for an embedded model when llama-cpp-python is importable and no CUDA device is;
    transformers otherwise; ``$SSR_BACKEND`` and an explicit name win."""
    import importlib.util

    import torch

    from ssr.backends import choose_backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("SSR_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for installed, expected in ((True, "llama.cpp"), (False, "transformers")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if installed else None) if name == "llama_cpp" else real_find_spec(name, *a)))
        assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == expected
        assert choose_backend(None, "/some/local/model") == "transformers"  # not an embedded GGUF
        assert choose_backend("vllm", "qwen2.5-coder-0.5b-instruct") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "transformers"  # measured on CPU only
    monkeypatch.setenv("SSR_BACKEND", "llama.cpp")
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "llama.cpp"
