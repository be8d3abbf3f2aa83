"""The agent suite: its tasks are solvable and their tests right, its tools stay in the project and answer the same
way every run, and its loop (on a real engine over the scripted backend) solves a task with SSR giving plain
decoding's tokens at every step, a tool result written back accepted from the prompt."""

from __future__ import annotations

import json

import pytest

from scripted import scripted_engine
from shared_fixtures import tokenizer  # noqa: F401  (the default model's tokenizer, for the scripted backend)
from ssr import SSRConfig
from ssr_bench import agent, recipe_probe
from ssr_bench.report import write_report
from ssr_bench.runner import BenchRun, load_records, run_bench

TASK = agent.TASKS_BY_ID["is_even"]


@pytest.mark.parametrize("task", agent.TASKS, ids=lambda t: t.id)
def test_every_task_fails_as_shipped_and_passes_with_its_solution(task):
    with agent.Workspace(task) as ws:
        assert not ws.tests_pass()
        assert ws.run_tests().startswith("FAILED")
        ws.write_file(task.module, task.solution)
        assert ws.tests_pass() and ws.run_tests().startswith("PASSED")


def test_suite_has_a_dozen_tasks_of_each_kind():
    assert len(agent.TASKS) >= 12 and len(agent.TASKS_BY_ID) == len(agent.TASKS)
    assert {t.kind for t in agent.TASKS} == {"fix", "add", "test"}
    assert [t["function"]["name"] for t in agent.TOOLS] == ["list_files", "read_file", "write_file", "run_tests"]


def test_tools_stay_inside_the_project_and_report_bad_calls():
    with agent.Workspace(TASK) as ws:
        assert ws.list_files().split() == ["mathutils.py", "test_mathutils.py"]
        assert ws.call("read_file", {"path": "mathutils.py"}) == TASK.files["mathutils.py"]
        assert "outside the project" in ws.call("read_file", {"path": "../etc/passwd"})
        assert "outside the project" in ws.call("write_file", {"path": "/tmp/x.py", "content": ""})
        assert "no file 'nope.py'" in ws.call("read_file", {"path": "nope.py"})
        assert ws.call("delete_all", {}).startswith("error: unknown tool 'delete_all'")
        assert ws.call("read_file", {"file": "mathutils.py"}).startswith("error:")  # a wrong argument name


def test_test_output_is_the_same_every_run():
    """The loop must be deterministic: the test output names no temporary directory and no seconds taken."""
    outputs = []
    for _ in range(2):
        with agent.Workspace(TASK) as ws:
            outputs.append(ws.run_tests())
            assert str(ws.root) not in outputs[-1]
    assert outputs[0] == outputs[1]
    assert "Ran 2 tests\n" in outputs[0] and 'File "test_mathutils.py"' in outputs[0]


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# (reasoning, answer) per step: read the module, write it back fixed, run the tests
SCRIPT = [("", _call("read_file", {"path": "mathutils.py"})),
          ("The bug is the remainder test.", _call("write_file", {"path": "mathutils.py", "content": TASK.solution})),
          ("Now the tests.", _call("run_tests", {}))]


