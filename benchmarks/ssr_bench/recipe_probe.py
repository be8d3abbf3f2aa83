"""Probe: how the instruct recipe's turn after a tool result decides what the agent suite's loops solve.

Runs the agent suite's engine loop (plain decoding) with the recipe as it ships and with the alternatives measured
in docs/log.md ("Why the 1.5B solves 3 of 12", "An edit demonstration after tool results"), printing per task
whether the project's tests pass and each step's tokens; ``--tasks held-out`` runs nine tasks of the same kinds that
are not in the suite (a recipe fitted to the suite's tasks would not carry over), ``--questions`` six non-coding
questions answered by one call (after the result the model should answer, not call again). A probe, not a benchmark:
one method, no timing comparison; the suite's own runner is ``ssr bench``.

    python -m ssr_bench.recipe_probe --variant answer-only --backend llama.cpp --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from ssr import SSREngine
from ssr.chat import TOOL_RESULT_DEMONSTRATION, ChatFamily, parse_tool_calls, render_prompt

from . import agent
from .methods import PLAIN, method_config
from .runner import base_config


def _two_calls(ask: str, calls: list[tuple[str, dict[str, Any], str]], thought: str, last_thought: str,
               answer: str) -> list[dict[str, Any]]:
    """A demonstration with two tool calls: the user's ask, the first call (no thinking: the decision turn) and its
    result, the thought that leads to the second call and its result, then the thought and the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
    for i, (name, arguments, result) in enumerate(calls, start=1):
        content = f"<think>\n{thought}\n</think>" if i > 1 else ""
        messages += [{"role": "assistant", "content": content, "tool_calls": [
                         {"id": f"call_demo_{i}", "type": "function",
                          "function": {"name": name, "arguments": arguments}}]},
                     {"role": "tool", "tool_call_id": f"call_demo_{i}", "name": name, "content": result}]
    messages.append({"role": "assistant", "content": f"<think>\n{last_thought}\n</think>\n\n{answer}"})
    return messages


# A result that leads to a second call, then the answer: the shipped demonstration only ever shows an answer.
TWO_STEP = _two_calls(
    "Add up the March invoices and save the total in report.txt.",
    [("read_invoices", {"month": "March"}, "120.50\n80.00\n99.50"),
     ("save_text", {"path": "report.txt", "text": "Total: 300.00"}, "saved report.txt")],
    "The invoices of March are 120.50, 80.00 and 99.50, so the total is 300.00. The task is not done yet: I call "
    "save_text with report.txt and the total.",
    "The save_text tool saved report.txt with the total. That finishes the task, so I reply in one sentence and call "
    "no more tools.",
    "The March total, 300.00, is saved in report.txt.")

# Read, change one line, write the whole text back, answer: the coding agent's own pattern on a note.
EDIT = _two_calls(
    "The shopping list in list.txt says 2 eggs; make it 12 eggs.",
    [("open_note", {"name": "list.txt"}, "Shopping:\n- milk\n- 2 eggs\n"),
     ("save_note", {"name": "list.txt", "text": "Shopping:\n- milk\n- 12 eggs\n"}, "saved list.txt")],
    "The note has three lines, and the line \"- 2 eggs\" is the one to change: it must read \"- 12 eggs\". The other "
    "lines stay as they are. The task is not done yet: I call save_note with the whole changed text.",
    "The save_note tool saved list.txt with 12 eggs. That finishes the task, so I reply in one sentence and call no "
    "more tools.",
    "list.txt now says 12 eggs.")

# The shipped demonstration is two exchanges: one that answers from a result, then one that edits a file
ANSWER_ONLY = TOOL_RESULT_DEMONSTRATION[:4]  # the first alone: shipped until 2026-12-07
EDIT_ONLY = TOOL_RESULT_DEMONSTRATION[4:]  # the second alone
EDIT_ANSWER_LAST = [*EDIT_ONLY, *ANSWER_ONLY]  # both, the other order
# The second with its call as a template tool call (``<tool_call>`` tags after the thought) instead of fenced JSON
EDIT_TAGGED: list[dict[str, Any]] = [dict(m) for m in EDIT_ONLY]
_thought, _, _fenced = EDIT_TAGGED[3]["content"].partition("</think>")
_call = parse_tool_calls(_fenced, agent.TOOLS).tool_calls[0]  # the fenced call, read as the engine reads it
EDIT_TAGGED[3] = {"role": "assistant", "content": _thought + "</think>", "tool_calls": [
    {"id": "call_demo_2", "type": "function", "function": {"name": _call["name"], "arguments": _call["arguments"]}}]}

DEMONSTRATIONS = {"shipped": TOOL_RESULT_DEMONSTRATION, "answer-only": ANSWER_ONLY, "two-step": TWO_STEP,
                  "edit": EDIT, "edit-only": EDIT_ONLY, "edit-tagged": EDIT_TAGGED,
                  "edit-answer-last": EDIT_ANSWER_LAST}


