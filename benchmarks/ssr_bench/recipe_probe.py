"""Probe: how the instruct recipe's turn after a tool result decides what the agent suite's loops solve.

Runs the agent suite's engine loop (plain decoding) with the recipe as it ships and with the alternatives measured
in docs/results.md ("Why the 1.5B solves 3 of 12"), printing per task whether the project's tests pass and each
step's tokens. A probe, not a benchmark: one method, no timing comparison; the suite's own runner is ``ssr bench``.

    python -m ssr_bench.recipe_probe --variant two-step --backend llama.cpp --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from ssr import SSREngine
from ssr.chat import TOOL_RESULT_DEMONSTRATION, ChatFamily, render_prompt

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

DEMONSTRATIONS = {"shipped": TOOL_RESULT_DEMONSTRATION, "two-step": TWO_STEP, "edit": EDIT}


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
    parser.add_argument("--tasks", default="", help="comma-separated task ids (default: all 12)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = SSREngine.from_pretrained(args.model, backend=args.backend)
    if args.variant in DEMONSTRATIONS:
        engine.family = with_demonstration(engine.family, args.variant)
    wrappers = {"no-thinking": _NoThinking, "note": _NoteAfterResults}
    loop_engine = wrappers[args.variant](engine) if args.variant in wrappers else engine
    config = method_config(PLAIN, base_config("agent"))  # plain decoding, the suite's budgets
    wanted = set(filter(None, args.tasks.split(",")))
    solved = 0
    tasks = [t for t in agent.TASKS if not wanted or t.id in wanted]
    for task in tasks:
        engine.backend.release_all()  # each task from an empty prompt cache, as the suite runs it
        outcome = agent.run_engine_loop(loop_engine, task, config)
        solved += outcome.solved
        print(f"== {task.id}: solved {outcome.solved}, {len(outcome.steps)} steps", flush=True)
        for i, step in enumerate(outcome.steps):
            text = engine.tokenizer.decode(step.token_ids)
            print(f"   {i}: calls {[c['name'] for c in step.tool_calls]} prompt {step.stats.get('prompt_tokens')} "
                  f"reused {step.stats.get('reused_prompt_tokens')} {text[:300]!r}", flush=True)
    print(f"variant {args.variant}: solved {solved}/{len(tasks)}")
    engine.close()


if __name__ == "__main__":
    main()
