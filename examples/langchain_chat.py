"""ChatSSR in LangChain: stream a reasoning model's thinking and answer, call a tool, print SSR's stats.

    pip install -e . -e ./integrations/langchain
    python examples/langchain_chat.py [--model qwen2.5-coder-0.5b-instruct] [--plain]

Runs the embedded default model (Qwen2.5-Coder-0.5B-Instruct) on this machine; no server, no network.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from langchain_ssr import ChatSSR
except ImportError:  # running from a source checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "integrations" / "langchain"), str(root)]
    from langchain_ssr import ChatSSR

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

from ssr import SSRConfig

DIM, RESET = "\033[2m", "\033[0m"


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"It is sunny and 21 °C in {city}."


def print_stats(message) -> None:
    stats = message.response_metadata["ssr"]
    usage = message.usage_metadata
    finish = message.response_metadata["finish_reason"]
    print(f"\n{DIM}tokens: {usage['input_tokens']} in, {usage['output_tokens']} out "
          f"({usage['output_token_details']['reasoning']} thinking); finish: {finish}")
    print(f"SSR: {len(stats['drafts'])} draft(s), {stats['accepted_tokens']} answer tokens accepted from proposals "
          f"in {stats['verify_passes']} verify pass(es); forward passes {stats['forward_passes']} "
          f"(plain decoding: {stats['plain_forward_passes']}, saved {stats['forward_passes_saved']}); "
          f"{stats['seconds']['total']:.1f} s{RESET}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
    parser.add_argument("--plain", action="store_true", help="plain decoding (SSR off), for comparison")
    parser.add_argument("--think", type=int, default=96, help="thinking budget in tokens")
    args = parser.parse_args()

    config = SSRConfig(enabled=not args.plain, max_think_tokens=args.think, draft_start=16, max_tokens=400)
    llm = ChatSSR(model=args.model, ssr_config=config, temperature=0)

    # 1. Streaming: the chain of thought arrives as it is generated, the answer as soon as it is verified.
    question = "Write a Python function that checks whether a string is a palindrome."
    print(f"> {question}\n")
    full = None
    thinking = False
    for chunk in llm.stream(question):
        reasoning = chunk.additional_kwargs.get("reasoning_content", "")
        if reasoning:
            if not thinking:
                print(f"{DIM}[thinking] ", end="")
                thinking = True
            print(reasoning, end="", flush=True)
        if chunk.text:
            if thinking:
                print(f"{RESET}\n\n", end="")
                thinking = False
            print(chunk.text, end="", flush=True)
        full = chunk if full is None else full + chunk
    print_stats(full)

    # 2. A tool call, its result, and the model's final answer (a small agent loop).
    print("\n> What's the weather in Lisbon?\n")
    with_tools = llm.bind_tools([get_weather])
    messages = [HumanMessage("What's the weather in Lisbon? Use the get_weather tool.")]
    for _ in range(3):
        reply = with_tools.invoke(messages)
        messages.append(reply)
        if reasoning := reply.additional_kwargs.get("reasoning_content"):
            print(f"{DIM}[thinking] {reasoning}{RESET}")
        for call in reply.tool_calls:
            print(f"{DIM}[tool call] {call['name']}({call['args']}){RESET}")
            result = get_weather.invoke(call)
            print(f"{DIM}[tool result] {result.content}{RESET}")
            messages.append(result)
        for bad in reply.invalid_tool_calls:
            print(f"{DIM}[invalid tool call] {bad['name']}: {bad['error']}{RESET}")
        if not reply.tool_calls:
            break
    print(messages[-1].text or f"{DIM}(no answer after the thinking){RESET}")
    print_stats(messages[-1])


if __name__ == "__main__":
    main()
