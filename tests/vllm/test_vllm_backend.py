"""The in-process vLLM backend: the lane protocol against vLLM's own greedy decoding, then SSR through it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tiny_model import vllm_installed

if not vllm_installed():  # tests/vllm itself would import as a namespace package "vllm": look for the real one
    pytest.skip("vllm is not installed (install it into a separate venv: .ci/install_vllm.sh)", allow_module_level=True)

from conftest import vllm_greedy  # noqa: E402

from ssr import SSRConfig, SSREngine  # noqa: E402
from ssr.costs import CostTable  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = list(range(1000, 1040))
BASE = dict(max_think_tokens=24, max_tokens=72, max_draft_tokens=40)
PROMPTS = ["Write a function that adds two numbers.", "What is 2+2?", "Sort a list in Python.",
           "Explain recursion briefly.", "Reverse a string.", "Name three colours.", "Count to five.",
           "Parse a CSV line.", "Add docstrings to this code."]


def argmaxes(logits) -> list[int]:
    return [int(x) for x in logits.argmax(-1)]


def wait_until(check, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


# -- the protocol ---------------------------------------------------------------------------------------------------
def test_lane_protocol_matches_vllm_greedy(vllm_backend):
    b = vllm_backend
    ref = vllm_greedy(b.llm, PROMPT, 40)
    lane = b.new_lane()
    try:
        out = b.step({lane: PROMPT}, {lane: 1})[lane]
        assert out.shape == (1, b.vocab_size) and out.dtype.is_floating_point
        gen = argmaxes(out)
        for _ in range(15):
            gen.append(argmaxes(b.step({lane: gen[-1:]})[lane])[-1])
        assert gen == ref[:16]
        assert b.length(lane) == len(PROMPT) + 15
        # a fork verifies ten true tokens in the same pass as the parent decodes one
        fork = b.fork(lane)
        both = b.step({lane: [gen[-1]], fork: [gen[-1]] + ref[16:26]}, {lane: 1, fork: 11})
        assert argmaxes(both[lane]) == [ref[16]]
        assert argmaxes(both[fork]) == ref[16:27]
        b.release(fork)
        # wrong proposals: row 0 is still right; truncate them away and go on exactly
        lg = b.step({lane: [ref[16]] + ref[17:21][::-1]}, {lane: 5})[lane]
        assert argmaxes(lg)[0] == ref[17]
        b.truncate(lane, len(PROMPT) + 17)
        assert argmaxes(b.step({lane: [ref[17]] + ref[18:24]}, {lane: 7})[lane]) == ref[18:25]
    finally:
        b.release_all()
    assert b.live_lanes == 0
    assert wait_until(lambda: b.vllm_live_requests() == 0)


def test_rows_that_hit_the_prefix_cache_are_computed(vllm_backend):
    """A lane whose wanted positions were computed (and cached) by an earlier request still gets true rows."""
    b = vllm_backend
    ref = vllm_greedy(b.llm, PROMPT, 70)  # caches full blocks of PROMPT + ref
    lane = b.new_lane()
    try:
        lg = b.step({lane: PROMPT + ref[:64]}, {lane: 65})[lane]
        assert argmaxes(lg) == ref[:65]
    finally:
        b.release_all()


def test_one_step_is_one_engine_step(vllm_backend):
    b = vllm_backend
    root = b.new_lane()
    try:
        b.step({root: PROMPT})
        lanes = [root] + [b.fork(root) for _ in range(4)]
        before = b.engine_steps
        out = b.step({lane: [7 + i, 8, 9][: 1 + i % 3] for i, lane in enumerate(lanes)},
                     {lane: 1 + i % 3 for i, lane in enumerate(lanes)})
        assert b.engine_steps == before + 1
        assert [out[lane].shape[0] for lane in lanes] == [1 + i % 3 for i in range(5)]
    finally:
        b.release_all()


def test_bad_feeds_are_refused(vllm_backend):
    b = vllm_backend
    lane = b.new_lane()
    try:
        with pytest.raises(ValueError):
            b.step({lane: []})
        with pytest.raises(ValueError):
            b.step({lane: [1, 2]}, {lane: 3})
        from ssr.backends.errors import SSRBackendError

        with pytest.raises(SSRBackendError, match="context window"):
            b.step({lane: [5] * (b.context_window + 1)})
    finally:
        b.release_all()


# -- SSR on vLLM ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_ssr_greedy_identical_to_vllm_plain(vllm_engine, prompt):
    engine = vllm_engine
    ssr = engine.generate(prompt, config=SSRConfig(draft_start=4, **BASE))
    plain = engine.generate(prompt, config=SSRConfig(enabled=False, **BASE))
    assert ssr.token_ids == plain.token_ids
    assert ssr.stats["accepted_tokens"] > 0 and ssr.stats["forward_passes"] < plain.stats["forward_passes"]
    # and both are vLLM's own greedy decoding: thinking up to the budget, the forced close, then the answer
    ids, st, toks = engine.encode(prompt), ssr.stats, ssr.token_ids
    sampled_think = st["think_tokens"] - st["forced_tokens"]
    assert toks[:sampled_think] == vllm_greedy(engine.backend.llm, ids, sampled_think)
    rest = len(toks) - st["think_tokens"]
    if rest:
        assert toks[st["think_tokens"]:] == vllm_greedy(engine.backend.llm, ids + toks[: st["think_tokens"]], rest)


@pytest.mark.parametrize("overrides", [dict(draft_start=2, draft_interval=6, max_drafts=2),
                                       dict(draft_start=1, max_verify_tokens=3, max_suffix_tokens=3),
                                       dict(draft_start=0, max_tokens=30), dict(max_drafts=0)],
                         ids=["bootstrapped-drafts", "small-verify-chunks", "draft-at-zero", "suffix-only"])
def test_ssr_paths_identical(vllm_engine, overrides):
    cfg = {**BASE, **overrides}
    for prompt in PROMPTS[3:5]:
        ssr = vllm_engine.generate(prompt, config=SSRConfig(**cfg))
        plain = vllm_engine.generate(prompt, config=SSRConfig(enabled=False, **cfg))
        assert ssr.token_ids == plain.token_ids, (prompt, overrides)
    assert vllm_engine.backend.live_lanes <= 1  # the finished request's main lane stays parked for the next one


def test_concurrent_requests_share_batches_without_cross_talk(vllm_backend):
    """Nine SSR requests at once, each on its own view of the one vLLM engine: outputs equal the sequential ones,
    and vLLM ran fewer engine steps than the requests' forward passes added up (their lanes shared batches)."""
    cfg = SSRConfig(draft_start=3, **BASE)
    sequential = {}
    views = [vllm_backend.view() for _ in PROMPTS]
    solo = SSREngine(vllm_backend.view(), vllm_backend.tokenizer, model_name="tiny", costs=CostTable.flat())
    for p in PROMPTS:
        sequential[p] = solo.generate(p, config=cfg)
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def worker(prompt: str) -> None:
        try:
            engine = SSREngine(views[PROMPTS.index(prompt)], vllm_backend.tokenizer, model_name="tiny",
                               costs=CostTable.flat())
            results[prompt] = engine.generate(prompt, config=cfg)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    before = vllm_backend.engine_steps
    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    steps = vllm_backend.engine_steps - before
    for p in PROMPTS:
        assert results[p].token_ids == sequential[p].token_ids, p
    passes = sum(r.stats["forward_passes"] for r in results.values())
    assert steps < passes, (steps, passes)
    for view in views + [solo.backend, vllm_backend]:  # parked lanes hold their vLLM sessions until released
        view.release_all()
    assert wait_until(lambda: vllm_backend.vllm_live_requests() == 0)


