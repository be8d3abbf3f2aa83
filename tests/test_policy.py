"""The speculation policy: proposal lengths and draft forks priced by a cost table and online acceptance counts."""

from __future__ import annotations

import pytest

from ssr.costs import CostTable
from ssr.policy import AcceptanceCounts, SpeculationPolicy, expected_tokens

# an Intel-like float32 table from DESIGN.md: extra lanes nearly free, verified tokens not
INTEL = CostTable(rows=(1, 2, 3), widths=(1, 4, 8, 16), cost=((1.0, 2.09, 2.54, 2.91), (1.03, 2.2, 2.7, 3.1),
                                                               (1.09, 2.4, 2.9, 3.3)))
BF16 = CostTable(rows=(1, 2, 3), widths=(1, 4, 8, 16), cost=((1.0, 1.08, 1.11, 1.16), (1.0, 1.1, 1.14, 1.2),
                                                              (1.03, 1.12, 1.16, 1.22)))


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_nothing_pays_on_a_linear_table_and_everything_on_a_flat_one():
    counts = AcceptanceCounts()
    for _ in range(50):
        counts.record("prompt", 8, 8, 8)  # a source that is always right
    linear, flat = SpeculationPolicy(CostTable.linear(), counts), SpeculationPolicy(CostTable.flat(), counts)
    assert all(linear.proposal_length(rows, "prompt", 8, 16) == 0 for rows in (1, 2, 3))
    assert not linear.fork_pays(1)
    assert flat.proposal_length(1, "prompt", 8, 16) == 16
    assert flat.fork_pays(1) and flat.fork_pays(3)


def test_lengths_follow_the_table_and_the_acceptance_rate():
    counts = AcceptanceCounts()
    intel, bf16 = SpeculationPolicy(INTEL, counts), SpeculationPolicy(BF16, counts)
    # prior rate 0.6: a float32 pass of 4 tokens costs 2.09 steps for ~2.3 tokens, in bf16 1.08 steps
    k_float32, k_bf16 = intel.proposal_length(1, "prompt", 8, 16), bf16.proposal_length(1, "prompt", 8, 16)
    assert 0 < k_float32 < 4 <= k_bf16
    for _ in range(200):
        counts.record("thinking", 2, 4, 0)  # short matches in the thinking never pass
        counts.record("prefix", 0, 16, 16)  # drafts that always pass
    assert intel.proposal_length(1, "thinking", 2, 16) == 0 and bf16.proposal_length(1, "thinking", 2, 16) == 0
    assert intel.proposal_length(1, "prefix", 0, 16) == 16
    assert intel.proposal_length(1, "thinking", 20, 16) > 0  # long matches are counted apart: still the prior


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
        counts.record("thinking", 8, 3, 3, phase="think")  # the thinking copies itself
        counts.record("thinking", 8, 3, 3, phase="answer")  # ... and the answer copies the thinking
    assert not SpeculationPolicy(padded, counts).fork_pays(1)
    assert not SpeculationPolicy(padded, counts).fork_pays(1, think_speculation=False)  # the answer is cheap anyway
    hard = AcceptanceCounts()
    for _ in range(100):
        hard.record("prompt", 8, 3, 0, phase="answer")  # nothing to copy in the answer: drafts are worth a lot
    assert SpeculationPolicy(padded, hard).fork_pays(1, think_speculation=False)
    hard.record_drafts(tokens=1000, accepted=10)  # ... unless they are rarely right
    assert not SpeculationPolicy(padded, hard).fork_pays(1, think_speculation=False)
    assert SpeculationPolicy(CostTable.flat(), hard).fork_pays(3)  # a free lane always pays


def test_acceptance_counts_are_geometric_runs():
    counts = AcceptanceCounts()
    counts.record("draft:3", 5, proposed=4, accepted=2)  # 2 passed, the third failed: 3 positions tried
    counts.record("draft:0", 6, proposed=4, accepted=4)  # all passed: 4 tried (same source kind and match bucket)
    prior = 0.6 * 4
    assert counts.rate("draft:7", 7) == pytest.approx((6 + prior) / (7 + 4))
    assert counts.rate("draft:7", 40) == pytest.approx(0.6)  # another match bucket: nothing seen yet


def test_choices_are_priced_within_the_step_other_requests_share():
    from ssr.policy import Shared

    counts = AcceptanceCounts()
    intel = SpeculationPolicy(INTEL, counts)
    alone = intel.proposal_length(1, "prompt", 8, 16)
    assert 0 < alone < 8
    # others already pad the step to 8 tokens a lane: a proposal up to that width costs nothing more
    assert intel.proposal_length(1, "prompt", 8, 16, Shared(rows=2, width=8, requests=2)) >= 7
    # a step of many one-token lanes: widening it charges every row, and their tokens weigh in
    assert intel.proposal_length(1, "prompt", 8, 16, Shared(rows=2, width=1, requests=2)) <= alone
    # a draft row nearly free alone delays every request of a crowded step
    lane = CostTable(rows=(1, 2, 8, 9), widths=(1, 2), cost=((1.0, 1.9), (1.05, 2.0), (2.0, 3.9), (2.3, 4.3)))
    assert SpeculationPolicy(lane, counts).fork_pays(1)
    assert not SpeculationPolicy(lane, counts).fork_pays(1, shared=Shared(rows=7, width=1, requests=7))
