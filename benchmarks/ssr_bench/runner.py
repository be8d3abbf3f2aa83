"""Run methods side by side in one process, interleaved per item, appending one JSON line per (item, method).

* Interleaving (item 1: every method, item 2: every method, ...) makes slow drift of the machine hit every method
  alike.
* The results file is append-only JSON lines: an interrupted run resumes where it stopped (pairs already recorded
  with the same model, backend and config are skipped; failed pairs are retried).
* Every exact method's token ids are compared with ``plain``'s on the same item; a difference is printed loudly
  (``MISMATCH``, in red) and recorded (``identical_to_plain: false``), and the report lists it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ssr.agreement import compare
from ssr.config import SSRConfig
from ssr.costs import CostTable
from ssr.history import OutputHistory

from . import methods as M
from .projection import load_table, price_with, projected_steps
from .scoring import score_item
from .suites import load_suite

RED, YELLOW, GREEN, RESET = "\033[31;1m", "\033[33m", "\033[32m", "\033[0m"
RESULTS = "results.jsonl"

# Budgets per suite. The default model is an instruct model prompted to think; min_think_tokens (budget forcing)
# gives it reasoning-model-like chains of thought, as DESIGN.md explains; every method of a suite shares them.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {
        "humaneval": dict(max_think_tokens=256, min_think_tokens=96, draft_start=16, max_tokens=768),
        "classeval": dict(max_think_tokens=384, min_think_tokens=128, draft_start=32, max_tokens=1536,
                          max_draft_tokens=512),
        "longproc": dict(max_think_tokens=256, min_think_tokens=64, draft_start=32, max_tokens=1024,
                         max_draft_tokens=512),
        "bfcl": dict(max_think_tokens=128, min_think_tokens=32, draft_start=8, max_tokens=256),
        "bfcl-auto": dict(max_think_tokens=128, min_think_tokens=32, draft_start=8, max_tokens=256),
        # per step of the loop: the decision turns answer at once (auto mode), a step after a tool result thinks
        # (192: the thought writes out a changed file, as the tool-result demonstration does)
        "agent": dict(max_think_tokens=192, min_think_tokens=0, draft_start=8, max_tokens=400),
    },
    # CI: a couple of items, tiny budgets; minutes on 2 CPU cores
    "smoke": {
        suite: dict(max_think_tokens=20, min_think_tokens=8, draft_start=4, max_tokens=48, max_draft_tokens=32,
                    max_suffix_tokens=8)
        for suite in ("humaneval", "classeval", "longproc", "bfcl", "bfcl-auto", "agent")
    },
}
PRESET_N = {"default": None, "smoke": 1}
PRESET_METHODS = {"default": ("all",), "smoke": ("plain", "suffix", "ssr", "prompt-lookup")}
PRESET_SUITES = {"default": ("humaneval",), "smoke": ("humaneval", "bfcl")}


def base_config(suite: str, preset: str = "default", **overrides: Any) -> SSRConfig:
    """The budgets every method of ``suite`` shares (greedy)."""
    fields = dict(PRESETS[preset].get(suite, PRESETS[preset].get("humaneval", {})))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields.setdefault("temperature", 0.0)
    return SSRConfig(**fields)


# ---------------------------------------------------------------------------------------------------- records


def config_key(model: str, backend: str, suite: str, method: str, config: SSRConfig | None,
               base: SSRConfig) -> str:
    """Identifies what a record measured: records with another key are not reused on resume."""
    payload = {"model": model, "backend": backend, "suite": suite, "method": method,
               "config": (config or base).to_dict(), "lookup": _peer_settings(method) if config is None else None}
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()[:12]


def _peer_settings(method: str) -> Any:
    if method == M.PROMPT_LOOKUP:
        return M.PROMPT_LOOKUP_TOKENS
    if method == M.LLAMA_CPP:
        return "Llama.generate greedy"
    if method in M.LLAMA_SERVER_PEERS:
        from .llama_server import SPECS as SERVER_SPECS

        return ["llama-server greedy", *SERVER_SPECS[method]]
    from .vllm_peers import SPECS

    return SPECS.get(method)


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON line of a results file (a torn last line from a killed run is ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    with p.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def done_pairs(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(key, item id, method) -> the successful record; failed records do not count (they are retried)."""
    done = {}
    for r in records:
        if r.get("error"):
            continue
        done[(r.get("key"), r["item"], r["method"])] = r
    return done


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    if p.exists() and p.stat().st_size:
        with p.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"  # a run killed mid-write left half a line: start a fresh one
    with p.open("a", encoding="utf-8") as f:
        f.write(("\n" if torn else "") + json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The numbers the report uses, from the engine's stats dict (missing keys stay None)."""
    seconds = stats.get("seconds") or {}
    drafts = stats.get("drafts") or []
    return {
        "think_tokens": stats.get("think_tokens"),
        "answer_tokens": stats.get("answer_tokens"),
        "forced_tokens": stats.get("forced_tokens"),
        "forced_spans": stats.get("forced_spans"),  # the replay peers insert plain's forced text where it went
        "think_closed_by": stats.get("think_closed_by"),
        "forward_passes": stats.get("forward_passes"),
        "answer_forward_passes": stats.get("answer_forward_passes"),
        "think_forward_passes": stats.get("think_forward_passes"),
        "verify_passes": stats.get("verify_passes"),
        "accepted_prefix": stats.get("accepted_prefix_tokens"),
        "accepted_suffix": stats.get("accepted_suffix_tokens"),
        "accepted_by_source": stats.get("accepted_by_source"),
        "draft_tokens": stats.get("draft_tokens"),
        "drafts": len(drafts) if isinstance(drafts, list) else drafts,
        "draft_budgets": [d.get("budget") for d in drafts] if isinstance(drafts, list) else None,
        "proposed_tokens": stats.get("proposed_tokens"),
        "think_accepted": stats.get("think_accepted_tokens"),
        "speculation": stats.get("speculation"),
        "forks_declined": stats.get("forks_declined"),
        "cost_model": stats.get("cost_model"),
        "forward_passes_saved": stats.get("forward_passes_saved"),
        "pass_shapes": stats.get("pass_shapes"),
        "stats_ttfa_s": stats.get("time_to_first_answer_token"),
        "seconds": seconds,
    }


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class BenchRun:
    suites: list[str]
    methods: list[str]
    out: Path
    n: int | None = None
    model: str | None = None
    backend: str = "transformers"
    preset: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)
    data_dir: str | None = None
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    warmup: bool = True
    agent_front: str = "engine"  # the agent suite's loop: engine, langchain or llamaindex (agent.FRONTS)
    agent_steps: int | None = None  # the agent suite's step limit (default agent.MAX_STEPS)
    costs: str | None = None  # FILE#TABLE: the policy prices with another machine's table (``projection``)
    # "cold": every item of every method from an empty prompt cache; "warm": each method's items keep the prompts
    # its own earlier items cached (its own cache salt), as a session running one conversation after another does
    prompt_cache: str = "cold"
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))
    # each method's earlier outputs (the engine's suffix source "history"): a method copies only from its own runs
    histories: dict[str, OutputHistory] = field(default_factory=dict, repr=False)

    @property
    def results_path(self) -> Path:
        return self.out / RESULTS


