"""Greedy exactness on tiny random models: SSR's token ids equal plain decoding's on every path."""

from __future__ import annotations

import collections

import pytest

from ssr import SSRConfig
from ssr.chat import tool_call_opening
from ssr.transcript import json_object_end
from tiny import GUIDED_TOOLS, TINY_FAMILY, TOOL_VOCAB, prompt_ids, tiny_engine

# (name, config overrides): each exercises one path of the engine
CASES = [
    ("no-draft", dict(draft_start=100)),
    ("one-draft", dict(draft_start=2)),
    ("draft-at-zero", dict(draft_start=0)),
    ("several-drafts", dict(draft_start=1, draft_interval=2, max_drafts=2)),
    ("several-drafts-no-bootstrap", dict(draft_start=1, draft_interval=3, max_drafts=3, bootstrap_drafts=False)),
    ("short-drafts", dict(draft_start=1, max_draft_tokens=3)),
    ("long-drafts", dict(draft_start=1, max_draft_tokens=60)),
    ("prefix-only", dict(draft_start=2, suffix_decoding=False)),
    ("suffix-only-peer", dict(max_drafts=0, suffix_sources=("prompt", "thinking", "answer"))),
    ("small-verify-chunks", dict(draft_start=1, max_verify_tokens=2, max_suffix_tokens=2)),
    ("max-tokens-in-thinking", dict(draft_start=1, max_tokens=5)),
    ("max-tokens-in-draft", dict(draft_start=1, max_tokens=18)),
    ("forced-close", dict(draft_start=1, max_think_tokens=3)),
    ("min-think", dict(draft_start=1, min_think_tokens=8, max_think_tokens=14)),
    ("stop-strings", dict(draft_start=1, stop=("y", "g\n"))),
]
BASE = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=24)
MODELS = [(seed, attention) for seed in range(3) for attention in (0.0, 0.4, 1.0)]
PROMPTS = ("abc\nde", "hhh", "xyz")


def run_pair(engine, overrides, prompt):
    cfg = {**BASE, **overrides}
    plain = engine.generate(prompt, config=SSRConfig(enabled=False, **cfg))
    ssr = engine.generate(prompt, config=SSRConfig(**cfg))
    return plain, ssr


@pytest.fixture(scope="module")
def engines():
    return {m: tiny_engine(m[0], attention=m[1], scale=0.5) for m in MODELS}


@pytest.fixture(scope="module")
def outcomes(engines):
    """Every case on every model, run once: [(case, model, plain, ssr)]."""
    runs = []
    for name, overrides in CASES:
        for i, (model, engine) in enumerate(engines.items()):
            prompt = prompt_ids(PROMPTS[i % len(PROMPTS)])
            runs.append((name, model, *run_pair(engine, overrides, prompt)))
    return runs


@pytest.mark.parametrize("case", [name for name, _ in CASES])
def test_greedy_token_identity(outcomes, case):
    for name, model, plain, ssr in outcomes:
        if name == case:
            assert ssr.token_ids == plain.token_ids, f"{case} on model {model}"
            assert ssr.answer == plain.answer and ssr.reasoning == plain.reasoning
            assert ssr.finish_reason == plain.finish_reason


def test_plain_costs_one_pass_per_chosen_token(outcomes):
    for _, _, plain, _ in outcomes:
        assert plain.stats["forward_passes"] == plain.stats["plain_forward_passes"]
        assert plain.stats["forward_passes_saved"] == 0 and plain.stats["accepted_tokens"] == 0


def test_every_path_was_exercised(outcomes):
    """The matrix is only worth something if it hit each path; count them."""
    seen = collections.Counter()
    for name, _, plain, ssr in outcomes:
        s = ssr.stats
        seen[f"closed_by_{s['think_closed_by']}"] += 1
        seen["prefix_full"] += any(d["accepted_prefix"] == d["length"] > 0 for d in s["drafts"][-1:])
        seen["prefix_partial"] += any(0 < d["accepted_prefix"] < d["length"] for d in s["drafts"])
        seen["prefix_rejected_first"] += bool(s["drafts"]) and s["accepted_prefix_tokens"] == 0 and \
            s["proposals_tried"] > 0
        seen["suffix_accepted"] += s["accepted_suffix_tokens"] > 0
        seen["suffix_rejected"] += s["proposals_tried"] > s["proposals_accepted"]
        seen["draft_hit_eos"] += any(0 in _draft_tokens(ssr, d) for d in s["drafts"])
        seen["bootstrapped"] += s["bootstrapped_tokens"] > 0
        seen["retired"] += len(s["drafts"]) > 2
        seen["length"] += ssr.finish_reason == "length"
        seen["stop"] += name == "stop-strings" and plain.finish_reason == "stop" and plain.token_ids[-1] != 0
        seen["saved"] += s["forward_passes_saved"] > 0
    for path in ("closed_by_model", "closed_by_budget", "closed_by_eos", "prefix_full", "prefix_partial",
                 "prefix_rejected_first", "suffix_accepted", "suffix_rejected", "bootstrapped", "retired",
                 "length", "stop", "saved"):
        assert seen[path] > 0, f"no run exercised {path}: {dict(seen)}"


def _draft_tokens(result, record):  # drafts report lengths, not tokens; EOS shows as a draft shorter than its cap
    return [0] if record["length"] < BASE["max_draft_tokens"] and record["length"] > 0 else []


