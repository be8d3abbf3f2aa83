"""The agent suite on the real default model, through each front (the engine's loop, LangChain's create_agent with
ChatSSR, a LlamaIndex FunctionAgent with the SSR LLM): SSR gives plain decoding's tokens at every step; and the
coding-agent example runs one task of the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from shared_fixtures import default_engine  # noqa: F401  (the loaded default model, shared by the session)
from ssr import SSRConfig
from ssr_bench import agent

pytestmark = pytest.mark.real_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "coding_agent.py"
BUDGETS = dict(max_think_tokens=24, draft_start=4, max_tokens=64, temperature=0.0)  # short steps: a CI budget


@pytest.mark.parametrize("front", agent.FRONTS)
def test_every_step_of_the_loop_is_plain_decodings(default_engine, front):  # noqa: F811
    task = agent.TASKS_BY_ID["add"]
    runs = []
    for enabled in (False, True):
        default_engine.backend.release_all()
        runs.append(agent.LOOPS[front](default_engine, task, SSRConfig(enabled=enabled, **BUDGETS), 2))
    plain, ssr = runs
    assert plain.steps and all(s.token_ids for s in plain.steps)  # the front carries each step's token ids
    assert [s.token_ids for s in ssr.steps] == [s.token_ids for s in plain.steps]
    assert [[c["name"] for c in s.tool_calls] for s in ssr.steps] == [[c["name"] for c in s.tool_calls]
                                                                       for s in plain.steps]
    assert plain.solved == ssr.solved
    passes = [sum(s.stats["forward_passes"] for s in run.steps) for run in runs]
    assert passes[1] <= passes[0]


def test_coding_agent_example_runs_a_task_of_the_suite(capsys):
    spec = importlib.util.spec_from_file_location("coding_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "2", "--task", "is_even", "--model", "default", "--backend", "transformers"]) == 0
    out = capsys.readouterr().out  # LangChain's create_agent is the example's default front
    assert out.startswith("task is_even: The project has the files mathutils.py, test_mathutils.py.")
    assert "\n  1: " in out and "forward passes where plain decoding runs" in out
    assert "  step 1: prompt " in out and " prefilled" in out
