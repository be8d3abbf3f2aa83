"""The speculation policy: proposal lengths and draft forks priced by a cost table and online acceptance counts."""

from __future__ import annotations

import pytest

from ssr.costs import CostTable
from ssr.policy import AcceptanceCounts, SpeculationPolicy, expected_tokens, token_key
from ssr.proposals import Proposal
from ssr.suffix import Support

# an Intel-like float32 table from DESIGN.md: extra lanes nearly free, verified tokens not
INTEL = CostTable(rows=(1, 2, 3), widths=(1, 4, 8, 16), cost=((1.0, 2.09, 2.54, 2.91), (1.03, 2.2, 2.7, 3.1),
                                                               (1.09, 2.4, 2.9, 3.3)))
BF16 = CostTable(rows=(1, 2, 3), widths=(1, 4, 8, 16), cost=((1.0, 1.08, 1.11, 1.16), (1.0, 1.1, 1.14, 1.2),
                                                              (1.03, 1.12, 1.16, 1.22)))


def _prop(source: str, match_len: int, n: int, support: list[Support] | None = None) -> Proposal:
    """A proposal of ``n`` tokens from ``source``, matched over ``match_len`` tokens."""
    return Proposal(list(range(n)), source, match_len, support=support)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_nothing_pays_on_a_linear_table_and_everything_on_a_flat_one():
    counts = AcceptanceCounts()
    for _ in range(50):
        counts.record(_prop("prompt", 8, 16), 16)  # a source that is always right
    linear, flat = SpeculationPolicy(CostTable.linear(), counts), SpeculationPolicy(CostTable.flat(), counts)
    assert all(linear.proposal_length(rows, _prop("prompt", 8, 16)) == 0 for rows in (1, 2, 3))
    assert not linear.fork_pays(1)
    assert flat.proposal_length(1, _prop("prompt", 8, 16)) == 16
    assert flat.fork_pays(1) and flat.fork_pays(3)


def test_lengths_follow_the_table_and_the_acceptance_rate():
    counts = AcceptanceCounts()
    intel, bf16 = SpeculationPolicy(INTEL, counts), SpeculationPolicy(BF16, counts)
    # prior rate 0.6: a float32 pass of 4 tokens costs 2.09 steps for ~2.3 tokens, in bf16 1.08 steps
    proposal = _prop("prompt", 8, 16)
    k_float32, k_bf16 = intel.proposal_length(1, proposal), bf16.proposal_length(1, proposal)
    assert 0 < k_float32 < 4 <= k_bf16
    for _ in range(200):
        counts.record(_prop("thinking", 2, 4), 0)  # short matches in the thinking never pass
        counts.record(_prop("prefix", 0, 16), 16)  # drafts that always pass
    assert intel.proposal_length(1, _prop("thinking", 2, 16)) == 0 == bf16.proposal_length(1, _prop("thinking", 2, 16))
    assert intel.proposal_length(1, _prop("prefix", 0, 16)) == 16
    assert intel.proposal_length(1, _prop("thinking", 20, 16)) > 0  # long matches are counted apart: the prior


def test_forks_pay_where_an_extra_lane_costs_less_than_what_drafts_save():
    cheap_lane = CostTable(rows=(1, 2), widths=(1, 2), cost=((1.0, 1.35), (1.02, 1.4)))
    dear_lane = CostTable(rows=(1, 2), widths=(1, 2), cost=((1.0, 1.9), (2.03, 3.5)))
    counts = AcceptanceCounts()
    assert SpeculationPolicy(cheap_lane, counts).fork_pays(1)
    assert not SpeculationPolicy(dear_lane, counts).fork_pays(1)
    # a padded draft row makes the thinking lane's multi-token steps dear (a 1.32x step becomes 2.8x): a draft
    # then costs the thinking lane its speculation, and pays only if the answer would otherwise be costly
    padded = CostTable(rows=(1, 2), widths=(1, 4), cost=((1.0, 1.32), (1.1, 2.82)))
    for _ in range(100):
        counts.record(_prop("thinking", 8, 3), 3, phase="think")  # the thinking copies itself
        counts.record(_prop("thinking", 8, 3), 3, phase="answer")  # ... and the answer copies the thinking
        counts.record_found("think", True)  # ... on every pass
        counts.record_found("answer", True)
    assert not SpeculationPolicy(padded, counts).fork_pays(1)
    assert not SpeculationPolicy(padded, counts).fork_pays(1, think_speculation=False)  # the answer is cheap anyway
    hard = AcceptanceCounts()
    for _ in range(100):
        hard.record(_prop("prompt", 8, 3), 0, phase="answer")  # nothing to copy in the answer: drafts are worth a lot
    assert SpeculationPolicy(padded, hard).fork_pays(1, think_speculation=False)
    hard.record_drafts(tokens=1000, accepted=10)  # ... unless they are rarely right
    assert not SpeculationPolicy(padded, hard).fork_pays(1, think_speculation=False)
    assert SpeculationPolicy(CostTable.flat(), hard).fork_pays(3)  # a free lane always pays


