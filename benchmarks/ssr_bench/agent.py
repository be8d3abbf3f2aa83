"""The agent suite: small coding tasks run end to end as tool loops (read, write, run the tests) until the project's
tests pass or a step limit.

Each task is a temporary project with a bug to fix, a function to add or a failing test to make pass, and its own
unittest tests. The loop is what an agent framework runs: the conversation grows by one assistant turn (tool calls,
tool_choice "auto") and its tool results per step, and the engine's prompt cache carries the conversation from step to
step. Greedy decoding makes the loop deterministic, so every exact method must give plain decoding's tokens at
every step. A task is solved when the project's tests pass at the end, run by the harness in its sandbox.

Front ends, the same tasks and tools: ``engine`` (``SSREngine.generate`` per step), ``langchain`` (``ChatSSR`` in
``langchain.agents.create_agent``) and ``llamaindex`` (the ``SSR`` LLM in a LlamaIndex ``FunctionAgent``).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .scoring import run_sandboxed

MAX_STEPS = 8


@dataclass(frozen=True)
class Task:
    """One coding task: its files (the module and its tests) and what the user asks."""

    id: str
    kind: str  # "fix" a bug, "add" a function, make a failing "test" pass
    module: str
    files: dict[str, str]
    ask: str
    solution: str  # a fixed module that passes the tests: the task is solvable, its tests are right

    def prompt(self) -> str:
        names = ", ".join(sorted(self.files))
        return (f"The project has the files {names}. {self.ask} Use the tools: read {self.module}, write the whole "
                f"corrected {self.module} with write_file (path and full content), then run the tests.")


def _tests(module: str, imports: str, cases: list[str]) -> str:
    body = "".join(f"    def test_{i}(self):\n        {case}\n\n" for i, case in enumerate(cases))
    return (f"import unittest\n\nfrom {module} import {imports}\n\n\nclass Test(unittest.TestCase):\n{body}\n"
            'if __name__ == "__main__":\n    unittest.main()\n')


def _task(id: str, kind: str, module: str, source: str, imports: str, cases: list[str], ask: str,
          fix: tuple[str, str]) -> Task:
    """``fix``: (text, replacement) that turns ``source`` into a solution."""
    assert fix[0] in source, id
    return Task(id, kind, f"{module}.py", {f"{module}.py": source, f"test_{module}.py": _tests(module, imports, cases)},
                ask, source.replace(*fix))


TASKS: tuple[Task, ...] = (
    _task("is_even", "fix", "mathutils",
          'def is_even(n):\n    """Return True when n is even."""\n    return n % 2 == 1\n',
          "is_even", ["self.assertTrue(is_even(4))", "self.assertFalse(is_even(7))"],
          "The function is_even in mathutils.py returns the wrong result, so the tests fail.",
          fix=('== 1', '== 0')),
    _task("add", "fix", "calc", 'def add(a, b):\n    """Return the sum of a and b."""\n    return a - b\n', "add",
          ["self.assertEqual(add(2, 3), 5)", "self.assertEqual(add(-1, 1), 0)"],
          "The function add in calc.py does not add, so the tests fail.",
          fix=('a - b', 'a + b')),
    _task("largest", "fix", "lists",
          'def largest(values):\n    """Return the largest value of a non-empty list."""\n    return min(values)\n',
          "largest", ["self.assertEqual(largest([3, 9, 2]), 9)", "self.assertEqual(largest([-5, -2]), -2)"],
          "The function largest in lists.py returns the wrong element, so the tests fail.",
          fix=('min(', 'max(')),
    _task("reverse", "fix", "text", 'def reverse(s):\n    """Return s reversed."""\n    return s\n', "reverse",
          ["self.assertEqual(reverse('abc'), 'cba')", "self.assertEqual(reverse(''), '')"],
          "The function reverse in text.py does not reverse its argument, so the tests fail.",
          fix=('return s\n', 'return s[::-1]\n')),
    _task("factorial", "fix", "numbers",
          'def factorial(n):\n    """Return n! for n >= 0."""\n    result = 1\n    for i in range(1, n):\n'
          "        result *= i\n    return result\n",
          "factorial", ["self.assertEqual(factorial(5), 120)", "self.assertEqual(factorial(0), 1)"],
          "The function factorial in numbers.py has an off-by-one error in its loop, so the tests fail.",
          fix=('range(1, n)', 'range(1, n + 1)')),
    _task("vowels", "fix", "letters",
          'def count_vowels(s):\n    """Return how many of the letters of s are vowels (a, e, i, o, u)."""\n'
          '    return sum(1 for c in s.lower() if c in "aeio")\n',
          "count_vowels", ["self.assertEqual(count_vowels('Ubuntu'), 3)", "self.assertEqual(count_vowels('xyz'), 0)"],
          "The function count_vowels in letters.py misses a vowel, so the tests fail.",
          fix=('"aeio"', '"aeiou"')),
    _task("palindrome", "fix", "words",
          'def is_palindrome(s):\n    """Return True when s reads the same backwards, ignoring case."""\n'
          "    return s == s[::-1]\n",
          "is_palindrome", ["self.assertTrue(is_palindrome('Racecar'))", "self.assertFalse(is_palindrome('abc'))"],
          "The function is_palindrome in words.py does not ignore case, so the tests fail.",
          fix=('return s == s[::-1]', 'return s.lower() == s.lower()[::-1]')),
    _task("average", "fix", "stats",
          'def average(values):\n    """Return the mean of values, or 0 for an empty list."""\n'
          "    return sum(values) / len(values)\n",
          "average", ["self.assertEqual(average([2, 4]), 3)", "self.assertEqual(average([]), 0)"],
          "The function average in stats.py fails on an empty list, so the tests fail.",
          fix=('return sum(values) / len(values)', 'return sum(values) / len(values) if values else 0')),
    _task("square", "add", "geometry", 'def double(x):\n    """Return 2 * x."""\n    return 2 * x\n',
          "double, square", ["self.assertEqual(double(3), 6)", "self.assertEqual(square(4), 16)"],
          "Add a function square(x) that returns x * x to geometry.py, keeping double; the tests import both.",
          fix=('return 2 * x\n', 'return 2 * x\n\n\ndef square(x):\n    return x * x\n')),
    _task("fahrenheit", "add", "units",
          'def celsius(f):\n    """Convert Fahrenheit to Celsius."""\n    return (f - 32) * 5 / 9\n',
          "celsius, fahrenheit", ["self.assertEqual(celsius(212), 100)", "self.assertEqual(fahrenheit(100), 212)"],
          "Add a function fahrenheit(c) that converts Celsius to Fahrenheit to units.py, keeping celsius; the tests "
          "import both.",
          fix=("return (f - 32) * 5 / 9\n",
               "return (f - 32) * 5 / 9\n\n\ndef fahrenheit(c):\n    return c * 9 / 5 + 32\n")),
    _task("clamp", "test", "bounds",
          'def clamp(x, lo, hi):\n    """Return x limited to the range [lo, hi]."""\n'
          "    if x < lo:\n        return lo\n    return x\n",
          "clamp", ["self.assertEqual(clamp(5, 0, 3), 3)", "self.assertEqual(clamp(-1, 0, 3), 0)",
                    "self.assertEqual(clamp(2, 0, 3), 2)"],
          "The test test_0 in test_bounds.py fails: clamp in bounds.py ignores the upper bound. Make the tests pass.",
          fix=('    return x\n', '    return min(x, hi)\n')),
    _task("greet", "test", "hello",
          'def greet(name):\n    """Return a greeting for name."""\n    return "Hello " + name\n',
          "greet", ["self.assertEqual(greet('Ada'), 'Hello, Ada!')"],
          "The test in test_hello.py expects greet('Ada') to return 'Hello, Ada!'. Make it pass.",
          fix=('"Hello " + name', '"Hello, " + name + "!"')),
)
TASKS_BY_ID = {t.id: t for t in TASKS}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "list_files", "description": "List the files of the project.",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the project and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "file name"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file of the project with the given content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "file name"},
                                                        "content": {"type": "string", "description": "the whole "
                                                                    "new text of the file"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the project's unit tests and return "
                                      "their output.", "parameters": {"type": "object", "properties": {}}}},
]


def suite_items(n: int | None = None) -> list[dict[str, Any]]:
    """The suite as harness items (the runner runs each as a loop, not as one generation)."""
    tasks = TASKS[:n] if n else TASKS
    return [{"id": f"agent/{t.id}", "suite": "agent", "task": t.id, "category": t.kind,
             "messages": [{"role": "user", "content": t.prompt()}], "tools": TOOLS} for t in tasks]


# ---------------------------------------------------------------------------------------------------- the project


class Workspace:
    """A task's project in a temporary directory, and the tools that act on it (paths stay inside it)."""

    def __init__(self, task: Task) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"ssr-agent-{task.id}-")
        self.root = Path(self._tmp.name)
        for name, text in task.files.items():
            (self.root / name).write_text(text)

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _inside(self, path: str) -> Path:
        target = (self.root / str(path)).resolve()
        if self.root.resolve() not in target.parents:
            raise ValueError(f"{path!r} is outside the project")
        return target

    def list_files(self) -> str:
        return "\n".join(sorted(p.name for p in self.root.iterdir() if p.is_file()))

    def read_file(self, path: str) -> str:
        target = self._inside(path)
        if not target.is_file():
            raise ValueError(f"no file {path!r}; the files are: {', '.join(self.list_files().split())}")
        return target.read_text()

    def write_file(self, path: str, content: str) -> str:
        self._inside(path).write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def test_result(self) -> dict[str, Any]:
        return run_sandboxed([sys.executable, "-B", "-m", "unittest", "-q"], cwd=str(self.root), timeout=30)

    def run_tests(self) -> str:
        res = self.test_result()
        if res["timed_out"]:
            return "FAILED\nthe tests timed out after 30 s"
        return ("PASSED\n" if res["returncode"] == 0 else "FAILED\n") + self._stable(res["stderr"] or "")[-1200:]

    def _stable(self, output: str) -> str:
        """The test output without what changes from run to run (the temporary directory, the seconds taken): the
        loop must be deterministic for its methods to be compared token for token."""
        output = output.replace(str(self.root.resolve()) + "/", "").replace(str(self.root) + "/", "")
        return re.sub(r"(Ran \d+ tests?) in [\d.]+s", r"\1", output)

    def tests_pass(self) -> bool:
        res = self.test_result()
        return not res["timed_out"] and res["returncode"] == 0

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """A tool's result as the model sees it; a bad call gets the error as its result, as agents do."""
        tools: dict[str, Callable[..., str]] = {"list_files": self.list_files, "read_file": self.read_file,
                                                "write_file": self.write_file, "run_tests": self.run_tests}
        if name not in tools:
            return f"error: unknown tool {name!r}; the tools are {', '.join(tools)}"
        try:
            return tools[name](**arguments)
        except (TypeError, ValueError, OSError) as exc:
            return f"error: {exc}"


