"""The policy replay: a recorded run's plain tokens, replayed through the real engine, give those tokens back, and the
proposal settings it compares change its pass counts the way they change a real run's."""

import json
from pathlib import Path

from ssr_bench.policy_replay import main, replay

from ssr.costs import CostTable

# HumanEval on the default 0.5B model, llama.cpp on the AMX Xeon (plain, suffix and ssr; 2026-12-06)
RUN = Path(__file__).resolve().parents[2] / "docs" / "bench" / "llama-cpp" / "xeon-amx" / "humaneval-2t-attn"
# that machine's table for the 0.5B model at 2 threads: a second token costs 8% of a step, a 16-token pass 2.7 steps
COSTS = CostTable(rows=(1, 2), widths=(1, 2, 4, 8, 16), cost=((1.0, 1.08, 1.25, 1.76, 2.68),
                                                               (1.08, 1.25, 1.90, 2.48, 4.23)), base_seconds=0.024)


def recorded(method: str, n: int) -> list[dict]:
    records = [json.loads(line) for line in (RUN / "results.jsonl").read_text().splitlines()]
    return [r for r in records if r["method"] == method][:n]


def test_a_replay_gives_the_recorded_tokens_in_fewer_passes():
    capped = replay(RUN, "suffix", COSTS, n=3, suffix_max_spec_factor=1.0, suffix_min_match=2)
    wider = replay(RUN, "suffix", COSTS, n=3, suffix_max_spec_factor=3.0, suffix_min_match=2)
    shorter = replay(RUN, "suffix", COSTS, n=3, suffix_max_spec_factor=1.0, suffix_min_match=1)
    tokens = sum(len(r["token_ids"]) for r in recorded("suffix", 3))
    for run in (capped, wider, shorter):
        assert run.items == 3 and run.differing == 0 and run.tokens == tokens
        assert sum(run.pass_shapes.values()) == run.passes < tokens  # suffix proposals accepted
        assert run.steps == COSTS.price(dict(run.pass_shapes)) and 0 < run.prefill_steps < run.steps
    # more proposed where a match of n tokens may propose 3n, and where a match of one token proposes at all
    assert wider.passes < capped.passes and shorter.passes < capped.passes


def test_the_command_prints_the_replay(capsys, tmp_path):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps(COSTS.to_dict()))
    assert main([str(RUN), "--method", "suffix", "--n", "1", "--costs", str(table), "--set",
                 "suffix_max_spec_factor=2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["differing"] == 0 and printed["set"] == {"suffix_max_spec_factor": 2}
    assert printed["tokens"] == len(recorded("suffix", 1)[0]["token_ids"])
