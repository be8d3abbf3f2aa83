"""ssr/backends/transformers.py: the transformers backend's lanes on a tiny model: every lane's logits equal a plain
forward pass over that lane's tokens, whatever else shares the batch."""

from __future__ import annotations

import random

import pytest
import torch

from ssr.backends.transformers import TransformersBackend
from tiny import tiny_model

ATOL = 1e-4


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


@torch.no_grad()
def reference(b: TransformersBackend, tokens: list[int], k: int = 1) -> torch.Tensor:
    """Logits of the last ``k`` positions of one plain forward pass over ``tokens`` (no cache, no batch)."""
    return b.model(input_ids=torch.tensor([tokens])).logits[0, -k:].float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=1e-4)


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
