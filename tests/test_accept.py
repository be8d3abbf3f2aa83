"""ssr/accept.py: the acceptance rules keep the target distribution (speculative sampling, point masses, compact
top-K proposals), and the sampler's top-p/top-k processing."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import binomtest, chisquare

from ssr import SSRConfig
from ssr.accept import Compact, Sampler, argmax_rows, near_maxima, verify

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


# -- compact proposals: a draft keeps its top-K distribution only (ssr.accept.Compact) --------------------------------
P8 = torch.tensor([0.30, 0.05, 0.20, 0.02, 0.13, 0.10, 0.12, 0.08])  # the verifier: mass on every token
D8 = torch.tensor([0.05, 0.35, 0.25, 0.02, 0.03, 0.20, 0.04, 0.06])  # the draft's full distribution


def _rows(*dists):
    return torch.stack([d.log() for d in dists])


def _fits(counts, dist, ids) -> bool:
    """Chi-square goodness of fit of ``counts`` over ``ids`` to ``dist`` (restricted to ``ids``)."""
    expected = dist.double()[list(ids)]
    n = sum(counts[i] for i in ids)
    return chisquare([counts[i] for i in ids], (expected / expected.sum() * n).tolist()).pvalue > P_THRESHOLD


def test_compact_is_the_renormalised_top_k_and_owns_its_storage():
    q = _sampler(0).compact(torch.stack([D8, P8]))
    assert len(q) == 2 and all(isinstance(c, Compact) for c in q)
    s = Sampler(SSRConfig(temperature=1.0, seed=0), support=3)
    q0 = s.compact(D8.unsqueeze(0))[0]
    assert q0.ids.dtype == torch.int32 and q0.values.dtype == torch.float32 and q0.vocab == 8
    assert sorted(q0.ids.tolist()) == [1, 2, 5]
    assert torch.allclose(q0.dense(), torch.tensor([0, 0.35, 0.25, 0, 0, 0.20, 0, 0]) / 0.8)
    assert q0.nbytes == 3 * 8 and q0.ids.untyped_storage().nbytes() == 12  # not a view of the step's batch
    assert q0.prob(2) == pytest.approx(0.25 / 0.8) and q0.prob(0) == 0.0
    assert torch.allclose(q0.at(torch.tensor([5, 0, 1], dtype=torch.int32)), torch.tensor([0.25, 0.0, 0.4375]))
    assert Sampler(SSRConfig(temperature=1.0, top_k=2, seed=0)).compact(D8)[0].ids.numel() == 2  # K <= top_k


def _speculate(sampler, q, target_rows, n, targets=None):
    """``n`` rounds: propose one token drawn from ``q``, verify it; (emitted-token counts, acceptances)."""
    counts, accepted = collections.Counter(), 0
    for _ in range(n):
        token = sampler.draw(q)
        ok, nxt = verify(sampler, [token], target_rows, [q], targets=targets)
        counts[token if ok else nxt] += 1
        accepted += ok
    return counts, accepted


def _acceptance_matches(accepted, n, p, q):
    """The acceptance rate is sum_x min(p(x), q(x)) (speculative sampling's): a binomial test."""
    rate = float(torch.minimum(p, q).sum())
    return binomtest(accepted, n, rate).pvalue > P_THRESHOLD


def test_compact_proposal_keeps_target_distribution():
    """A draft token drawn from the top-3 of the draft's distribution, verified against a dense verifier whose mass
    lies mostly outside those 3 tokens: the emitted token follows the verifier exactly (chi-square), and the
    acceptance rate is the analytic one for that compact q."""
    n = 20000
    sampler = Sampler(SSRConfig(temperature=1.0, seed=3), support=3)
    q = sampler.compact(D8)[0]
    counts, accepted = _speculate(sampler, q, _rows(P8, P8), n)
    assert _fits(counts, P8, range(8))
    assert _acceptance_matches(accepted, n, P8, q.dense())
    assert 0 < accepted < n


def test_compact_target_with_compact_proposal_keeps_the_compact_target():
    """A draft lane's bootstrap: the previous draft's compact q proposed, the new draft's own compact distribution
    as the target (it draws from that one): the emitted tokens follow the compact target, never leave its support."""
    n = 20000
    sampler = Sampler(SSRConfig(temperature=1.0, seed=4), support=3)
    q = sampler.compact(D8)[0]  # ids {1, 2, 5}
    target = sampler.compact(P8.unsqueeze(0).repeat(2, 1))  # ids {0, 2, 4}: overlaps q on token 2 only
    counts, accepted = _speculate(sampler, q, _rows(P8, P8), n, targets=target)
    expected = target[0].dense()
    assert set(counts) <= {0, 2, 4}
    assert _fits(counts, expected, (0, 2, 4))
    assert _acceptance_matches(accepted, n, expected, q.dense())


def test_point_mass_against_compact_target_keeps_the_compact_target():
    """A draft lane's suffix proposal (a point mass) under its compact distribution, inside and outside its
    support."""
    n = 20000
    sampler = Sampler(SSRConfig(temperature=1.0, seed=5), support=3)
    target = sampler.compact(P8.unsqueeze(0).repeat(2, 1))
    expected = target[0].dense()
    for proposed in (0, 7):
        counts = collections.Counter()
        for _ in range(n):
            ok, nxt = verify(sampler, [proposed], _rows(P8, P8), None, targets=target)
            counts[proposed if ok else nxt] += 1
        assert set(counts) <= {0, 2, 4}
        assert _fits(counts, expected, (0, 2, 4))


def test_two_token_compact_proposal_keeps_each_position():
    """Two draft tokens from two compact q's against two different verifier rows: the first emitted token follows
    row 0, and the second (once the first passed) follows row 1."""
    n = 20000
    sampler = Sampler(SSRConfig(temperature=1.0, seed=6), support=2)
    p1 = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.1, 0.1, 0.1, 0.1])
    q0, q1 = sampler.compact(torch.stack([P8, D8]))  # the first proposal is close to row 0, the second far from row 1
    first, second = collections.Counter(), collections.Counter()
    for _ in range(n):
        proposal = [sampler.draw(q0), sampler.draw(q1)]
        ok, nxt = verify(sampler, proposal, _rows(P8, p1, P8), [q0, q1])
        first[proposal[0] if ok else nxt] += 1
        if ok:
            second[proposal[1] if ok == 2 else nxt] += 1
    assert _fits(first, P8, range(8))
    assert sum(second.values()) > n // 4
    assert _fits(second, p1, range(8))


