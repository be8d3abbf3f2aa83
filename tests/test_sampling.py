"""Sampling exactness: SSR's outputs follow the model's own distribution (acceptance rules and end to end)."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from ssr import SSRConfig
from ssr.accept import Sampler, verify
from tiny import GUIDED_TOOLS, TINY_FAMILY, TOOL_VOCAB, prompt_ids, tiny_engine

P_THRESHOLD = 1e-3  # fixed seeds make each test deterministic; a sound test passes far above this


def _sampler(seed=0, **kw):
    return Sampler(SSRConfig(temperature=1.0, seed=seed, **kw))


def test_speculative_sampling_keeps_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sampler, counts = _sampler(1), collections.Counter()
    for _ in range(20000):
        token = sampler.draw(q)
        accepted, nxt = verify(sampler, [token], torch.stack([p.log(), p.log()]), [q])
        counts[token if accepted else nxt] += 1
    observed = [counts[i] for i in range(4)]
    assert chisquare(observed, (p * 20000).tolist()).pvalue > P_THRESHOLD


def test_point_mass_proposals_keep_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for proposed in (0, 3):
        sampler, counts = _sampler(2), collections.Counter()
        for _ in range(20000):
            accepted, nxt = verify(sampler, [proposed], torch.stack([p.log(), p.log()]), None)
            counts[proposed if accepted else nxt] += 1
        assert chisquare([counts[i] for i in range(4)], (p * 20000).tolist()).pvalue > P_THRESHOLD


def test_top_p_top_k_processing():
    s = Sampler(SSRConfig(temperature=1.0, top_p=0.8, top_k=3, seed=0))
    probs = s.probs(torch.tensor([0.5, 0.3, 0.15, 0.05]).log())
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


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
}
N = 800


def _sample(engine, **overrides):
    outputs, accepted = collections.Counter(), collections.Counter()
    for seed in range(N):
        r = engine.generate(prompt_ids("ab"), config=SSRConfig(seed=seed, **BASE, **overrides))
        outputs[r.answer[:3]] += 1
        accepted["prefix"] += r.stats["accepted_prefix_tokens"]
        accepted["suffix"] += r.stats["accepted_suffix_tokens"]
        accepted["tried"] += r.stats["proposals_tried"]
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
    ssr, accepted = _sample(engine, **VARIANTS[variant])
    if variant == "draft-prefix":
        assert accepted["prefix"] > N // 10, accepted  # drafts really were accepted (and rejected) often
    else:  # point-mass proposals were tried often: rejections exercise the recovery rule
        assert accepted["tried"] > N // 2 and accepted["suffix"] > 0, accepted
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