class ScriptedAgentModel:
    """The real engine over the scripted backend, its script set for each step of the loop: the step's index is
    the number of assistant turns so far; a step after a tool result thinks, the first one does not (auto mode)."""

    def __init__(self, engine, script) -> None:
        self.engine, self.script = engine, script

    def generate(self, messages, **kwargs):
        reasoning, answer = self.script[sum(m["role"] == "assistant" for m in messages)]
        self.engine.backend.set_script(reasoning, answer, thinking=messages[-1]["role"] == "tool")
        return self.engine.generate(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture
def agent_model(tokenizer):
    return ScriptedAgentModel(scripted_engine(tokenizer, reuse_prefix=True), SCRIPT)


CONFIG = dict(max_think_tokens=32, draft_start=2, max_tokens=200, temperature=0.0)


def test_loop_solves_the_task_and_ssr_gives_plain_tokens_at_every_step(agent_model):
    plain = agent.run_engine_loop(agent_model, TASK, SSRConfig(enabled=False, **CONFIG))
    agent_model.backend.release_all()
    ssr = agent.run_engine_loop(agent_model, TASK, SSRConfig(**CONFIG))
    for run in (plain, ssr):
        assert run.solved
        assert [[c["name"] for c in s.tool_calls] for s in run.steps] == [["read_file"], ["write_file"], ["run_tests"]]
        assert run.steps[0].tool_results == [TASK.files["mathutils.py"]]
        assert run.steps[2].tool_results[0].startswith("PASSED")
    assert [s.token_ids for s in ssr.steps] == [s.token_ids for s in plain.steps]
    write = ssr.steps[1].stats
    # the file read one step before, written back in a JSON string: its escaped view proposes past the newlines
    assert write["accepted_by_source"].get("prompt-json", 0) > 0
    assert sum(s.stats["forward_passes"] for s in ssr.steps) < sum(s.stats["forward_passes"] for s in plain.steps)
    assert ssr.steps[2].stats["reused_prompt_tokens"] > ssr.steps[1].stats["prompt_tokens"] // 2  # the cache
    totals = agent.aggregate_stats(ssr.steps)
    assert totals["forward_passes"] == sum(s.stats["forward_passes"] for s in ssr.steps)
    assert sum(totals["pass_shapes"].values()) == totals["forward_passes"]  # what a projection prices
    assert totals["speculation"]["answer"]["accepted"] == sum(s.stats["speculation"]["answer"]["accepted"]
                                                             for s in ssr.steps) > 0
    assert totals["drafts"] == sum(len(s.stats["drafts"]) for s in ssr.steps)


ADD = agent.TASKS_BY_ID["add"]
# the fixed module, with a docstring and quotes, written back in a fenced JSON call (the form that broke the fronts'
# loops when only tagged calls were constrained), then the tests in a tagged call, then a final answer
FIXED = 'def add(a, b):\n    """Return the sum of "a" and \'b\'."""\n    return a + b\n'
FENCED_TURNS = [("", "I will write the fix.\n```json\n" + json.dumps(
                    {"name": "write_file", "arguments": {"path": "calc.py", "content": FIXED}}) + "\n```"),
                ("The file is written; now the tests.", _call("run_tests", {})),
                ("The tests pass.", "Fixed: add returns a + b and the tests pass.")]


@pytest.mark.parametrize("front", agent.FRONTS)
def test_each_front_runs_a_fenced_call_and_each_step_prefills_only_its_new_messages(tokenizer, front):  # noqa: F811
    """Through the engine loop, LangChain's ``create_agent`` and a LlamaIndex ``FunctionAgent``: the model's
    fenced ``write_file`` call (a docstring and quotes in its content) parses under the call grammar, runs, and
    fixes the project; every step after the first reuses the previous step's cache: from the third on it prefills
    no more than the prompt grew since (+32); the second, the first after a tool result, also prefills the user's
    message again, which the instruct recipe's tool-result demonstration, put in before the conversation, moved
    (``ssr.chat``); SSR gives plain decoding's tokens at every step."""
    runs = {}
    for enabled in (False, True):
        engine = scripted_engine(tokenizer, reuse_prefix=True)
        engine.backend.turns = FENCED_TURNS
        runs[enabled] = agent.LOOPS[front](engine, ADD, SSRConfig(enabled=enabled, **CONFIG))
    plain, ssr = runs[False], runs[True]
    # every front renders the engine loop's tools (the same schemas) into the same first prompt
    first = engine.encode([{"role": "user", "content": ADD.prompt()}], tools=agent.TOOLS)
    for run in (plain, ssr):
        assert run.steps[0].prompt_ids == first
        assert run.solved, agent.describe(run)
        assert [[c["name"] for c in s.tool_calls] for s in run.steps][:2] == [["write_file"], ["run_tests"]]
        assert run.steps[0].tool_calls[0]["arguments"] == {"path": "calc.py", "content": FIXED}
        assert not any(s.invalid for s in run.steps)
        summaries = [agent.step_summary(s) for s in run.steps]
        accounting = agent.prefill_accounting(summaries)
        assert len(accounting) == len(run.steps) - 1 >= 1
        # the first step after a tool result puts the demonstration before the conversation: the user's message
        # moves, and is prefilled again (the demonstration itself is prompt growth)
        user_turn = len(tokenizer.encode(f"<|im_start|>user\n{ADD.prompt()}<|im_end|>\n", add_special_tokens=False))
        for i, (step, counts) in enumerate(zip(summaries[1:], accounting)):
            allowance = 32 + (user_turn if i == 0 else 0)
            assert step["reused_prompt_tokens"] > 0 and counts["prefilled"] <= counts["added"] + allowance, (i, counts)
    assert [s.token_ids for s in ssr.steps] == [s.token_ids for s in plain.steps]


def test_step_limit_ends_a_loop_that_never_finishes(agent_model):
    agent_model.script = [("", _call("list_files", {}))] + [("Again.", _call("list_files", {}))] * 3
    run = agent.run_engine_loop(agent_model, TASK, SSRConfig(enabled=False, **CONFIG), max_steps=3)
    assert len(run.steps) == 3 and not run.solved


def test_invalid_call_is_told_to_the_model_and_the_loop_goes_on(agent_model):
    agent_model.script = [("", "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \n</tool_call>"),
                          ("", _call("read_file", {"path": "mathutils.py"})),
                          ("Done.", "I read it.")]
    run = agent.run_engine_loop(agent_model, TASK, SSRConfig(enabled=False, **CONFIG))
    assert run.steps[0].invalid and not run.steps[0].tool_calls
    assert [c["name"] for c in run.steps[1].tool_calls] == ["read_file"]
    assert run.steps[-1].answer == "I read it." and len(run.steps) == 3 and not run.solved


def test_runner_records_every_step_and_the_report_has_the_agent_section(agent_model, tmp_path):
    run = BenchRun(suites=["agent"], methods=["plain", "ssr"], out=tmp_path, n=1, progress=False,
                   warmup=False, overrides=dict(max_think_tokens=32, draft_start=2, max_tokens=200), log=lambda s: None)
    run_bench(run, engine=agent_model)
    records = {r["method"]: r for r in load_records(tmp_path / "results.jsonl")}
    assert set(records) == {"plain", "ssr"}
    assert records["plain"]["score"] == records["ssr"]["score"] == 1.0
    assert records["ssr"]["identical_to_plain"] is True and records["ssr"]["front"] == "engine"
    assert [s["tools"] for s in records["ssr"]["steps"]] == [["read_file"], ["write_file"], ["run_tests"]]
    assert records["ssr"]["n_tokens"] == sum(s["n_tokens"] for s in records["ssr"]["steps"])
    report = write_report(tmp_path / "results.jsonl").read_text()
    assert "## agent suite (front: engine)" in report and "| ssr | 1/1 | 3 |" in report
    assert (tmp_path / "agent_step_latency.png").stat().st_size and (tmp_path / "agent_accepted_by_source.png").exists()


class StepPeer:
    """Stands in for a peer with its own decoding loop (vLLM, llama.cpp) to test the harness's replay bookkeeping
    alone: it answers a prompt with the tokens ``answers`` holds for it and keeps the prompts it was given."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong_from: int | None = None) -> None:
        self.answers, self.wrong_from, self.prompts = answers, wrong_from, []

    def generate(self, prompt_ids, max_tokens):
        self.prompts.append(list(prompt_ids))
        out = list(self.answers[tuple(prompt_ids)])[:max_tokens]
        if self.wrong_from is not None and len(self.prompts) > self.wrong_from:
            out = out[:-1] + [out[-1] + 1]  # a different last token
        return {"token_ids": out, "seconds": 0.01, "steps": len(out)}


@pytest.mark.parametrize("wrong_from", [None, 1])
def test_a_peer_with_its_own_loop_replays_plains_steps(agent_model, tmp_path, monkeypatch, wrong_from):
    """Replay peers get plain's step prompts (the ids the engine decoded from) and plain's lengths; the task counts
    as solved only where the peer's tokens are plain's."""
    from ssr_bench import methods as M

    run = BenchRun(suites=["agent"], methods=["plain"], out=tmp_path, n=1, progress=False, warmup=False,
                   overrides=dict(max_think_tokens=32, draft_start=2, max_tokens=200), log=lambda s: None)
    run_bench(run, engine=agent_model)
    plain = load_records(tmp_path / "results.jsonl")[0]
    ids, answers, at = plain["token_ids"], {}, 0
    for step in plain["steps"]:
        answers[tuple(step["prompt_ids"])] = ids[at:at + step["n_tokens"]]
        at += step["n_tokens"]
    peer = StepPeer(answers, wrong_from)
    monkeypatch.setattr(M, "PromptLookupPeer", lambda engine: peer)
    run_bench(BenchRun(**{**run.__dict__, "methods": ["plain", "prompt-lookup"]}), engine=agent_model)
    replay = {r["method"]: r for r in load_records(tmp_path / "results.jsonl")}["prompt-lookup"]
    assert peer.prompts == [s["prompt_ids"] for s in plain["steps"]] and len(peer.prompts) == 3
    assert peer.prompts[0] == agent_model.encode([{"role": "user", "content": TASK.prompt()}], tools=agent.TOOLS)
    assert replay["front"] == "replay" and [s["n_tokens"] for s in replay["steps"]] == \
        [s["n_tokens"] for s in plain["steps"]]
    assert replay["identical_to_plain"] is (wrong_from is None)
    assert replay["score"] == (1.0 if wrong_from is None else None)
    report = write_report(tmp_path / "results.jsonl").read_text()
    assert ("| prompt-lookup | 1/1 | 3 |" if wrong_from is None else "| prompt-lookup | - | 3 |") in report


def test_near_ties_of_a_loop_sit_at_their_place_in_its_tokens():
    """A loop's near-ties (a backend whose rows depend on the batch) are each step's, moved to the step's place in
    the loop's token ids, so the first difference from plain's tokens is classified where it happened."""
    steps = [agent.Step([1, 2, 3], 0.0, {}, [], [], "", near_ties={1: [(7, 0.1)]}),
             agent.Step([4, 5], 0.0, {}, [], [], "", near_ties={0: [(8, 0.2)], 1: [(9, 0.3)]})]
    outcome = agent.AgentOutcome("t", False, steps, 0.0)
    assert outcome.near_ties == {1: [(7, 0.1)], 3: [(8, 0.2)], 4: [(9, 0.3)]}
    assert outcome.token_ids == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("variant", sorted(recipe_probe.DEMONSTRATIONS))
def test_recipe_probe_demonstrations_render_after_a_tool_result(tokenizer, variant):
    """Each demonstration the probe measures goes where the shipped one goes: after the template's system block,
    before the conversation, only once a tool result is in (the decision turn is the model's own template)."""
    from ssr.chat import QWEN2_INSTRUCT, encode_prompt

    family = recipe_probe.with_demonstration(QWEN2_INSTRUCT, variant)
    task = agent.TASKS[0]
    first = [{"role": "user", "content": task.prompt()}]
    after = first + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": task.module}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": task.files[task.module]}]
    decision = tokenizer.decode(encode_prompt(tokenizer, family, first, tools=agent.TOOLS))
    step = tokenizer.decode(encode_prompt(tokenizer, family, after, tools=agent.TOOLS))
    demo_user = recipe_probe.DEMONSTRATIONS[variant][0]["content"]
    assert demo_user not in decision
    assert step.count(demo_user) == 1
    assert step.index(demo_user) < step.index(task.prompt()) < step.index(task.files[task.module])
    system_block = decision[:decision.index("<|im_start|>user")]
    assert step.startswith(system_block) and step.endswith(family.think_prefill)