def test_top_p_top_k_processing():
    s = Sampler(SSRConfig(temperature=1.0, top_p=0.8, top_k=3, seed=0))
    probs = s.probs(torch.tensor([0.5, 0.3, 0.15, 0.05]).log())
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_and_near_maxima_match_torch(dtype):
    """The numpy path (float32 on the CPU) and the torch fallback choose torch.argmax's token, the first of equal
    maxima, and list every other token within the window, highest first."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 5000, generator=g)
    rows[1, 7] = rows[1, 4000] = rows[1].max() + 1.0  # equal maxima: the first wins, the other ties at margin 0
    rows[2, 11] = rows[2].max() + 0.05  # a near-tie with the old maximum
    rows = rows.to(dtype)
    assert argmax_rows(rows) == torch.argmax(rows, dim=-1).tolist()
    assert argmax_rows(rows[3]) == [int(torch.argmax(rows[3]))]
    ties = near_maxima(rows, argmax_rows(rows), 0.1, 3)
    top = torch.topk(rows.float(), 4, dim=-1)
    for i in range(len(rows)):
        best = int(torch.argmax(rows[i]))
        expect = [(int(t), float(top.values[i, 0] - v)) for v, t in zip(top.values[i], top.indices[i])
                  if int(t) != best and float(top.values[i, 0] - v) <= 0.1]
        got = ties.get(i, [])
        assert sorted(t for t, _ in got) == sorted(t for t, _ in expect)
        assert all(abs(m - dict(expect)[t]) < 1e-5 for t, m in got)
    assert ties[1] == [(4000, 0.0)] and 2 in ties