# ---------------------------------------------------------------------------------------------------- the loop


@dataclass
class Step:
    """One assistant turn of the loop: what it generated, what it cost, and what the tools answered."""

    token_ids: list[int]
    latency_s: float
    stats: dict[str, Any]
    tool_calls: list[dict[str, Any]]
    tool_results: list[str]
    answer: str
    invalid: list[str] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # what the engine decoded from (replay peers start here)
    # a backend whose rows depend on the batch: positions in ``token_ids`` decided within the kernel noise
    # (``GenerationResult.near_ties``), so a method that leaves plain's tokens there is told apart from a broken one
    near_ties: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass
class AgentOutcome:
    task: str
    solved: bool
    steps: list[Step]
    latency_s: float

    @property
    def token_ids(self) -> list[int]:
        """Every step's tokens, in order (what the exact methods must reproduce)."""
        return [t for s in self.steps for t in s.token_ids]

    @property
    def near_ties(self) -> dict[int, list[tuple[int, float]]]:
        """Every step's near-ties, at their positions in ``token_ids``."""
        out, offset = {}, 0
        for step in self.steps:
            out.update({offset + int(i): [(int(t), float(m)) for t, m in ties] for i, ties in step.near_ties.items()})
            offset += len(step.token_ids)
        return out


def _assistant_turn(answer: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": answer if not calls else ""}
    if calls:
        turn["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return turn


def run_engine_loop(engine, task: Task, config, max_steps: int = MAX_STEPS) -> AgentOutcome:
    """The loop on ``SSREngine.generate``: one generation per step, the tools run by the harness."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt()}]
    steps: list[Step] = []
    t_start = time.perf_counter()
    with Workspace(task) as ws:
        for _ in range(max_steps):
            t0 = time.perf_counter()
            result = engine.generate(messages, tools=TOOLS, config=config)
            latency = time.perf_counter() - t0
            calls = list(result.tool_calls)
            invalid = [c.get("error") or "invalid call" for c in result.invalid_tool_calls]
            messages.append(_assistant_turn(result.answer, calls))
            outputs = []
            for call in calls:
                out = ws.call(call["name"], call["arguments"])
                outputs.append(out)
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": out})
            steps.append(Step(list(result.token_ids), latency, dict(result.stats), calls, outputs, result.answer,
                              invalid, list(result.prompt_token_ids), dict(result.near_ties)))
            if not calls and not invalid:
                break  # the model answered: the loop ends, as an agent framework's does
            if invalid and not calls:  # tell the model what was wrong, as agents do
                messages.append({"role": "user", "content": f"That was not a valid tool call: {'; '.join(invalid)}. "
                                 "Call one tool with valid JSON arguments."})
            if any(c["name"] == "run_tests" and o.startswith("PASSED") for c, o in zip(calls, outputs)):
                break
        solved = ws.tests_pass()
    return AgentOutcome(task.id, solved, steps, time.perf_counter() - t_start)


def _framework_tools(ws: Workspace) -> list[tuple[str, str, Callable[..., str], dict[str, Any]]]:
    """(name, description, typed function, parameters' JSON schema) per tool. Each front is given the engine loop's
    own schemas (``TOOLS``, parameter descriptions included), so that every front renders the same tools into the
    prompt and constrains the same call grammar: a schema a framework derived from the signature alone (no
    descriptions; LlamaIndex adds titles) changed the 1.5B model's choices through LangChain on transformers, where
    the same prompt gives the same tokens."""
    def list_files() -> str:
        return ws.call("list_files", {})

    def read_file(path: str) -> str:
        return ws.call("read_file", {"path": path})

    def write_file(path: str, content: str) -> str:
        return ws.call("write_file", {"path": path, "content": content})

    def run_tests() -> str:
        return ws.call("run_tests", {})

    fns = {f.__name__: f for f in (list_files, read_file, write_file, run_tests)}
    return [(fn["name"], fn["description"], fns[fn["name"]], fn["parameters"]) for fn in (t["function"] for t in TOOLS)]


def _llamaindex_schema(name: str, parameters: dict[str, Any]) -> type:
    """A pydantic model for LlamaIndex's ``fn_schema`` (the suite's parameters are all strings) whose JSON schema is
    ``parameters`` exactly: pydantic's own would give each field a title and no description."""
    from pydantic import create_model

    model = create_model(f"{name}_args", **{key: (str, ...) for key in parameters.get("properties", {})})
    model.model_json_schema = classmethod(lambda cls, *args, **kwargs: json.loads(json.dumps(parameters)))
    return model


def run_langchain_loop(engine, task: Task, config, max_steps: int = MAX_STEPS) -> AgentOutcome:
    """The loop as LangChain runs it: ``ChatSSR`` in ``langchain.agents.create_agent`` until the model answers
    without a call (or the step limit); per step the AI message's token ids and SSR stats, timed by a callback."""
    from langchain.agents import create_agent
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import StructuredTool
    from langchain_ssr import ChatSSR
    from langgraph.errors import GraphRecursionError

    class Timer(BaseCallbackHandler):
        def __init__(self) -> None:
            self.start, self.seconds = 0.0, []

        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_llm_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    timer = Timer()
    t_start = time.perf_counter()
    with Workspace(task) as ws:
        tools = [StructuredTool.from_function(fn, name=name, description=desc, args_schema=parameters)
                 for name, desc, fn, parameters in _framework_tools(ws)]
        agent = create_agent(ChatSSR(engine=engine, ssr_config=config), tools=tools)
        state: dict[str, Any] = {"messages": []}
        try:  # the state after each node: on the step limit the last one is kept
            for values in agent.stream({"messages": [("user", task.prompt())]},
                                       {"recursion_limit": 2 * max_steps, "callbacks": [timer]}, stream_mode="values"):
                state = values
        except GraphRecursionError:
            pass  # the step limit: the task is scored as it stands
        solved = ws.tests_pass()
    messages = state["messages"]
    results = {r.tool_call_id: str(r.content) for r in messages if isinstance(r, ToolMessage)}
    steps = []
    for i, m in enumerate(m for m in messages if isinstance(m, AIMessage)):
        calls = [{"id": c["id"], "name": c["name"], "arguments": c["args"]} for c in m.tool_calls]
        steps.append(Step(list(m.response_metadata.get("token_ids", [])),
                          timer.seconds[i] if i < len(timer.seconds) else 0.0, dict(m.response_metadata.get("ssr", {})),
                          calls, [results.get(c["id"], "") for c in calls], str(m.content),
                          [c.get("error") or "invalid call" for c in m.invalid_tool_calls],
                          list(m.response_metadata.get("prompt_token_ids", [])),
                          dict(m.response_metadata.get("near_ties") or {})))
    return AgentOutcome(task.id, solved, steps, time.perf_counter() - t_start)


def run_llamaindex_loop(engine, task: Task, config, max_steps: int = MAX_STEPS) -> AgentOutcome:
    """The loop as LlamaIndex runs it: the ``SSR`` LLM in a ``FunctionAgent`` (its own step limit,
    ``max_iterations``); per step the agent's output event, timed from the agent's input event."""
    import asyncio

    from llama_index.core.agent.workflow import AgentInput, AgentOutput, FunctionAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool
    from llama_index.core.workflow.errors import WorkflowRuntimeError
    from llama_index.llms.ssr import SSR

    async def run(ws: Workspace) -> list[Step]:
        tools = [FunctionTool.from_defaults(fn=fn, name=name, description=desc,
                                            fn_schema=_llamaindex_schema(name, parameters))
                 for name, desc, fn, parameters in _framework_tools(ws)]
        agent = FunctionAgent(tools=tools, llm=SSR(engine=engine, ssr_config=config), streaming=False)
        handler = agent.run(user_msg=task.prompt(), max_iterations=max_steps)
        steps: list[Step] = []
        start = time.perf_counter()
        try:
            async for event in handler.stream_events():
                if isinstance(event, AgentInput):
                    start = time.perf_counter()
                elif isinstance(event, AgentOutput):
                    raw = event.raw if isinstance(event.raw, dict) else {}
                    calls = [{"id": c.tool_id, "name": c.tool_name, "arguments": c.tool_kwargs}
                             for c in event.tool_calls]
                    steps.append(Step(list(raw.get("token_ids", [])), time.perf_counter() - start,
                                      dict(raw.get("stats") or {}), calls, [], str(event.response.content or ""),
                                      [str(c) for c in raw.get("invalid_tool_calls", [])],
                                      list(raw.get("prompt_token_ids", [])), dict(raw.get("near_ties") or {})))
                elif isinstance(event, ToolCallResult) and steps:
                    steps[-1].tool_results.append(str(event.tool_output.content))
            await handler
        except WorkflowRuntimeError:
            pass  # max_iterations reached: the task is scored as it stands
        return steps

    t_start = time.perf_counter()
    with Workspace(task) as ws:
        steps = asyncio.run(run(ws))
        solved = ws.tests_pass()
    return AgentOutcome(task.id, solved, steps, time.perf_counter() - t_start)


# the fronts by name (``--agent-front``): each runs one task as a whole loop
LOOPS: dict[str, Callable[..., AgentOutcome]] = {"engine": run_engine_loop, "langchain": run_langchain_loop,
                                                 "llamaindex": run_llamaindex_loop}
FRONTS = tuple(LOOPS)


def step_summary(step: Step) -> dict[str, Any]:
    """The numbers the report uses per step (the record keeps these, not the whole stats)."""
    s = step.stats
    return {"latency_s": round(step.latency_s, 4), "n_tokens": len(step.token_ids),
            "think_tokens": s.get("think_tokens"), "answer_tokens": s.get("answer_tokens"),
            "forward_passes": s.get("forward_passes"), "prompt_tokens": s.get("prompt_tokens"),
            "reused_prompt_tokens": s.get("reused_prompt_tokens"),
            "accepted_by_source": s.get("accepted_by_source"), "accepted_prefix": s.get("accepted_prefix_tokens"),
            "tools": [c["name"] for c in step.tool_calls], "invalid": step.invalid,
            "results": [r[:80] for r in step.tool_results], "answer": step.answer[:200],
            **({"prompt_ids": step.prompt_ids} if step.prompt_ids else {})}


def prefill_accounting(steps: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per step after the first (step summaries with ``prompt_ids``): ``added``, how much the prompt grew since the
    previous step's (the messages added since, the generation prompt's change), and ``prefilled``, the prompt
    tokens the step computed (``prompt_tokens - reused_prompt_tokens``). An append-only loop whose cache carries
    over prefills about ``added`` tokens; recipe text that moves between turns shows as prefill beyond it (the
    conversation after the moved text is computed again)."""
    out = []
    for before, step in zip(steps, steps[1:]):
        if not (before.get("prompt_ids") and step.get("prompt_ids")) or step.get("reused_prompt_tokens") is None:
            continue
        out.append({"added": len(step["prompt_ids"]) - len(before["prompt_ids"]),
                    "prefilled": step["prompt_tokens"] - step["reused_prompt_tokens"]})
    return out


def describe(outcome: AgentOutcome) -> str:
    lines = [f"{outcome.task}: {'solved' if outcome.solved else 'not solved'} in {len(outcome.steps)} steps, "
             f"{outcome.latency_s:.1f} s"]
    for i, step in enumerate(outcome.steps, 1):
        calls = ", ".join(f"{c['name']}({json.dumps(c['arguments'])[:60]})" for c in step.tool_calls)
        lines.append(f"  {i}: {calls or repr(step.answer[:80])} -> {[r[:40] for r in step.tool_results]} "
                     f"{step.latency_s:.1f}s {step.stats.get('forward_passes')} passes")
    return "\n".join(lines)


def aggregate_stats(steps: list[Step]) -> dict[str, Any]:
    """The run's stats over all its steps: counts summed, accepted tokens by source summed (the runner's
    ``summarize_stats`` reads these keys, as for a single generation)."""
    total: dict[str, Any] = {}
    for step in steps:
        for key, value in step.stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    total["accepted_by_source"] = accepted_by_source(step.stats for step in steps)
    total["drafts"] = sum(len(step.stats.get("drafts") or []) for step in steps)  # forks taken
    total["pass_shapes"] = summed_counts(step.stats.get("pass_shapes") for step in steps)
    total["speculation"] = {phase: summed_counts(_phase_counts(step.stats, phase) for step in steps)
                            for phase in ("think", "draft", "answer")}
    return total


def _phase_counts(stats: dict[str, Any], phase: str) -> dict[str, int]:
    """A step's speculation counts of one phase (steps, verify steps, proposed, accepted)."""
    counts = (stats.get("speculation") or {}).get(phase) or {}
    return {key: n for key, n in counts.items() if isinstance(n, int)}


def accepted_by_source(counts: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The ``accepted_by_source`` counts of several steps (their stats, or their summaries), summed by source."""
    return summed_counts(c.get("accepted_by_source") for c in counts)


def summed_counts(counts: Iterable[dict[str, int] | None]) -> dict[str, int]:
    """Counts keyed by name (accepted tokens by source, passes by shape), summed over several steps."""
    total: dict[str, int] = {}
    for c in counts:
        for key, n in (c or {}).items():
            total[key] = total.get(key, 0) + n
    return total
