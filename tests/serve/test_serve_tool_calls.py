"""Tool calls in the server's answers, in-process over the real app and a scripted engine (the only way to make a
model call an unknown tool on cue): the non-streamed message and the stream's deltas carry the same calls."""

from __future__ import annotations

import json

import pytest
from scripted import scripted_engine

from ssr import SSRConfig

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from ssr.serve import create_app  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def streamed_calls(response) -> tuple[list[tuple[str, dict]], str]:
    """The calls the stream's deltas add up to, and its finish reason."""
    names, arguments, finish = {}, {}, None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            finish = choice["finish_reason"] or finish
            for piece in choice["delta"].get("tool_calls") or []:
                if "id" in piece:
                    names[piece["index"]] = piece["function"]["name"]
                arguments[piece["index"]] = arguments.get(piece["index"], "") + piece["function"]["arguments"]
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


@pytest.mark.parametrize("call, error", [({"name": "get_stock_price", "arguments": {"ticker": "ACME"}}, "unknown tool"),
                                         ({"name": "get_weather", "arguments": {"town": "Lima"}}, "required property")])
def test_a_well_formed_call_the_engine_flags_goes_out_as_a_call(tokenizer, call, error):
    # as vLLM's server does: the client's executor rejects it and the model reads why; the reason is in `ssr`
    engine = scripted_engine(tokenizer, SSRConfig(max_think_tokens=32, max_tokens=128, constrain_tool_calls=False))
    engine.backend.set_script("The user asks for a call.", f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    client = TestClient(create_app(engine))
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "ACME?"}], "tools": [WEATHER],
            "chat_template_kwargs": {"enable_thinking": True}}
    reply = client.post("/v1/chat/completions", json=body).json()
    [choice] = reply["choices"]
    [sent] = choice["message"]["tool_calls"]
    assert (sent["function"]["name"], json.loads(sent["function"]["arguments"])) == (call["name"], call["arguments"])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [flagged] = reply["ssr"]["invalid_tool_calls"]
    assert flagged["id"] == sent["id"] and error in flagged["error"]
    stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed_calls(stream) == ([(call["name"], call["arguments"])], "tool_calls")