# Tasks outside the suite, of its three kinds, to tell a recipe that helps the model from one fitted to the suite
HELD_OUT: tuple[agent.Task, ...] = (
    agent._task("max3", "fix", "pick", 'def max_of_three(a, b, c):\n    """Return the largest of a, b and c."""\n'
                "    return max(a, b)\n", "max_of_three",
                ["self.assertEqual(max_of_three(1, 2, 9), 9)", "self.assertEqual(max_of_three(5, 2, 1), 5)"],
                "max_of_three in pick.py ignores its third argument, so the tests fail.",
                fix=("max(a, b)", "max(a, b, c)")),
    agent._task("words", "fix", "counting", 'def count_words(s):\n    """Return how many words s has."""\n'
                '    return len(s.split(","))\n', "count_words",
                ["self.assertEqual(count_words('a b c'), 3)", "self.assertEqual(count_words('one'), 1)"],
                "count_words in counting.py counts the wrong thing, so the tests fail.",
                fix=('s.split(",")', "s.split()")),
    agent._task("last", "fix", "seq", 'def last(values):\n    """Return the last element of a non-empty list."""\n'
                "    return values[0]\n", "last", ["self.assertEqual(last([1, 2, 3]), 3)"],
                "last in seq.py returns the wrong element, so the tests fail.", fix=("values[0]", "values[-1]")),
    agent._task("sum_even", "fix", "evens", 'def sum_even(values):\n    """Return the sum of the even values."""\n'
                "    return sum(v for v in values if v % 2)\n", "sum_even",
                ["self.assertEqual(sum_even([1, 2, 3, 4]), 6)", "self.assertEqual(sum_even([1]), 0)"],
                "sum_even in evens.py adds the wrong values, so the tests fail.", fix=("if v % 2)", "if v % 2 == 0)")),
    agent._task("kelvin", "fix", "temps", 'def to_kelvin(c):\n    """Convert Celsius to Kelvin."""\n'
                "    return c - 273.15\n", "to_kelvin", ["self.assertAlmostEqual(to_kelvin(0), 273.15)"],
                "to_kelvin in temps.py gives wrong temperatures, so the tests fail.", fix=("c - 273.15", "c + 273.15")),
    agent._task("is_odd", "add", "parity", 'def is_even(n):\n    """Return True when n is even."""\n'
                "    return n % 2 == 0\n", "is_even, is_odd",
                ["self.assertTrue(is_even(2))", "self.assertTrue(is_odd(3))", "self.assertFalse(is_odd(4))"],
                "Add a function is_odd(n) to parity.py, keeping is_even; the tests import both.",
                fix=("return n % 2 == 0\n", "return n % 2 == 0\n\n\ndef is_odd(n):\n    return n % 2 == 1\n")),
    agent._task("initials", "add", "names", 'def full_name(first, last):\n    """Return the first and last name."""\n'
                '    return first + " " + last\n', "full_name, initials",
                ["self.assertEqual(full_name('Ada', 'Lovelace'), 'Ada Lovelace')",
                 "self.assertEqual(initials('Ada', 'Lovelace'), 'AL')"],
                "Add a function initials(first, last) that returns the two first letters to names.py, keeping "
                "full_name; the tests import both.",
                fix=('first + " " + last\n', 'first + " " + last\n\n\ndef initials(first, last):\n'
                     "    return first[0] + last[0]\n")),
    agent._task("title", "test", "case", 'def title_case(s):\n    """Return s with each word capitalised."""\n'
                "    return s.upper()\n", "title_case",
                ["self.assertEqual(title_case('hello world'), 'Hello World')"],
                "The test in test_case.py expects title_case('hello world') to return 'Hello World'. Make it pass.",
                fix=("s.upper()", "s.title()")),
    agent._task("percent", "test", "ratio",
                'def percent(part, whole):\n    """Return part as a percentage of whole."""\n    return part / whole\n',
                "percent", ["self.assertEqual(percent(1, 2), 50.0)"],
                "The test in test_ratio.py expects percent(1, 2) to return 50.0. Make it pass.",
                fix=("part / whole", "100 * part / whole")),
)


def _tool(name: str, description: str, *params: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}}


# Questions that one tool call answers (not coding): after the result the model should answer from it, not call again
QUESTION_TOOLS = [_tool("get_weather", "Current weather in a city.", "city"),
                  _tool("get_time", "Current time in a timezone.", "timezone"),
                  _tool("search_flights", "Search flights between two cities.", "origin", "destination"),
                  _tool("lookup_stock", "Latest price of a stock ticker.", "ticker")]
