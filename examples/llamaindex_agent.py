"""A LlamaIndex FunctionAgent on SSR: watch the model reason, call a tool, answer, and see what SSR saved.

    pip install -e . -e ./integrations/llamaindex
    python examples/llamaindex_agent.py            # the embedded 0.5B model, on CPU
    python examples/llamaindex_agent.py --plain    # the same with plain decoding, for comparison

Reasoning streams as thinking deltas (dim), the answer as text deltas; the SSR stats of every model call
(thinking tokens, drafts, accepted tokens, forward passes saved) are printed after each step.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

try:
    from llama_index.llms.ssr import SSR
except ImportError:  # running from a source checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "integrations" / "llamaindex")]
    from llama_index.llms.ssr import SSR

from llama_index.core.agent.workflow import AgentOutput, AgentStream, FunctionAgent, ToolCall, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.ssr.utils import reasoning_of

from ssr import SSRConfig

DIM, RESET = "\033[2m", "\033[0m"


def get_weather(city: str) -> str:
    """Weather in a city."""
    reports = {"paris": "18 C, light rain", "oslo": "-3 C, snow", "lima": "24 C, sunny"}
    return f"{city}: {reports.get(city.strip().lower(), 'no report')}."


def show_stats(stats: dict) -> None:
    keys = ("think_tokens", "answer_tokens", "draft_tokens", "accepted_tokens", "verify_passes", "forward_passes",
            "forward_passes_saved")
    print("\n  [ssr] " + ", ".join(f"{k}={stats[k]}" for k in keys if k in stats)
          + f", seconds={stats.get('seconds', {}).get('total')}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is the weather in Paris right now?")
    parser.add_argument("--model", default=None, help="model name or local path (default: the embedded 0.5B)")
    parser.add_argument("--think", type=int, default=64, help="thinking budget in tokens")
    parser.add_argument("--plain", action="store_true", help="plain decoding (SSR off), for comparison")
    args = parser.parse_args()

    config = SSRConfig(enabled=not args.plain, max_think_tokens=args.think, draft_start=8)
    llm = SSR(model=args.model, ssr_config=config, max_tokens=args.think + 160)
    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(fn=get_weather)],
        llm=llm,
        system_prompt="You are a weather assistant. Call get_weather once. When you have its result, do not call "
        "it again and do not write code: reply to the user with one plain sentence that repeats the result.",
    )

    print(f"model: {llm.metadata.model_name} (context {llm.metadata.context_window} tokens), "
          f"{'plain decoding' if args.plain else 'SSR'}\nuser: {args.question}\n")
    handler = agent.run(args.question)
    thinking = False
    async for event in handler.stream_events():
        if isinstance(event, AgentStream):
            if event.thinking_delta:
                if not thinking:
                    print(f"{DIM}[thinking] ", end="")
                    thinking = True
                print(f"{DIM}{event.thinking_delta}{RESET}", end="", flush=True)
            if event.delta:
                if thinking:
                    print(f"{RESET}\n[answer] ", end="")
                    thinking = False
                print(event.delta, end="", flush=True)
        elif isinstance(event, ToolCall) and not isinstance(event, ToolCallResult):
            print(f"\n  -> calling {event.tool_name}({event.tool_kwargs})")
        elif isinstance(event, ToolCallResult):
            print(f"  <- {event.tool_output.content}")
        elif isinstance(event, AgentOutput) and isinstance(event.raw, dict) and "stats" in event.raw:
            thinking = False
            show_stats(event.raw["stats"])
    result = await handler
    print(f"\nanswer: {result}")
    if not str(result).strip():  # small prompted models sometimes say it all while thinking
        print(f"(empty answer; the model's last reasoning: {reasoning_of(result.response)!r})")


if __name__ == "__main__":
    asyncio.run(main())