def test_one_engine_schedules_concurrent_requests_into_shared_steps(vllm_engine):
    """Requests from several threads on ONE engine: its scheduler steps them together; outputs equal alone."""
    cfg = SSRConfig(draft_start=3, **BASE)
    sequential = {p: vllm_engine.generate(p, config=cfg).token_ids for p in PROMPTS[:4]}
    results: dict[str, list[int]] = {}
    before = vllm_engine.backend.engine_steps
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, vllm_engine.generate(p, config=cfg)))
               for p in PROMPTS[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert {p: r.token_ids for p, r in results.items()} == sequential
    assert vllm_engine.backend.engine_steps - before < sum(r.stats["forward_passes"] for r in results.values())


def test_a_failed_engine_step_fails_only_its_requests(vllm_engine):
    from ssr.backends.errors import SSRBackendError

    shared = vllm_engine.backend._engine
    original, calls = shared.client.get_output, []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected engine failure")
        return original()

    shared.client.get_output = fail_once
    try:
        with pytest.raises(SSRBackendError, match="injected"):
            vllm_engine.generate(PROMPTS[0], config=SSRConfig(**BASE))
        again = vllm_engine.generate(PROMPTS[1], config=SSRConfig(draft_start=4, **BASE))  # the engine serves on
    finally:
        shared.client.get_output = original
    assert again.token_ids == vllm_engine.generate(PROMPTS[1], config=SSRConfig(enabled=False, **BASE)).token_ids


def test_parked_lane_is_reused_by_the_next_request(vllm_backend):
    b = vllm_backend
    b.release_all()
    lane = b.new_lane([1, 2, 3])
    b.step({lane: list(range(100, 140))})
    b.park(lane)
    again = b.new_lane(list(range(100, 150)))  # extends the parked lane: its session goes on
    assert again == lane and b.length(again) == 40
    b.park(again)
    other = b.new_lane(list(range(100, 110)) + [7])  # shares 10 tokens: truncated to them
    assert other == lane and b.length(other) == 10
    fork = b.fork(other)
    out = b.step({other: [7], fork: [7]})
    assert argmaxes(out[other]) == argmaxes(out[fork])  # the restarted session and a fresh fork agree
    b.release_all()
    fresh = b.new_lane([9])
    assert b.length(fresh) == 0
    b.release_all()


def test_cancel_mid_stream_frees_lanes(vllm_engine):
    backend = vllm_engine.backend
    backend.release_all()

    async def consume() -> int:
        seen = 0
        stream = vllm_engine.astream(PROMPTS[0], config=SSRConfig(draft_start=2, **{**BASE, "max_tokens": 200,
                                                                                   "max_think_tokens": 150}))
        async for event in stream:
            seen += 1
            if seen >= 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(consume()) == 3
    # the request's thread notices the cancellation at its next step and frees every lane and vLLM session
    assert wait_until(lambda: backend.live_lanes == 0 and backend.vllm_live_requests() == 0, timeout=60)
    assert wait_until(lambda: vllm_engine.load_stats()["running"] == 0, timeout=60)
    # and the engine still answers exactly afterwards
    again = vllm_engine.generate(PROMPTS[1], config=SSRConfig(draft_start=4, **BASE))
    plain = vllm_engine.generate(PROMPTS[1], config=SSRConfig(enabled=False, **BASE))
    assert again.token_ids == plain.token_ids


def test_from_pretrained_registry(tiny_model_dir, vllm_backend):
    """backend="vllm" is reachable by name (the registry builds VLLMBackend); checked without a second engine."""
    from ssr.backends import BACKENDS

    assert "vllm" in BACKENDS and "vllm-server" in BACKENDS
    assert vllm_backend.model_name == "tiny-qwen2" and vllm_backend.logits_topk == 20
    assert vllm_backend.eos_token_ids
    from ssr.backends.base import missing_members

    assert missing_members(vllm_backend) == missing_members(vllm_backend.view()) == []  # the whole protocol


def test_full_vocabulary_view(vllm_backend):
    """logprobs=-1: every row is the full float32 logits vector (exact sampling); several rows come from sibling
    requests in the same pass; the top-K view's scores are the same numbers."""
    import torch

    full, top = vllm_backend.view(logprobs=-1), vllm_backend.view()
    assert full.logits_topk is None and top.logits_topk == 20
    ref = vllm_greedy(vllm_backend.llm, PROMPT, 12)
    try:
        a, b = full.new_lane(), top.new_lane()
        fa, fb = full.step({a: PROMPT}, {a: 1})[a], top.step({b: PROMPT}, {b: 1})[b]
        assert torch.isfinite(fa).all() and int(torch.isfinite(fb).sum()) >= 20
        known = torch.isfinite(fb)
        assert torch.allclose(fa[known], fb[known], atol=1e-4)
        rows = full.step({a: ref[:6]}, {a: 6})[a]
        assert rows.shape == (6, vllm_backend.vocab_size) and torch.isfinite(rows).all()
        assert argmaxes(rows) == ref[1:7]
    finally:
        full.release_all()
        top.release_all()


def test_calibration_measures_through_the_vllm_backend(vllm_backend):
    """The cost table is measured through the Backend protocol alone, so vLLM's steps are priced like any other's."""
    from ssr.calibrate import measure_costs

    view = vllm_backend.view()
    table = measure_costs(view, rows=(1, 2), widths=(1, 2, 4), context=40, reps=1, progress=False)
    assert table.cost[0][0] == 1.0 and table.base_seconds > 0
    assert all(c > 0 for row in table.cost for c in row)
    assert view.live_lanes == 0  # every lane it forked is released