def load_engine(model: str | None, backend: str, **backend_kwargs):
    from ssr import get_engine

    return get_engine(model=model, backend=backend, **backend_kwargs)


def _color(text: str, color: str) -> str:
    return f"{color}{text}{RESET}" if sys.stderr.isatty() or os.environ.get("FORCE_COLOR") else text


def run_bench(run: BenchRun, engine=None) -> Path:
    """Run every (suite item, method) pair not yet in ``run.out/results.jsonl``; returns the results path."""
    methods = M.parse_methods(run.methods, run.backend)
    run.out.mkdir(parents=True, exist_ok=True)
    records = load_records(run.results_path)
    done = done_pairs(records)

    work: list[tuple[str, dict[str, Any], SSRConfig]] = []
    for suite in run.suites:
        items = load_suite(suite, n=run.n, data_dir=run.data_dir)
        base = base_config(suite, run.preset, **run.overrides)
        work.extend((suite, item, base) for item in items)

    if engine is None:
        run.log(f"loading model {run.model or 'default'} on {run.backend} ...")
        engine = load_engine(run.model, run.backend, **run.backend_kwargs)
    model_name = getattr(engine, "model_name", str(run.model))
    projection = price_with(engine, load_table(run.costs)) if run.costs else None
    _write_meta(run, engine, methods, projection)

    def key_of(suite: str, method: str, base: SSRConfig) -> str:
        measured = f"agent:{run.agent_front}:{run.agent_steps}" if suite == "agent" else suite  # the loop counts
        measured += ":warm" if run.prompt_cache == "warm" else ""
        priced = f"{run.backend}@{run.costs}" if run.costs else run.backend  # another table: other choices
        return config_key(model_name, priced, measured, method, M.method_config(method, base), base)

    pending = [(s, it, b) for s, it, b in work
               if any((key_of(s, m, b), it["id"], m) not in done for m in methods)]
    run.log(f"{len(work)} items x {len(methods)} methods ({', '.join(methods)}); "
            f"{len(work) - len(pending)} items already complete in {run.results_path}")
    if pending and run.warmup:
        _warmup(engine, pending[0][1])

    from tqdm.auto import tqdm

    bar = tqdm(total=len(work), initial=len(work) - len(pending), desc="bench", unit="item",
               disable=not run.progress, file=sys.stderr)
    peers = _Peers(run, engine)
    try:
        mismatches = _run_pending(run, engine, methods, pending, done, key_of, model_name, peers, bar)
    finally:
        peers.close()
        bar.close()
    if mismatches:
        run.log(_color(f"MISMATCH: {mismatches} output(s) differ from plain decoding; see the report", RED))
    return run.results_path


