"""A LangChain agent (``langchain.agents.create_agent``, tool_choice "auto") on the real default model: the model
calls the tool on the user's turn, receives its result, and answers, through ChatSSR; plain decoding and SSR give
the same messages."""

from __future__ import annotations

import pytest

from ssr import SSRConfig

pytest.importorskip("langchain.agents")
pytestmark = pytest.mark.real_model

from langchain.agents import create_agent  # noqa: E402
from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from langchain_ssr import ChatSSR  # noqa: E402

CONFIG = dict(max_think_tokens=48, draft_start=8, max_tokens=160)


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"{city}: 18 C, light rain (station PX-4)."


def run_agent(engine, enabled: bool) -> list:
    model = ChatSSR(engine=engine, ssr_config=SSRConfig(enabled=enabled, **CONFIG), temperature=0)
    agent = create_agent(model, tools=[get_weather],
                         system_prompt="You are a weather assistant. Call get_weather, then reply to the user "
                                       "with one plain sentence that repeats its result.")
    return agent.invoke({"messages": [("user", "What is the weather in Paris right now?")]},
                        {"recursion_limit": 8})["messages"]


@pytest.fixture(scope="module")
def runs(default_engine):
    return run_agent(default_engine, enabled=False), run_agent(default_engine, enabled=True)


def test_agent_calls_the_tool_then_answers(runs):
    _, messages = runs
    first_call = next(m for m in messages if isinstance(m, AIMessage) and m.tool_calls)
    assert [(c["name"], c["args"]) for c in first_call.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = next(m for m in messages if isinstance(m, ToolMessage))
    assert "18 C" in result.content
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert "</think>" not in final.content and "<tool_call>" not in final.content
    assert "18" in final.content + final.additional_kwargs.get("reasoning_content", "")


def test_agent_messages_identical_between_plain_and_ssr(runs):
    plain, ssr = runs
    strip = [(type(m).__name__, m.content, [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])])
             for m in plain]
    assert strip == [(type(m).__name__, m.content, [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])])
                     for m in ssr]
    assert ssr[-1].response_metadata["ssr"]["forward_passes"] <= plain[-1].response_metadata["ssr"]["forward_passes"]