def test_recipe_probe_note_variant_is_append_only(tokenizer):
    """The probe's "note" variant: no demonstration, a system note after each tool result; the prompt of a step
    extends the previous step's (less the thinking it prefilled) token for token, the note in it once per result."""
    from ssr.chat import QWEN2_INSTRUCT, TOOL_RESULT_DEMONSTRATION

    class Rendered:  # the wrapper's engine: only its tokenizer and family are read before generate
        family = QWEN2_INSTRUCT

        def __init__(self) -> None:
            self.tokenizer = tokenizer

        def generate(self, prompt, **kwargs):
            return prompt

    note = recipe_probe._NoteAfterResults(Rendered())
    task = agent.TASKS[0]

    def call(i, name, arguments):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}]}

    step2 = [{"role": "user", "content": task.prompt()}, call(1, "read_file", {"path": task.module}),
             {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": task.files[task.module]}]
    step3 = step2 + [call(2, "run_tests", {}), {"role": "tool", "tool_call_id": "c2", "name": "run_tests",
                                                 "content": "PASSED"}]
    first, second = (note.generate(m, tools=agent.TOOLS) for m in (step2, step3))
    prefill = tokenizer.encode(QWEN2_INSTRUCT.think_prefill, add_special_tokens=False)
    assert first[-len(prefill):] == prefill and second[:len(first) - len(prefill)] == first[:-len(prefill)]
    assert tokenizer.decode(second).count(recipe_probe.AFTER_RESULT_NOTE) == 2
    assert TOOL_RESULT_DEMONSTRATION[0]["content"] not in tokenizer.decode(second)  # no demonstration