class _Peers:
    """vLLM peer workers (and the in-process plain llama.cpp peer), started on first use (one engine each) and
    closed at the end of the run."""

    def __init__(self, run: BenchRun, engine) -> None:
        self.run, self.engine, self.live = run, engine, {}

    def get(self, method: str):
        if method == M.LLAMA_CPP and method not in self.live:  # parse_methods checked: backend llama.cpp
            from .llama_cpp_peer import peer_for

            self.run.log("starting the plain llama.cpp peer ...")
            self.live[method] = peer_for(self.engine, self.run.backend_kwargs)
        if method in M.LLAMA_SERVER_PEERS and method not in self.live:
            from .llama_server import peer_for as server_for

            self.run.log(f"starting {method} (a llama-server process on 127.0.0.1) ...")
            self.live[method] = server_for(method, self.engine, self.run.backend_kwargs)
        if method not in self.live:  # run_bench's parse_methods has checked that the backend is vllm
            from .vllm_peers import VLLMPeer

            self.run.log(f"starting vLLM peer {method} ...")
            self.live[method] = VLLMPeer(method, self.engine.backend.model_path, self.run.backend_kwargs)
        return self.live[method]

    def close(self) -> None:
        for peer in self.live.values():
            peer.close()


def method_order(methods: list[str], index: int) -> list[str]:
    """The order item ``index`` runs its methods in: plain first (the others are compared with its record), the rest
    rotated by one per item, so that no method always runs right after another (an order effect: caches, allocator,
    clock) and each takes every place equally often."""
    rest = [m for m in methods if m != M.PLAIN]
    shift = index % len(rest) if rest else 0
    return [m for m in methods if m == M.PLAIN] + rest[shift:] + rest[:shift]


def _run_pending(run: BenchRun, engine, methods, pending, done, key_of, model_name, peers: _Peers, bar) -> int:
    mismatches = 0
    for index, (suite, item, base) in enumerate(pending):
        plain_key = key_of(suite, M.PLAIN, base)
        for method in method_order(methods, index):
            key = key_of(suite, method, base)
            if (key, item["id"], method) in done:
                continue
            plain = done.get((plain_key, item["id"], M.PLAIN))
            if suite == "agent" and method in M.REPLAY and not (plain and all(
                    s.get("prompt_ids") for s in plain.get("steps") or [])):  # replays plain's steps (engine front)
                run.log(f"{item['id']}: {method} skipped (it replays plain's steps from the engine front's record)")
                continue
            if method in M.REPLAY and plain is None:
                run.log(f"{item['id']}: {method} skipped (no plain result to take its length from)")
                continue
            record = _run_one(engine, run, suite, item, method, base, key, model_name, plain, peers)
            append_record(run.results_path, record)
            if record.get("error"):
                run.log(_color(f"ERROR {item['id']} {method}: {record['error']}", RED))
                continue
            done[(key, item["id"], method)] = record
            if record.get("identical_to_plain") is False:
                mismatches += 0 if record.get("diverged_at_forced_text") or record.get("near_tie") else 1
                _shout(run, record, plain, engine)
            bar.set_postfix_str(f"{method} {record['latency_s']:.1f}s")
        bar.update(1)
    return mismatches