def test_full_acceptance_needs_few_verify_passes():
    """A bigram model drafts exactly what the verifier will say: one verify pass replaces the whole answer."""
    engine = tiny_engine(1, attention=0.0, scale=0.5)
    cfg = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=40, draft_start=1, suffix_decoding=False)
    plain, ssr = run_pair(engine, cfg, prompt_ids("abc\nde"))
    assert ssr.token_ids == plain.token_ids
    answer_steps = plain.stats["answer_forward_passes"]
    assert ssr.stats["accepted_prefix_tokens"] >= 10
    assert ssr.stats["answer_forward_passes"] <= answer_steps - ssr.stats["accepted_prefix_tokens"] + 1
    assert ssr.stats["forward_passes_saved"] >= ssr.stats["accepted_prefix_tokens"] - 1


def test_streaming_deltas_add_up():
    engine = tiny_engine(2, attention=0.4, scale=0.5)
    cfg = SSRConfig(**BASE, draft_start=1, stop=("y",))
    events = list(engine.stream(prompt_ids(), config=cfg))
    result = events[-1].result
    assert events[-1].kind == "done"
    assert "".join(e.text for e in events if e.kind == "reasoning") == result.reasoning
    assert "".join(e.text for e in events if e.kind == "answer") == result.answer


def test_kv_reuse_across_requests_matches_cold_start():
    """An agent's next step extends the previous conversation: the parked cache is reused, the output is unchanged."""
    engine = tiny_engine(4, attention=0.4, scale=0.5)
    cfg = SSRConfig(**BASE, draft_start=1)
    first = engine.generate(prompt_ids("abc"), config=cfg)
    follow_up = prompt_ids("abc") + first.token_ids + prompt_ids("\nxy")
    warm = engine.generate(follow_up, config=cfg)
    engine.backend.release_all()
    cold = engine.generate(follow_up, config=cfg)
    assert warm.stats["reused_prompt_tokens"] >= len(prompt_ids("abc")) + len(first.token_ids) - 1
    assert cold.stats["reused_prompt_tokens"] == 0
    assert warm.token_ids == cold.token_ids


OPENING_TOOLS = [{"type": "function", "function": {"name": "ab", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("tool_choice", ["required", "ab"])
def test_forced_tool_call_opening_is_exact(engines, tool_choice):
    """tool_choice forces the call's opening after every kind of close (and with no thinking at all); drafts start
    from the same opening, and SSR stays token-identical to plain decoding."""
    tokenizer = next(iter(engines.values())).tokenizer
    opening = tool_call_opening(TINY_FAMILY, tool_choice, OPENING_TOOLS)
    shown = tokenizer.decode(tokenizer.encode(opening, add_special_tokens=False), skip_special_tokens=True).strip()
    closes = collections.Counter()
    for i, engine in enumerate(engines.values()):
        prompt = prompt_ids(PROMPTS[i % len(PROMPTS)])
        for name in ("one-draft", "several-drafts", "forced-close", "min-think", "suffix-only-peer"):
            cfg = {**BASE, **dict(CASES)[name]}
            for thinking in (True, False):
                runs = [engine.generate(prompt, tools=OPENING_TOOLS, tool_choice=tool_choice, thinking=thinking,
                                        config=SSRConfig(enabled=enabled, **cfg)) for enabled in (False, True)]
                plain, ssr = runs
                assert ssr.token_ids == plain.token_ids, (name, tool_choice, thinking)
                assert plain.answer.startswith(shown), (name, plain.answer)
                closes[plain.stats["think_closed_by"]] += 1
    assert closes["model"] and closes["budget"] and closes["none"]



def test_required_call_names_a_bound_tool_and_stays_exact():
    """With several tools and a required call, the tool-name guide restricts the name (a random model would almost
    never spell one) and the call's closing brace ends the answer; plain decoding and SSR apply the same rules, so
    they stay token-identical, drafts included."""
    opening = tool_call_opening(TINY_FAMILY, "required", GUIDED_TOOLS)
    names, ends = collections.Counter(), collections.Counter()
    for seed in range(4):
        engine = tiny_engine(seed, attention=0.4, scale=0.5, vocab=TOOL_VOCAB)
        for name in ("one-draft", "several-drafts", "forced-close", "small-verify-chunks", "suffix-only-peer"):
            cfg = {**BASE, "max_tokens": 80, "max_draft_tokens": 40, **dict(CASES)[name]}
            for thinking in (True, False):
                plain, ssr = (engine.generate(prompt_ids("abc"), tools=GUIDED_TOOLS, tool_choice="required",
                                              thinking=thinking, config=SSRConfig(enabled=enabled, **cfg))
                              for enabled in (False, True))
                assert ssr.token_ids == plain.token_ids, (seed, name, thinking)
                written = plain.answer.split(opening.strip(), 1)[1]
                names[written.split('"', 1)[0]] += 1
                assert written.split('"', 1)[1].startswith(', "arguments":'), written
                closed = json_object_end(plain.answer, plain.answer.find("{"))
                ends[closed is not None] += 1
                assert closed in (None, len(plain.answer)), plain.answer  # the closing brace ends the answer
    assert set(names) <= {"ab", "abc", "h_z"}, names
    assert ends[True], ends  # some calls closed within the budget


def test_one_bound_tool_is_forced_by_name():
    """A required call with one bound tool is a call to that tool: its name is forced text, not decoded."""
    engine = tiny_engine(0, attention=0.4, scale=0.5, vocab=TOOL_VOCAB)
    opening = tool_call_opening(TINY_FAMILY, "required", GUIDED_TOOLS[:1])
    assert opening.endswith('{"name": "ab", "arguments":')
    result = engine.generate(prompt_ids("abc"), tools=GUIDED_TOOLS[:1], tool_choice="required",
                             config=SSRConfig(**{**BASE, "max_tokens": 80}, draft_start=2))
    assert opening.strip() in result.answer
    assert result.stats["forced_tokens"] >= len(engine.tokenizer.encode(opening, add_special_tokens=False))