def test_acceptance_counts_are_geometric_runs():
    counts = AcceptanceCounts()
    counts.record(_prop("draft:3", 5, 4), accepted=2)  # 2 passed, the third failed: 3 tokens tried
    counts.record(_prop("draft:0", 6, 4), accepted=4)  # all passed: 4 tried (same source kind and match bucket)
    prior = 0.6 * 4
    assert counts.rates(_prop("draft:7", 7, 2)) == [pytest.approx((6 + prior) / (7 + 4))] * 2
    assert counts.rates(_prop("draft:7", 40, 1)) == [pytest.approx(0.6)]  # another match bucket: nothing seen yet


def test_a_suffix_token_is_priced_by_its_support_in_the_source():
    """A token that was every continuation of its context is trusted more than one at a fork of the source text
    (its share is its prior, each continuation seen one observation beside the prior rate's one), and each kind of
    support learns its own rate: a proposal is cut before a fork."""
    sure, fork = Support(1.0, 5), Support(0.3, 10)
    counts = AcceptanceCounts()
    assert counts.rates(_prop("history", 4, 2, [sure, fork])) == [pytest.approx((5 + 0.6) / 6),
                                                                   pytest.approx((3 + 0.6) / 11)]
    policy = SpeculationPolicy(CostTable(rows=(1,), widths=(1, 4, 8), cost=((1.0, 1.2, 2.0),)), counts)
    assert policy.proposal_length(1, _prop("history", 4, 6, [sure] * 3 + [fork] * 3)) == 3
    for _ in range(100):  # this source's forks are always right, its sure tokens never
        counts.record(_prop("history", 4, 2, [fork, fork]), 2)
        counts.record(_prop("history", 4, 1, [sure]), 0)
    assert policy.proposal_length(1, _prop("history", 4, 6, [sure] * 3 + [fork] * 3)) == 0
    assert policy.proposal_length(1, _prop("history", 4, 6, [fork] * 6)) == 6
    assert counts.rates(_prop("prompt", 4, 1, [sure])) == [pytest.approx((5 + 0.6) / 6)]  # another source: its prior


def test_a_context_seen_once_is_not_taken_as_certain():
    """A suffix token whose context continued once has a share of 1 by construction: a fresh process prices it as one
    observation beside the prior rate (0.8), so where rows cost much (an AVX2 CPU's table) it verifies a few tokens of
    a long proposal, not all of them; a context seen ten times alike is trusted nearly fully (most of them)."""
    avx2 = CostTable(rows=(1,), widths=(1, 4, 8, 16), cost=((1.0, 2.40, 3.56, 5.94),))
    once, often = Support(1.0, 1), Support(1.0, 10)
    counts = AcceptanceCounts()
    assert counts.rates(_prop("prompt", 4, 1, [once])) == [pytest.approx(0.8)]
    assert counts.rates(_prop("prompt", 4, 1, [often])) == [pytest.approx(10.6 / 11)]
    policy = SpeculationPolicy(avx2, counts)
    assert 0 < policy.proposal_length(1, _prop("prompt", 4, 15, [once] * 15)) <= 3
    assert policy.proposal_length(1, _prop("prompt", 4, 15, [often] * 15)) >= 7


def test_choices_are_priced_within_the_step_other_requests_share():
    from ssr.policy import Shared

    counts = AcceptanceCounts()
    intel = SpeculationPolicy(INTEL, counts)
    proposal = _prop("prompt", 8, 16)
    alone = intel.proposal_length(1, proposal)
    assert 0 < alone < 8
    # others already pad the step to 8 tokens a lane: a proposal up to that width costs nothing more
    assert intel.proposal_length(1, proposal, Shared(rows=2, width=8, requests=2)) >= 7
    # a step of many one-token lanes: widening it charges every row, and their tokens weigh in
    assert intel.proposal_length(1, proposal, Shared(rows=2, width=1, requests=2)) <= alone
    # a draft row nearly free alone delays every request of a crowded step
    lane = CostTable(rows=(1, 2, 8, 9), widths=(1, 2), cost=((1.0, 1.9), (1.05, 2.0), (2.0, 3.9), (2.3, 4.3)))
    assert SpeculationPolicy(lane, counts).fork_pays(1)
    assert not SpeculationPolicy(lane, counts).fork_pays(1, shared=Shared(rows=7, width=1, requests=7))


