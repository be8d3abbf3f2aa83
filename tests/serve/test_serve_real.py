"""``ssr serve`` as a real process on the embedded default model (a trained model: reasoning and tool calls mean
something): the official ``openai`` client sync, async and streaming, LangChain's ``ChatOpenAI`` pointed at it,
token identity with the engine in this process, and a client that disconnects mid-stream freeing its lanes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from serve_process import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.real_model,
              pytest.mark.allow_hosts(["127.0.0.1"])]  # pytest-socket: the clients reach this server only

THINK = 16  # the server's thinking budget (--max-think-tokens): short requests on a CPU
MAX = 80
CODE_MAX = 40  # enough for the thinking and the answer's first line, "```python\ndef is_even(n):"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
QUESTION = "Write a Python function is_even(n) that returns True when n is even."
ASK_CODE = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ssr.models import resolve_model

    try:
        resolve_model(None)
    except ValueError as exc:  # the default model's wheels are not installed
        pytest.skip(str(exc))
    proc = ServerProcess(["--max-think-tokens", str(THINK)], log=tmp_path_factory.mktemp("logs") / "real.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model_name(server):
    return server.health()["model"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def weather_call(client, model_name):
    """One required tool call through the server (non-streamed), shared by the tests that read it."""
    return client.chat.completions.create(model=model_name, messages=ASK_WEATHER, tools=[WEATHER],
                                          tool_choice="required", max_tokens=MAX, temperature=0,
                                          extra_body={"return_token_ids": True})


def test_sync_client_gets_reasoning_tool_calls_and_usage(weather_call):
    choice = weather_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    assert not choice.message.content
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning.strip()
    usage = weather_call.usage
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens
    assert usage.completion_tokens == len(weather_call.model_extra["ssr"]["token_ids"])
    stats = weather_call.model_extra["ssr"]["stats"]
    assert stats["think_tokens"] == usage.completion_tokens_details.reasoning_tokens
    assert {"forward_passes", "plain_forward_passes", "accepted_tokens"} <= set(stats)


def test_server_output_is_token_identical_to_the_engine(weather_call, default_engine):
    from ssr import SSRConfig

    reference = default_engine.generate(ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=MAX,
                                        config=SSRConfig(max_think_tokens=THINK))
    assert weather_call.model_extra["ssr"]["token_ids"] == reference.token_ids
    assert weather_call.choices[0].message.model_extra["reasoning_content"] == reference.reasoning
    assert [json.loads(c.function.arguments) for c in weather_call.choices[0].message.tool_calls] == \
        [c["arguments"] for c in reference.tool_calls]


def test_async_streamed_tool_call_deltas_add_up_to_the_call(server, model_name, weather_call):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            stream = await client.chat.completions.create(
                model=model_name, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=MAX,
                temperature=0, stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    reasoning, calls, finish, usage, pieces = "", {}, None, None, 0
    for chunk in asyncio.run(main()):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            pieces += 1
            entry = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert entry["id"] is None and piece.type == "function" and piece.function.name
                entry["id"], entry["name"] = piece.id, piece.function.name
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    (expected,) = weather_call.choices[0].message.tool_calls
    assert list(calls) == [0]
    assert calls[0]["name"] == expected.function.name and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(expected.function.arguments)
    assert pieces >= 2  # the id and name first, the arguments' JSON after, as it is written
    assert reasoning == weather_call.choices[0].message.model_extra["reasoning_content"]
    assert usage.completion_tokens == weather_call.usage.completion_tokens
    expected_reasoning = weather_call.usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens_details.reasoning_tokens == expected_reasoning


def test_streaming_client_gets_reasoning_then_content(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=ASK_CODE, max_tokens=CODE_MAX, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    kinds = []
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if (delta.model_extra or {}).get("reasoning_content"):
                kinds.append("reasoning")
            if delta.content:
                kinds.append("content")
    assert "reasoning" in kinds and "content" in kinds
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "def is_even" in content
    usage = chunks[-1].usage
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens


def test_langchain_chat_openai_invoke_stream_and_bind_tools(server, model_name):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=model_name, temperature=0,
                     max_tokens=CODE_MAX, max_retries=0, timeout=300)
    message = llm.invoke(QUESTION)
    assert "def is_even" in message.content
    assert message.usage_metadata["output_token_details"]["reasoning"] > 0
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    streamed = None
    for chunk in llm.stream(QUESTION):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == message.content
    called = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris right now?",
                                                                          max_tokens=MAX)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)


def test_a_client_that_disconnects_mid_stream_frees_its_lanes(server, model_name):
    import httpx

    lanes_before = server.health()["live_lanes"]
    cancelled = server.metric("ssr_requests_total", '{endpoint="chat.completions",status="499"}')
    body = {"model": model_name, "stream": True, "max_tokens": 2000, "reasoning_effort": "high",
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    seen = 0
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and "reasoning_content" in line:
                    seen += 1
                    if seen == 3:
                        break  # hang up mid-thinking
    assert seen == 3
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = server.health()
        gone = server.metric("ssr_requests_total", '{endpoint="chat.completions",status="499"}') == cancelled + 1
        if gone and health["in_flight"] == 0 and health["live_lanes"] <= lanes_before \
                and health.get("running", 0) == 0 and health.get("queued", 0) == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the request was not cancelled: {server.health()}\n{server.log_text()[-2000:]}")
    assert "chat.completions 499" in server.log_text()
