"""Replay a benchmark run's recorded outputs through the real engine and speculation policy, priced by a cost table.

Greedy SSR gives plain decoding's tokens whatever it proposes, so which proposals the policy makes and how many the
verifier accepts can be replayed without the model: ``ReplayBackend`` "predicts", row by row, the token plain decoding
wrote after that sequence in the run. The engine, its suffix index, policy, grammar and (for the agent suite) the
tool loop all run for real; the passes they make, priced by the run's cost table, say in seconds what a change of
proposal settings would save, where a benchmark run takes minutes. It estimates decode work only: the table prices a
pass at the context it was measured at, and prefill is the same in every setting. Draft lanes, whose tokens no run
records, end at their first token, so a replay prices suffix speculation (the "suffix" method exactly; "ssr" without
its drafts).

    python -m ssr_bench.policy_replay docs/bench/agent/xeon-amx-llama-cpp-1.5b-engine-q6tiles --method ssr \\
        --set suffix_max_spec_factor=1 --set suffix_min_match=2
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ssr import SSREngine
from ssr.backends.base import Backend, Lane, stop_token_ids
from ssr.chat import encode_prompt
from ssr.config import SSRConfig
from ssr.costs import CostTable
from ssr.models import tokenizer_and_family

from . import agent
from .cli import backend_kwargs
from .methods import PLAIN, run_engine
from .runner import RESULTS, load_records
from .suites import load_suite


def recorded_sequences(records: list[dict[str, Any]], items: dict[str, dict[str, Any]], tokenizer,
                       family) -> dict[tuple[int, ...], int]:
    """Every sequence plain decoding extended in the run, mapped to the token it wrote next (an agent task's steps
    from their recorded prompts; another suite's ``items`` from their prompts encoded again)."""
    nexts: dict[tuple[int, ...], int] = {}
    for record in (r for r in records if r["method"] == PLAIN):
        if record["suite"] == "agent":
            at, turns = 0, []
            for step in record["steps"]:
                turns.append((step["prompt_ids"], record["token_ids"][at: at + step["n_tokens"]]))
                at += step["n_tokens"]
        else:
            item = items[record["item"]]
            ids = encode_prompt(tokenizer, family, item["messages"], item.get("tools"), item.get("tool_choice"))
            turns = [(ids, record["token_ids"])]
        for prompt, output in turns:
            seq = list(prompt)
            for token in output:
                nexts[tuple(seq)] = token
                seq.append(token)
    return nexts


class ReplayBackend(Backend):
    """A backend whose every row puts all its weight on the token the run's plain decoding wrote after that row's
    sequence, and on end-of-sequence where the run never saw the sequence (a draft lane)."""

    def __init__(self, tokenizer, nexts: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        self.tokenizer, self.nexts = tokenizer, nexts
        self.model_name = "replay"
        self.vocab_size = len(tokenizer)
        self.context_window = 32768
        self.eos_token_ids = stop_token_ids(tokenizer)

    def _open(self, parent: Lane | None) -> Lane:
        return Lane()

    def _keep_parked(self) -> bool:
        return True  # as llama.cpp does: a later prompt reuses the parked lane's prefix

    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        self.lanes.check(feeds)
        out = {}
        for lane, feed in feeds.items():
            seq = self.lanes[lane].tokens
            seq.extend(feed)
            rows = (want or {}).get(lane, len(feed))
            logits = torch.full((rows, self.vocab_size), -30.0)
            for row, end in enumerate(range(len(seq) - rows + 1, len(seq) + 1)):
                logits[row, self.nexts.get(tuple(seq[:end]), min(self.eos_token_ids))] = 30.0
            out[lane] = logits
        return out


@dataclass
class Replay:
    items: int
    tokens: int
    differing: int  # items whose replayed tokens are not the recorded ones (0 unless the replay is broken)
    passes: int
    pass_shapes: Counter
    steps: float  # the passes priced by the cost table, in one-token steps
    prefill_steps: float  # ... the requests' prefill passes alone (the same in every setting)
    base_seconds: float  # the table's one-token step

    @property
    def decode_steps(self) -> float:
        return self.steps - self.prefill_steps


def replay(run_dir: str | Path, method: str = "ssr", costs: CostTable | None = None, n: int | None = None,
           **overrides: Any) -> Replay:
    """Replay ``method``'s items of the run in ``run_dir`` (its results.jsonl, in the run's order, each with the
    config it ran with, changed by ``overrides``), priced by ``costs`` (default: the run's own table, meta.json)."""
    run_dir = Path(run_dir)
    records = load_records(run_dir / RESULTS)
    if costs is None:
        meta = json.loads((run_dir / "meta.json").read_text())
        if "costs" not in meta:
            raise ValueError(f"{run_dir}/meta.json holds no cost table (runs before 2026-12-06 night): pass one")
        costs = CostTable.from_dict(meta["costs"])
    mine = [r for r in records if r["method"] == method][:n]
    if not mine:
        raise ValueError(f"{run_dir} has no items of method {method!r}")
    tokenizer, family = tokenizer_and_family(records[0]["model"])
    items = {} if mine[0]["suite"] == "agent" else {it["id"]: it for it in load_suite(mine[0]["suite"])}
    nexts = recorded_sequences(records, items, tokenizer, family)
    plain = {r["item"]: r["token_ids"] for r in records if r["method"] == PLAIN}
    engine = SSREngine(ReplayBackend(tokenizer, nexts), tokenizer, family=family, model_name=records[0]["model"],
                       costs=costs)
    shapes: Counter = Counter()
    tokens = differing = passes = 0
    prefill = 0.0
    try:
        for record in mine:
            # runs before suffix_max_spec_factor existed capped a proposal at its match length
            config = SSRConfig(**{"suffix_max_spec_factor": 1.0, **record["config"]}).override(**overrides)
            if record["suite"] == "agent":
                outcome = agent.run_engine_loop(engine, agent.TASKS_BY_ID[record["task"]], config)
                ids, stats = outcome.token_ids, [s.stats for s in outcome.steps]
            else:
                result = run_engine(engine, items[record["item"]], config)
                ids, stats = result.token_ids, [result.stats]
            differing += ids != plain[record["item"]]
            tokens += len(ids)
            for s in stats:
                passes += s["forward_passes"]
                shapes.update(s["pass_shapes"])
                # a request alone prefills in one pass, what its prompt did not reuse (one token at least)
                prefill += costs(1, max(s["prompt_tokens"] - s.get("reused_prompt_tokens", 0), 1))
    finally:
        engine.close()
    return Replay(len(mine), tokens, differing, passes, shapes, costs.price(dict(shapes)), prefill, costs.base_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssr_bench.policy_replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="an `ssr bench --out` folder (results.jsonl with plain among its methods)")
    parser.add_argument("--method", default="ssr")
    parser.add_argument("--n", type=int, default=None, help="the method's first N items (default: all)")
    parser.add_argument("--costs", default=None, help="a cost table JSON (default: the run's own, meta.json)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an SSRConfig field changed for the replay (value as JSON), repeatable")
    args = parser.parse_args(argv)
    overrides = backend_kwargs(args.set, "--set")
    costs = CostTable.from_dict(json.loads(Path(args.costs).read_text())) if args.costs else None
    result = replay(args.run_dir, args.method, costs, args.n, **overrides)
    print(json.dumps({"method": args.method, "set": overrides, "items": result.items, "tokens": result.tokens,
                      "differing": result.differing, "passes": result.passes,
                      "decode_steps": round(result.decode_steps, 1), "prefill_steps": round(result.prefill_steps, 1),
                      "decode_seconds": round(result.decode_steps * result.base_seconds, 1),
                      "shapes": dict(result.pass_shapes.most_common(12))}))
    return 1 if result.differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
