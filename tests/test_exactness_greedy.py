"""Greedy exactness on tiny random models (cross-cutting, the exactness matrix): SSR's token ids equal plain
decoding's on every path."""

from __future__ import annotations

import collections

import pytest

from ssr import SSRConfig
from ssr.chat import tool_call_opening
from ssr.costs import CostTable
from ssr.policy import SpeculationPolicy
from ssr.transcript import json_object_end
from tiny import GUIDED_TOOLS, TINY_FAMILY, TOOL_VOCAB, bigram_engine, prompt_ids, tiny_engine

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
    # speculation outside the answer (on in every case above; these isolate and stretch it)
    ("think-speculation-only", dict(max_drafts=0, suffix_decoding=False, suffix_min_match=1, suffix_min_prob=0.0)),
    ("think-speculation-long", dict(draft_start=100, max_think_tokens=30, min_think_tokens=10, suffix_min_match=1,
                                    suffix_min_prob=0.0, max_suffix_tokens=6)),
    ("draft-speculation", dict(draft_start=0, think_speculation=False, suffix_min_match=1, suffix_min_prob=0.0)),
    ("no-speculation-outside-answer", dict(draft_start=1, think_speculation=False, draft_speculation=False)),
    # last: the case before it left its output of the same prompt in the engine's history
    ("history-only", dict(max_drafts=0, suffix_sources=("history",))),
]
BASE = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=24)
MODELS = [(seed, attention) for seed in range(3) for attention in (0.0, 0.4, 1.0)]
PROMPTS = ("abc\nde", "hhh", "xyz", [5, 6, 0, 5, 6, 1, 5, 6, 3])  # the last holds EOS and "</think>" ids


def run_pair(engine, overrides, prompt):
    cfg = {**BASE, **overrides}
    if "history" not in cfg.get("suffix_sources", ()):
        engine.history.clear()  # each case on its own paths, not on an earlier case's output of the same prompt
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
            prompt = _prompt(PROMPTS[i % len(PROMPTS)])
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
        seen["history_accepted"] += s["accepted_by_source"].get("history", 0) > 0
    for path in ("closed_by_model", "closed_by_budget", "closed_by_eos", "prefix_full", "prefix_partial",
                 "prefix_rejected_first", "suffix_accepted", "suffix_rejected", "bootstrapped", "retired",
                 "length", "stop", "saved", "history_accepted"):
        assert seen[path] > 0, f"no run exercised {path}: {dict(seen)}"


def test_speculation_paths_were_exercised(outcomes):
    """Thinking-lane and draft-lane speculation: accepted and rejected runs, and runs that a transcript rule cut
    (the model's close, the budget's forced close, a "Wait" continuation, EOS, max_tokens, a stop string)."""
    seen = collections.Counter()
    for _, _, _, ssr in outcomes:
        spec = ssr.stats["speculation"]
        seen["think_accepted"] += spec["think"]["accepted"] > 0
        seen["think_rejected"] += spec["think"]["proposed"] > spec["think"]["accepted"]
        seen["draft_accepted"] += spec["draft"]["accepted"] > 0
        seen["draft_rejected"] += spec["draft"]["proposed"] > spec["draft"]["accepted"]
        for phase in ("think", "answer"):
            for rule, n in spec[phase]["ended"].items():
                seen[f"{phase}:{rule}"] += n
    for path in ("think_accepted", "think_rejected", "draft_accepted", "draft_rejected", "think:close:model",
                 "think:close:budget", "answer:finish:stop"):
        assert seen[path] > 0, f"no run exercised {path}: {dict(seen)}"


def test_nothing_pays_on_a_linear_cost_table():
    """A machine where every extra row or token costs a whole step: the policy proposes nothing and forks no
    draft, so SSR takes exactly plain decoding's forward passes."""
    declined = 0
    for seed in range(3):
        engine = tiny_engine(seed, attention=0.4, scale=0.5)
        engine.policy = SpeculationPolicy(CostTable.linear())
        for name, overrides in CASES:
            plain, ssr = run_pair(engine, overrides, _prompt(PROMPTS[seed]))
            assert ssr.token_ids == plain.token_ids, (seed, name)
            assert ssr.stats["forward_passes"] == plain.stats["forward_passes"], (seed, name)
            assert ssr.stats["drafts"] == [] and ssr.stats["speculation"]["think"]["proposed"] == 0
            assert ssr.stats["proposed_tokens"] == 0
            declined += ssr.stats["forks_declined"]
    assert declined > 0  # drafts were due and the cost model turned them down


def _prompt(spec):
    return list(spec) if isinstance(spec, list) else prompt_ids(spec)


def _draft_tokens(result, record):  # drafts report lengths, not tokens; EOS shows as a draft shorter than its cap
    return [0] if record["length"] < BASE["max_draft_tokens"] and record["length"] > 0 else []


def test_full_acceptance_needs_few_verify_passes():
    """A bigram model drafts exactly what the verifier will say: one verify pass replaces the whole answer."""
    engine = tiny_engine(1, attention=0.0, scale=0.5)
    cfg = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=40, draft_start=1, suffix_decoding=False,
               think_speculation=False)  # thinking at one token a pass: the draft gets its whole length
    plain, ssr = run_pair(engine, cfg, prompt_ids("abc\nde"))
    assert ssr.token_ids == plain.token_ids
    answer_steps = plain.stats["answer_forward_passes"]
    assert ssr.stats["accepted_prefix_tokens"] >= 10
    assert ssr.stats["answer_forward_passes"] <= answer_steps - ssr.stats["accepted_prefix_tokens"] + 1
    assert ssr.stats["forward_passes_saved"] >= ssr.stats["accepted_prefix_tokens"] - 1