QUESTIONS = [("What's the weather in Paris?", "get_weather", {"city": "Paris"}, "18 C, light rain"),
             ("What time is it in Tokyo?", "get_time", {"timezone": "Asia/Tokyo"}, "14:05"),
             ("Find me a flight from Oslo to Rome.", "search_flights", {"origin": "Oslo", "destination": "Rome"},
              "SK4711 dep 09:40 arr 13:35, 129 EUR"),
             ("How much is Apple stock?", "lookup_stock", {"ticker": "AAPL"}, "AAPL 231.40 USD"),
             ("Is it warm in Cairo right now?", "get_weather", {"city": "Cairo"}, "34 C, sunny"),
             ("What's the time in New York?", "get_time", {"timezone": "America/New_York"}, "08:15")]


def answers_from_results(engine: SSREngine, config) -> int:
    """How many of ``QUESTIONS`` the model answers in text after its tool's result (no further call); prints each."""
    answered = 0
    for ask, name, arguments, result in QUESTIONS:
        messages = [{"role": "user", "content": ask},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "name": name, "content": result}]
        out = engine.generate(messages, tools=QUESTION_TOOLS, config=config)
        answered += not out.tool_calls
        print(f"== {ask} calls {[c['name'] for c in out.tool_calls]} {out.answer[:160]!r}", flush=True)
    return answered


def with_demonstration(family: ChatFamily, variant: str) -> ChatFamily:
    """``family`` with the variant's exchange as its turn-after-a-tool-result demonstration."""
    return dataclasses.replace(family, tool_result_demonstration=tuple(DEMONSTRATIONS[variant]))


class _NoThinking:
    """The engine with ``thinking=False`` on every step: the model's own template, as a bare model runs."""

    def __init__(self, engine: SSREngine) -> None:
        self.engine = engine

    def generate(self, messages, **kwargs):
        return self.engine.generate(messages, thinking=False, **kwargs)


# Instead of a demonstration after the system block: a note after every tool result, which never moves, so each
# step's prompt extends the previous one token for token (issue 33's append-only placement)
AFTER_RESULT_NOTE = ("Think step by step inside <think> ... </think> about the tool result above: call another tool "
                     "if the task is not done yet, else answer the user in one sentence.")


class _NoteAfterResults:
    """The engine with no demonstration and a system note after each run of tool results (``AFTER_RESULT_NOTE``);
    a step after a result thinks, the decision turn is the model's own template, as shipped."""

    def __init__(self, engine: SSREngine) -> None:
        self.engine = engine

    def generate(self, messages, **kwargs):
        if messages[-1]["role"] != "tool":
            return self.engine.generate(messages, **kwargs)
        noted: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            noted.append(message)
            if message["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool"):
                noted.append({"role": "system", "content": AFTER_RESULT_NOTE})
        family = self.engine.family
        text = render_prompt(self.engine.tokenizer, family, noted, kwargs.get("tools"), thinking=False)
        ids = self.engine.tokenizer.encode(text + family.think_prefill, add_special_tokens=False)
        return self.engine.generate(ids, thinking=True, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=[*DEMONSTRATIONS, "no-thinking", "note"], default="shipped")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--backend", default="llama.cpp")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tasks", default="",
                        help="comma-separated task ids (default: the suite's 12; held-out: the probe's own tasks)")
    parser.add_argument("--questions", action="store_true",
                        help="the non-coding questions instead of tasks: does the model answer from a result?")
    parser.add_argument("--max-think-tokens", type=int, default=None, help="the thinking budget (default: the suite's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = SSREngine.from_pretrained(args.model, backend=args.backend)
    if args.variant in DEMONSTRATIONS:
        engine.family = with_demonstration(engine.family, args.variant)
    wrappers = {"no-thinking": _NoThinking, "note": _NoteAfterResults}
    loop_engine = wrappers[args.variant](engine) if args.variant in wrappers else engine
    budget = {"max_think_tokens": args.max_think_tokens} if args.max_think_tokens else {}
    config = method_config(PLAIN, base_config("agent", **budget))  # plain decoding, the suite's budgets
    if args.questions:
        print(f"variant {args.variant}: answered from the result {answers_from_results(engine, config)}/"
              f"{len(QUESTIONS)}")
        engine.close()
        return
    wanted = set(filter(None, args.tasks.split(",")))
    pool = HELD_OUT if "held-out" in wanted else agent.TASKS
    wanted.discard("held-out")
    solved = 0
    tasks = [t for t in pool if not wanted or t.id in wanted]
    for task in tasks:
        engine.backend.release_all()  # each task from an empty prompt cache, as the suite runs it
        outcome = agent.run_engine_loop(loop_engine, task, config)
        solved += outcome.solved
        print(f"== {task.id}: solved {outcome.solved}, {len(outcome.steps)} steps", flush=True)
        for i, step in enumerate(outcome.steps):
            text = engine.tokenizer.decode(step.token_ids)
            print(f"   {i}: calls {[c['name'] for c in step.tool_calls]} prompt {step.stats.get('prompt_tokens')} "
                  f"reused {step.stats.get('reused_prompt_tokens')} {text[:700]!r}", flush=True)
    print(f"variant {args.variant}: solved {solved}/{len(tasks)}")
    engine.close()


if __name__ == "__main__":
    main()
