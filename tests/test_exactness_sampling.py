"""Sampling exactness on tiny random models (cross-cutting): SSR's sampled outputs follow plain sampling's
distribution end to end, for each kind of proposal, in the thinking and on guided tool names."""

from __future__ import annotations

import collections

import pytest
from scipy.stats import chi2_contingency

from ssr import SSRConfig
from tiny import GUIDED_TOOLS, TINY_FAMILY, TOOL_VOCAB, prompt_ids, tiny_engine

P_THRESHOLD = 1e-3  # fixed seeds make each test deterministic; a sound test passes far above this


def same_distribution(plain: collections.Counter, ssr: collections.Counter) -> bool:
    """Two-sample chi-square on outcome counts; outcomes seen fewer than 10 times in all are pooled."""
    keys = [k for k in plain if plain[k] + ssr[k] >= 10]
    rest = [sum(v for k, v in c.items() if k not in keys) for c in (plain, ssr)]
    table = [[plain[k] for k in keys] + rest[:1], [ssr[k] for k in keys] + rest[1:]]
    if sum(rest) == 0:
        table = [row[:-1] for row in table]
    return chi2_contingency(table).pvalue > P_THRESHOLD


BASE = dict(temperature=1.0, max_think_tokens=2, max_tokens=7, draft_start=0, max_draft_tokens=4)
VARIANTS = {  # each SSR variant exercises one kind of proposal
    "draft-prefix": dict(suffix_decoding=False),
    "suffix-point-mass": dict(max_drafts=0, suffix_min_match=1, suffix_min_prob=0.0),
    # proposals from earlier samples alone (the engine's history of outputs): point masses drawn from other requests
    "history-point-mass": dict(max_drafts=0, suffix_sources=("history",), suffix_min_match=1, suffix_min_prob=0.0),
    # drafts drawn from (and keeping) their top-3 of the 16-token vocabulary: the answer verifies under compact q
    "draft-prefix-top3": dict(suffix_decoding=False, draft_support=3),
    # iterative drafts: each new one verifies the previous draft's compact q under its own compact distribution
    "bootstrap-top3": dict(suffix_decoding=False, draft_interval=1, max_drafts=2, max_think_tokens=4, max_tokens=10,
                           draft_support=3),
}
N = 800


def _sample(engine, **overrides):
    outputs, accepted = collections.Counter(), collections.Counter()
    for seed in range(N):
        r = engine.generate(prompt_ids("ab"), config=SSRConfig(seed=seed, **{**BASE, **overrides}))
        outputs[r.answer[:3]] += 1
        accepted["prefix"] += r.stats["accepted_prefix_tokens"]
        accepted["suffix"] += r.stats["accepted_suffix_tokens"]
        accepted["tried"] += r.stats["proposals_tried"]
        accepted["bootstrapped"] += r.stats["bootstrapped_tokens"]
        support = r.stats["draft_probs_support"]
        assert r.stats["draft_probs_peak_bytes"] <= r.stats["draft_tokens"] * support * 8  # K ids + K probabilities
        accepted["held_at_end"] += r.stats["draft_probs_held_bytes"]
    return outputs, accepted


@pytest.fixture(scope="module")
def tiny_sampling():
    engine = tiny_engine(3, attention=0.3, scale=0.6)
    assert engine.family is TINY_FAMILY
    return engine, _sample(engine, enabled=False)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_end_to_end_distribution_matches_plain_sampling(tiny_sampling, variant):
    """Tiny model, 16-token vocabulary: SSR's sampled answers vs plain sampling, two-sample chi-square."""
    engine, plain = tiny_sampling
    if "max_think_tokens" in VARIANTS[variant]:  # another thinking budget: its own plain reference
        plain = _sample(engine, enabled=False, **VARIANTS[variant])[0]
    ssr, accepted = _sample(engine, **VARIANTS[variant])
    if variant.startswith("draft-prefix") or variant.startswith("bootstrap"):
        assert accepted["prefix"] > N // 10, accepted  # drafts really were accepted (and rejected) often
    else:  # point-mass proposals were tried often: rejections exercise the recovery rule
        assert accepted["tried"] > N // 2 and accepted["suffix"] > 0, accepted
    if variant.startswith("bootstrap"):
        assert accepted["bootstrapped"] > N // 10, accepted  # previous drafts' compact q verified by new drafts
    assert same_distribution(plain, ssr)


def test_thinking_speculation_keeps_the_distribution():
    """Point-mass proposals in the thinking lane (and draft lanes) with a long thinking: the sampled chains of thought
    and answers follow plain sampling's distribution."""
    engine = tiny_engine(3, attention=0.3, scale=0.6)
    cfg = dict(temperature=1.0, max_think_tokens=6, max_tokens=9, draft_start=1, max_draft_tokens=4,
               suffix_min_match=1, suffix_min_prob=0.0)
    samples, accepted = [], 0
    for enabled in (False, True):
        counts = collections.Counter()
        for seed in range(400):
            r = engine.generate(prompt_ids("ab"), config=SSRConfig(enabled=enabled, seed=seed, **cfg))
            counts[engine.tokenizer.decode(r.token_ids[1:4])] += 1
            accepted += r.stats["think_accepted_tokens"]
        samples.append(counts)
    plain, ssr = samples
    assert accepted > 20, accepted  # thinking proposals really were verified and accepted
    assert same_distribution(plain, ssr)


def test_guided_tool_names_keep_the_distribution():
    """A required call among several tools: SSR samples the guided name (drafts and schema proposals verified on
    masked rows) with plain sampling's distribution."""
    engine = tiny_engine(5, attention=0.3, scale=0.6, vocab=TOOL_VOCAB)
    cfg = dict(temperature=1.0, max_think_tokens=2, max_tokens=40, draft_start=0, max_draft_tokens=20)
    names, accepted = [], 0
    for enabled in (False, True):
        counts = collections.Counter()
        for seed in range(400):
            r = engine.generate(prompt_ids("ab"), tools=GUIDED_TOOLS, tool_choice="required",
                                config=SSRConfig(enabled=enabled, seed=seed, **cfg))
            counts[r.answer.split('{"name": "', 1)[1].split('"', 1)[0]] += 1
            accepted += r.stats["accepted_tokens"]
        names.append(counts)
    plain, ssr = names
    assert set(plain) | set(ssr) <= {"ab", "abc", "h_z"} and len(plain) >= 2, names
    assert accepted > 400, accepted  # proposals really were verified on guided rows
    keys = sorted(set(plain) | set(ssr))
    assert chi2_contingency([[plain[k] for k in keys], [ssr[k] for k in keys]]).pvalue > P_THRESHOLD