def test_draft_prefix_verified_in_chunks_keeps_its_alignment():
    """A draft verified a few tokens a pass: after a chunk passes whole, the verifier's own token is the draft's next
    one, and the next chunk starts after it, so the whole draft is still taken (one chunk per pass)."""
    engine = tiny_engine(1, attention=0.0, scale=0.5)
    cfg = dict(max_think_tokens=12, max_tokens=48, max_draft_tokens=40, draft_start=1, suffix_decoding=False,
               think_speculation=False, max_verify_tokens=3)
    plain, ssr = run_pair(engine, cfg, prompt_ids("abc\nde"))
    assert ssr.token_ids == plain.token_ids
    draft, chunks = ssr.stats["drafts"][-1], ssr.stats["speculation"]["answer"]["verify_steps"]
    assert draft["length"] >= 8 and draft["accepted_prefix"] + chunks >= draft["length"]  # the whole draft is used
    assert chunks <= -(-draft["length"] // 4), (draft, chunks)  # 3 of its tokens + the verifier's own per pass


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
def test_forced_tool_call_opening_is_exact(tool_choice):
    """tool_choice forces the call's opening after every kind of close (and with no thinking at all); drafts start
    from the same opening, the call grammar masks every lane after it, and SSR stays token-identical to plain
    decoding."""
    engines = {m: tiny_engine(m[0], attention=m[1], scale=0.5, vocab=TOOL_VOCAB) for m in MODELS}
    tokenizer = next(iter(engines.values())).tokenizer
    opening = tool_call_opening(TINY_FAMILY, tool_choice, OPENING_TOOLS)
    shown = tokenizer.decode(tokenizer.encode(opening, add_special_tokens=False), skip_special_tokens=True).strip()
    closes = collections.Counter()
    for i, engine in enumerate(engines.values()):
        prompt = _prompt(PROMPTS[i % len(PROMPTS)])
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
    """With several tools and a required call, the call grammar restricts the name (a random model would almost
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


CLOSING = {"a": "b", "b": "c", "c": "</think>", "</think>": "x", "Wait": "a", "\n": "x", "x": "y", "y": "z",
           "z": "<eos>", "<eos>": "a"}  # thinks "abc", closes; answers "xyz" and ends
LOOPING = {**CLOSING, "c": "a"}  # thinks "abcabc..." until the budget closes it
ENDING = {**CLOSING, "c": "<eos>"}  # ends its turn inside the thinking (which is then force-closed)
DESIGNED = [  # (model, config, the rules that must end a phase right after accepted proposed tokens)
    (CLOSING, dict(min_think_tokens=8, max_think_tokens=30, draft_start=100), {"think:rewound", "think:close:model",
                                                                              "answer:finish:stop"}),
    (CLOSING, dict(min_think_tokens=8, max_think_tokens=30, draft_start=1, stop=("z",)), {"answer:finish:stop"}),
    (LOOPING, dict(max_think_tokens=14, draft_start=2), {"think:close:budget"}),
    (LOOPING, dict(max_think_tokens=40, max_tokens=20, draft_start=2), {"think:finish:length"}),
    (ENDING, dict(max_think_tokens=30, draft_start=100, prompt="abc"), {"think:close:eos"}),
]


@pytest.mark.parametrize("case", range(len(DESIGNED)))
def test_accepted_runs_cut_by_transcript_rules(case):
    """A model built to think in a cycle: thinking-lane proposals copy the cycle, so accepted runs reach a "Wait"
    continuation, the model's close, the budget, max_tokens, EOS and stop strings, and every rule still acts exactly
    where plain decoding applies it."""
    successors, overrides, rules = DESIGNED[case]
    engine = bigram_engine(successors)
    overrides = dict(overrides)
    # "xyz<eos>ab": text for the answer to copy; "abc<eos>xyz<eos>ab": a thinking that copies an end of turn
    head = overrides.pop("prompt", None)
    prompt = (prompt_ids(head) + [0] if head else []) + prompt_ids("xyz") + [0] + prompt_ids("ab")
    cfg = {"max_tokens": 60, "suffix_min_match": 1, "suffix_min_prob": 0.0, **overrides}
    plain = engine.generate(prompt, config=SSRConfig(enabled=False, **cfg))
    ssr = engine.generate(prompt, config=SSRConfig(**cfg))
    assert ssr.token_ids == plain.token_ids and ssr.answer == plain.answer and ssr.reasoning == plain.reasoning
    assert ssr.finish_reason == plain.finish_reason
    spec = ssr.stats["speculation"]
    ended = {f"{phase}:{rule}" for phase in ("think", "answer") for rule in spec[phase]["ended"]}
    assert rules <= ended, (rules, spec)
    assert spec["think"]["accepted"] > 0
    assert ssr.stats["forward_passes"] < plain.stats["forward_passes"]
    if cfg["draft_start"] < 100:
        assert spec["draft"]["accepted"] > 0 or ssr.stats["drafts"]
