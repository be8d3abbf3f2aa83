"""``ssr bench --backend vllm``: SSR and vLLM's own decoding loops (plain, ngram, suffix) side by side in one run."""

from __future__ import annotations

import importlib.util

import pytest
from tiny_model import vllm_installed

if not vllm_installed():  # tests/vllm itself would import as a namespace package "vllm": look for the real one
    pytest.skip("vllm is not installed (install it into a separate venv: .ci/install_vllm.sh)", allow_module_level=True)

from conftest import ENGINE_ARGS  # noqa: E402

from ssr_bench import methods as M  # noqa: E402
from ssr_bench import report, runner  # noqa: E402

pytestmark = pytest.mark.vllm

PEERS = ["vllm", "vllm-ngram"] + (["vllm-suffix"] if importlib.util.find_spec("arctic_inference") else [])
METHODS = ["plain", "suffix", "ssr"] + PEERS
QUESTIONS = ["Write a function that adds two numbers.", "Repeat after me: abc abc abc abc abc abc."]


@pytest.fixture(scope="module")
def records(tmp_path_factory, vllm_engine):
    """One run of both suites, so that each vLLM peer's worker starts once (its start-up is most of what a peer costs
    here): two HumanEval-like questions (the tiny model's answers are noise: not scored) and the agent suite's first
    task."""
    items = [{"id": f"q/{i}", "suite": "humaneval", "messages": [{"role": "user", "content": q}], "tools": None}
             for i, q in enumerate(QUESTIONS)]
    load_suite, score_item = runner.load_suite, runner.score_item
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "load_suite", lambda name, n=None, data_dir=None:
                      items if name == "humaneval" else load_suite(name, n=1, data_dir=data_dir))
        patch.setattr(runner, "score_item", lambda item, answer, calls=None:
                      {"score": 0.0} if item["suite"] == "humaneval" else score_item(item, answer, calls))
        run = runner.BenchRun(suites=["humaneval", "agent"], methods=METHODS, out=tmp_path_factory.mktemp("bench"),
                              backend="vllm", overrides={"max_think_tokens": 12, "min_think_tokens": 0,
                                                         "draft_start": 2, "max_tokens": 40},
                              backend_kwargs=dict(ENGINE_ARGS), progress=False, warmup=False, log=lambda s: None)
        path = runner.run_bench(run, engine=vllm_engine)
    recs = runner.load_records(path)
    assert not [r for r in recs if r.get("error")], [r.get("traceback") or r.get("error") for r in recs]
    return path, recs


def test_vllm_peers_side_by_side(records):
    path, recs = records
    recs = [r for r in recs if r["suite"] == "humaneval"]
    assert [(r["item"], r["method"]) for r in recs] == [  # interleaved per item, the order after plain rotating
        (f"q/{i}", m) for i in range(2) for m in runner.method_order(METHODS, i)]
    plain = {r["item"]: r for r in recs if r["method"] == "plain"}
    for r in recs:
        if r["method"] in ("suffix", "ssr"):
            assert r["identical_to_plain"], (r["item"], r["method"], r["first_difference"])
        if r["method"] in M.VLLM_PEERS:
            p = plain[r["item"]]
            assert r["n_tokens"] == p["n_tokens"]  # the same amount of work
            # vLLM's own greedy loop equals the engine's plain decoding up to the engine's forced text (if any)
            assert r["identical_to_plain"] or (r["diverged_at_forced_text"] and r["first_difference"] > 0), r
            # forward passes counted inside the worker: one per token for plain vLLM, fewer with speculation
            if r["method"] == "vllm":
                assert r["forward_passes"] == r["n_tokens"]
            else:
                assert 0 < r["forward_passes"] <= r["n_tokens"]
    md = report.write_report(path).read_text()
    assert all(f"| {m} |" in md for m in PEERS)


def test_agent_suite_on_vllm_with_its_peers(records):
    """The agent suite on the vLLM backend: SSR's loops run the task's tools; vLLM's loops replay plain decoding's
    steps (each step's prompt ids and token count), so each step of every method is one record's step."""
    by_method = {r["method"]: r for r in records[1] if r["suite"] == "agent"}
    assert set(by_method) == set(METHODS)
    plain = by_method["plain"]
    assert plain["steps"] and plain["front"] == "engine"
    for name in ("suffix", "ssr"):
        assert by_method[name]["identical_to_plain"], (name, by_method[name]["first_difference"])
    for name in PEERS:
        r = by_method[name]
        assert r["front"] == "replay" and len(r["steps"]) == len(plain["steps"])
        assert [s["prompt_tokens"] for s in r["steps"]] == [s["prompt_tokens"] for s in plain["steps"]]
        assert r["n_tokens"] == plain["n_tokens"]