# the 1.5B default-model table measured on a 2-core AMD EPYC (one thread, packed weights): one row of up to 6 tokens
# costs 1.06 steps, two rows of 6 cost 1.68
EPYC = CostTable(rows=(1, 2, 3), widths=(1, 2, 3, 4, 6, 8, 12, 16),
                 cost=((1.0, 1.06, 1.06, 1.06, 1.06, 1.54, 1.64, 2.03),
                       (1.13, 1.13, 1.13, 1.48, 1.68, 2.02, 2.81, 3.46),
                       (1.16, 1.21, 1.8, 1.94, 2.23, 2.77, 3.76, 4.66)))


def _phase_rates(think: float, answer: float, think_found: float = 1.0, answer_found: float = 1.0
                 ) -> AcceptanceCounts:
    """Counts with these per-token acceptance rates, a source having a proposal on these shares of the passes."""
    counts = AcceptanceCounts()
    counts.phase_tried = {"think": 1e6, "answer": 1e6}
    counts.phase_accepted = {"think": think * 1e6, "answer": answer * 1e6}
    counts.phase_passes = {"think": 1e6, "answer": 1e6}
    counts.phase_found = {"think": think_found * 1e6, "answer": answer_found * 1e6}
    return counts


def test_a_draft_is_priced_by_the_tokens_it_writes_a_pass():
    """A thinking lane that copies itself ~5 tokens a pass pads the draft's row to its width: the draft writes ~2
    tokens in the time the thinking writes 5, so it does not pay; with the thinking at one token a pass it does."""
    copying = SpeculationPolicy(EPYC, _phase_rates(think=0.9, answer=0.5))
    assert not copying.fork_pays(1, think_left=25, fork_feed=6)
    assert copying.fork_pays(1, think_speculation=False, think_left=25, fork_feed=6)
    novel = SpeculationPolicy(EPYC, _phase_rates(think=0.3, answer=0.6))
    assert novel.fork_pays(1, think_left=25, fork_feed=6)


# llama.cpp's table for the embedded 0.5B Q4_K_M on a 2-core AMD EPYC (Zen 5), 2 threads (ssr calibrate, 2026-12-04)
EPYC_LLAMA_CPP = CostTable(rows=(1, 2, 3), widths=(1, 2, 3, 4, 6, 8, 12, 16),
                           cost=((1.0, 2.36, 2.97, 3.30, 4.69, 4.69, 5.51, 5.88),
                                 (2.32, 3.18, 4.30, 4.30, 5.28, 5.87, 9.41, 12.23),
                                 (2.92, 4.82, 5.38, 5.38, 7.04, 8.74, 12.36, 17.28)))


def test_a_draft_is_priced_by_the_passes_that_propose():
    """Where a second row costs 1.3 steps but pads nearly free into a wide verification, a draft pays only if the
    thinking lane verifies wide proposals on most passes. Measured on HumanEval, it finds one on about one pass in
    six: the fork that was priced as if every pass proposed (a draft lane, then 1.5x the thinking's time) does not
    pay; the same rates with a proposal on every pass still do."""
    assert SpeculationPolicy(EPYC_LLAMA_CPP, _phase_rates(think=0.8, answer=0.9)).fork_pays(1, think_left=100,
                                                                                          fork_feed=5)
    rare = _phase_rates(think=0.8, answer=0.9, think_found=1 / 6, answer_found=0.5)
    assert not SpeculationPolicy(EPYC_LLAMA_CPP, rare).fork_pays(1, think_left=100, fork_feed=5)
    counts = AcceptanceCounts()
    for found in [True] + [False] * 5:
        counts.record_found("think", found)
    assert counts.found_share("think") == pytest.approx((1 + 0.5 * 4) / (6 + 4))  # the prior weighs 4 passes


def test_a_fork_that_thinking_will_not_outlast_does_not_pay():
    """The first pass's wide feed (the pending tokens and the close) is paid once: over a long thinking it is
    nothing, over a couple of tokens it is the whole price; at the budget a draft writes nothing."""
    table = CostTable(rows=(1, 2), widths=(1, 8), cost=((1.0, 1.9), (1.02, 2.6)))
    policy = SpeculationPolicy(table, _phase_rates(think=0.0, answer=0.2))
    assert policy.fork_pays(1, think_left=200, fork_feed=8)
    assert not policy.fork_pays(1, think_left=2, fork_feed=8)
    assert policy.fork_pays(1, think_left=2, fork_feed=1)  # a narrow first feed costs only the row
    assert not SpeculationPolicy(CostTable.flat()).fork_pays(1, think_left=0)