def _warmup(engine, item: dict[str, Any]) -> None:
    """One short untimed generation so that lazy initialisation does not land on the first timed method."""
    try:
        engine.generate(item["messages"], tools=item.get("tools"),
                        config=SSRConfig(enabled=True, max_think_tokens=4, draft_start=1, max_tokens=8))
        if item.get("tools"):
            engine.grammars()  # the tokenizer's conversion for the call grammar
    except Exception:  # noqa: BLE001 - the real runs will report it
        pass


def _run_one(engine, run: BenchRun, suite: str, item: dict[str, Any], method: str, base: SSRConfig, key: str,
             model_name: str, plain: dict[str, Any] | None, peers: _Peers | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"suite": suite, "item": item["id"], "method": method, "key": key,
                              "model": model_name, "backend": run.backend, "preset": run.preset,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if item.get("task"):
        record["task"] = item["task"]
    if item.get("category"):
        record["category"] = item["category"]
    cfg = M.method_config(method, base)
    record["config"] = (cfg or base).to_dict()
    if run.prompt_cache == "warm" and method not in M.REPLAY:
        engine.cache_salt = method  # its own earlier items' prompts only: none is timed on another's prefill
    else:
        engine.backend.release_all()  # a cold prompt cache for every method
        engine.cache_salt = None
    if hasattr(engine, "history"):  # each method copies only from its own earlier outputs
        engine.history = run.histories.setdefault(method, OutputHistory(engine.history.max_tokens))
    try:
        if method in M.REPLAY:
            peer = M.PromptLookupPeer(engine) if method == M.PROMPT_LOOKUP else peers.get(method)
            if suite == "agent":
                outcome = M.replay_agent(peer, plain)
                record["front"], record["steps"] = "replay", outcome.stats.pop("steps")
            else:
                outcome = M.run_peer(peer, engine, item, max_tokens=len(plain["token_ids"]),
                                     forced=M.forced_text(plain))
        elif suite == "agent":
            outcome = M.run_agent(engine, item, cfg, run.agent_front, run.agent_steps)
            record["front"] = run.agent_front
            record["steps"] = outcome.stats.pop("steps")
        elif method == M.BARE:
            outcome = M.run_engine(engine, item, cfg, thinking=False)
        elif item.get("tools") and importlib.util.find_spec("langchain_ssr") is not None:
            outcome = M.run_langchain_tools(engine, item, cfg)  # agents call tools through the adapter
        else:
            outcome = M.run_engine(engine, item, cfg)
    except Exception as exc:  # noqa: BLE001 - one failure must not end a long run
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc(limit=6)
        return record
    record.update({
        "latency_s": round(outcome.latency_s, 4),
        "ttfa_s": round(outcome.ttfa_s, 4) if outcome.ttfa_s is not None else None,
        "n_tokens": len(outcome.token_ids),
        "token_hash": M.token_hash(outcome.token_ids),
        "token_ids": outcome.token_ids,
        "finish_reason": outcome.finish_reason,
        "answer": outcome.answer,
        "tool_calls": outcome.tool_calls,
    })
    if method not in M.REPLAY and not getattr(engine.backend, "row_exact", True):  # rows depend on the batch
        record["near_ties"] = {str(i): [list(c) for c in v] for i, v in outcome.near_ties.items()}  # JSON keys: str
    if method in M.REPLAY:
        record["forward_passes"] = outcome.stats.get("forward_passes")
        if outcome.stats.get("prefill_s") is not None:  # the llama.cpp peer: its prompt evaluation
            record["prefill_s"] = round(outcome.stats["prefill_s"], 4)
    else:
        record.update(summarize_stats(outcome.stats))
        if run.costs:  # a projection: the passes priced with the table the policy priced with
            record["projected_steps"] = projected_steps(record, engine.costs)
    if plain is not None and method == M.BARE:  # another prompt by design: a quality reference, never identical
        record["latency_ratio"] = round(outcome.latency_s / plain["latency_s"], 4) if plain.get("latency_s") else None
    elif plain is not None and method != M.PLAIN:
        diff = first_difference(outcome.token_ids, plain["token_ids"])
        record["identical_to_plain"] = diff is None
        record["first_difference"] = diff
        if diff is not None and plain.get("near_ties") is not None:  # a backend whose rows depend on the batch
            ties = {int(i): [(int(t), m) for t, m in v] for i, v in plain["near_ties"].items()}
            agreement = compare(plain["token_ids"], ties, outcome.token_ids)
            record["near_tie"], record["near_tie_margin"] = agreement.near_tie, agreement.margin
        record["exact_method"] = method in M.EXACT
        if method in M.REPLAY:
            record["plain_forced_tokens"] = plain.get("forced_tokens")
            record["diverged_at_forced_text"] = bool(plain.get("forced_tokens")) and M.diverged_at_forced_text(
                plain["token_ids"], diff, M.forced_sequences(engine))
            # plain ended on an end-of-turn token, which a peer asked for plain's number of tokens must not stop at
            # (llama-server's ignore_eos bans it): the last token differs by construction
            record["ended_at_ignored_eos"] = diff is not None and diff == len(plain["token_ids"]) - 1 and int(
                plain["token_ids"][-1]) in set(getattr(engine.backend, "eos_token_ids", ()) or ())
        record["latency_ratio"] = round(outcome.latency_s / plain["latency_s"], 4) if plain.get("latency_s") else None
    elif method == M.PLAIN:
        record["identical_to_plain"] = True
    if suite == "agent" and method in M.REPLAY:  # plain's steps replayed: plain's tasks, where its tokens are
        record["score"] = plain["score"] if record.get("identical_to_plain") else None
        record["score_detail"] = {"steps": len(record["steps"])}
    elif suite == "agent":  # the project's tests, run by the loop at its end
        record["score"] = float(outcome.stats.get("solved", 0))
        record["score_detail"] = {"steps": len(record["steps"])}
    elif plain is not None and record.get("identical_to_plain") and method != M.PLAIN and "score" in plain:
        record["score"] = plain["score"]  # same tokens, same answer: same score
        record["score_detail"] = plain.get("score_detail")
    else:
        detail = score_item(item, outcome.answer, outcome.tool_calls)
        record["score"] = float(detail.get("score", 0.0))
        record["score_detail"] = {k: v for k, v in detail.items() if k != "score"}
    return record


def _shout(run: BenchRun, record: dict[str, Any], plain: dict[str, Any] | None, engine) -> None:
    at = record.get("first_difference")
    context = ""
    if plain is not None and at is not None:
        tok = engine.tokenizer
        lo = max(0, at - 8)
        context = (f"\n    plain : ...{tok.decode(plain['token_ids'][lo:at + 8])!r}"
                   f"\n    {record['method']:6}: ...{tok.decode(record['token_ids'][lo:at + 8])!r}")
    if record.get("near_tie"):
        run.log(_color(f"note: {record['item']} {record['method']} leaves plain at token {at}, a near-tie of plain's "
                       f"(its token {record['near_tie_margin']:.3f} below plain's, within twice the measured kernel "
                       f"noise: the backend's multi-row kernels round differently){context}", YELLOW))
    elif record.get("diverged_at_forced_text"):
        run.log(_color(f"note: {record['item']} {record['method']} leaves plain at token {at}, where plain's budget "
                       f"forcing inserted text that generate() cannot (expected){context}", YELLOW))
    elif record["method"] in M.REPLAY:
        run.log(_color(f"MISMATCH {record['item']} {record['method']} differs from plain at token {at}{context}", RED))
    else:
        run.log(_color(f"MISMATCH {record['item']} {record['method']} differs from plain at token {at} "
                       f"(must be identical){context}", RED))


def _write_meta(run: BenchRun, engine, methods: list[str], projection: CostTable | None = None) -> None:
    meta = {
        "model": getattr(engine, "model_name", run.model), "backend": run.backend, "preset": run.preset,
        "suites": run.suites, "methods": methods, "n": run.n, "overrides": run.overrides,
        "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_configs": {s: base_config(s, run.preset, **run.overrides).to_dict() for s in run.suites},
        "prompt_cache": run.prompt_cache,
    }
    if projection is not None:  # the table the policy priced with (its name and device in its meta)
        meta["projection"] = {"spec": run.costs, **projection.to_dict()}
    elif isinstance(getattr(engine, "costs", None), CostTable):  # for ``ssr_bench.policy_replay``
        meta["costs"] = engine.costs.to_dict()
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
        model = getattr(getattr(engine, "backend", None), "model", None)
        if model is not None:
            p = next(model.parameters())
            meta["dtype"], meta["device"] = str(p.dtype), str(p.device)
        elif isinstance(getattr(getattr(engine, "backend", None), "dtype", None), str):  # llama.cpp: "gguf:Q4_K_M"
            meta["dtype"], meta["device"] = engine.backend.dtype, str(getattr(engine.backend, "device", None))
    except Exception:  # noqa: BLE001
        pass
    (run.out / "meta.json").write_text(json.dumps(meta, indent=2, default=list))