def test_the_thinking_expected_to_remain_comes_from_earlier_requests():
    counts = AcceptanceCounts()
    assert counts.think_left(8, budget=96) == 88  # nothing seen yet: the rest of the budget
    for n in (30, 34, 200):
        counts.record_think(n)
    assert counts.think_left(8, budget=96) == pytest.approx((22 + 26 + 192) / 3)
    assert counts.think_left(100, budget=400) == 100  # only the request that thought 200 got this far
    assert counts.think_left(300, budget=400) == 100  # none did: the budget's rest
    for n in range(100):
        counts.record_think(n)
    assert len(counts.think_lengths) == 64 and counts.think_lengths[-1] == 99


def test_requests_count_their_thinking_and_a_fork_is_priced_by_what_remains():
    """Every request that thought leaves its length in the engine's counts; a draft due two tokens before the
    budget closes the thinking is declined where its first feed (the pending tokens and the close) widens the
    step, and one due early in the same thinking forks (a tiny model, its thinking closed at the budget)."""
    from tiny import prompt_ids, tiny_engine

    from ssr import SSRConfig

    engine = tiny_engine(3)
    engine.policy = SpeculationPolicy(CostTable(rows=(1, 2), widths=(1, 8), cost=((1.0, 1.0), (1.0, 5.0))))
    prompt, base = prompt_ids("a b"), dict(max_think_tokens=12, max_tokens=24, think_speculation=False)
    first = engine.generate(prompt, config=SSRConfig(enabled=False, **base))
    length = first.stats["think_tokens"]
    assert engine.policy.counts.think_lengths == [length] and length >= 12  # the budget, then the close
    late = engine.generate(prompt, config=SSRConfig(draft_start=10, **base))
    assert late.stats["forks_declined"] == 1 and late.stats["drafts"] == []
    early = engine.generate(prompt, config=SSRConfig(draft_start=1, **base))
    assert early.stats["forks_declined"] == 0 and len(early.stats["drafts"]) == 1
    assert late.token_ids == early.token_ids == first.token_ids
    assert engine.policy.counts.think_lengths == [length] * 3


def test_declined_proposals_are_scored_in_hindsight_until_the_policy_speculates():
    """A compute-bound table (llama.cpp's on a 2-core CPU: 2 tokens cost 2.3 steps, 16 cost 5.4) prices no proposal
    at the prior acceptance rate, so nothing would ever be verified and nothing learnt. Declined proposals are
    scored against the tokens decoded next (free), the counts learn that this model copies its cycle, and the
    policy then verifies long proposals: fewer passes, the same tokens (a tiny model built to think in a cycle)."""
    from tiny import bigram_engine, prompt_ids

    from ssr import SSRConfig

    compute_bound = CostTable(rows=(1, 2), widths=(1, 2, 4, 8, 16),
                              cost=((1.0, 2.28, 3.17, 4.13, 5.37), (2.6, 4.5, 6.0, 8.0, 10.0)))
    assert SpeculationPolicy(compute_bound).proposal_length(1, _prop("thinking", 8, 15)) == 0  # at the prior
    engine = bigram_engine({"a": "b", "b": "c", "c": "d", "d": "a"})
    engine.policy = SpeculationPolicy(compute_bound)
    cfg = dict(max_think_tokens=80, max_tokens=100, max_drafts=0, suffix_min_match=1, suffix_min_prob=0.0)
    plain = engine.generate(prompt_ids("ab"), config=SSRConfig(enabled=False, **cfg))
    ssr = engine.generate(prompt_ids("ab"), config=SSRConfig(**cfg))
    counts = engine.policy.counts
    cycle = token_key("thinking", 32, Support(1.0, 10))  # a long match, every continuation alike, seen often
    assert counts.phase_tried["think"] > 16 and counts.tried[cycle] > 16  # learnt, mostly unverified
    assert counts.accepted[cycle] > 0.9 * counts.tried[cycle]
    assert ssr.stats["speculation"]["think"]["accepted"] > 0  # then verified, and accepted
    think = ssr.stats["speculation"]["think"]
    assert counts.phase_passes["think"] == think["steps"]  # every thinking pass looked for a proposal (plain none)
    assert think["verify_steps"] <= counts.phase_found["think"] < think["steps"]  # found: verified or declined
    assert ssr.stats["forward_passes"] < plain.stats["forward_passes"]
    assert ssr.token_ids == plain.token_ids
