"""The server's error paths that a real process cannot be made to hit on cue (a full queue, a timeout, a failure
mid-stream), in-process over a tiny engine whose ``astream`` is replaced; and the server importing without the
framework adapters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tiny import CHAT_TEMPLATE, TOOL_VOCAB, tiny_engine

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from ssr.errors import QueueFull, RequestTimeout  # noqa: E402
from ssr.serve import create_app  # noqa: E402

BODY = {"model": "tiny-0", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(0, vocab=TOOL_VOCAB)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


def replace_astream(monkeypatch, engine, fn):
    monkeypatch.setattr(engine, "astream", fn)


def test_a_full_queue_is_503_and_a_timeout_408(engine, monkeypatch):
    async def full(prompt, **kwargs):
        raise QueueFull("64 requests are waiting")
        yield  # pragma: no cover

    async def late(prompt, **kwargs):
        raise RequestTimeout("the request ran past its timeout of 1 s")
        yield  # pragma: no cover

    client = TestClient(create_app(engine))
    for fn, status, code in ((full, 503, "queue_full"), (late, 408, "timeout")):
        replace_astream(monkeypatch, engine, fn)
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**BODY, "stream": stream})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    replace_astream(monkeypatch, engine, full)
    assert client.post("/v1/completions", json={"model": "tiny-0", "prompt": "abc"}).status_code == 503


def test_the_server_timeout_ends_a_slow_request_and_frees_its_lanes(engine, monkeypatch):
    """``--timeout`` reaches the engine's scheduler, which ends the request at a pass boundary: 408, no lane left."""
    import time

    step = engine.backend.step

    def slow_step(feeds, want=None):
        time.sleep(0.05)
        return step(feeds, want)

    monkeypatch.setattr(engine.backend, "step", slow_step)
    lanes_before = engine.backend.live_lanes
    client = TestClient(create_app(engine, timeout=0.3))
    response = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 400})
    assert response.status_code == 408 and "timed out" in response.json()["error"]["message"]
    for _ in range(100):
        if engine.load_stats()["running"] == 0:
            break
        time.sleep(0.05)
    assert engine.load_stats()["running"] == 0 and engine.backend.live_lanes <= max(lanes_before, 1)


def test_an_engine_timeout_is_passed_on(engine, monkeypatch):
    seen = {}

    async def record(prompt, **kwargs):
        seen.update(kwargs)
        raise RequestTimeout("late")
        yield  # pragma: no cover

    replace_astream(monkeypatch, engine, record)
    response = TestClient(create_app(engine, timeout=12.5)).post("/v1/chat/completions", json=BODY)
    assert response.status_code == 408 and seen["timeout"] == 12.5


def test_failures_are_500_before_a_stream_and_an_error_event_inside_one(engine, monkeypatch):
    from ssr.result import StreamEvent

    async def broken(prompt, **kwargs):
        raise RuntimeError("the backend fell over")
        yield  # pragma: no cover

    async def breaks_later(prompt, **kwargs):
        yield StreamEvent("reasoning", "ab")
        raise RuntimeError("the backend fell over")

    client = TestClient(create_app(engine), raise_server_exceptions=False)
    replace_astream(monkeypatch, engine, broken)
    response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 500 and "the backend fell over" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "server_error"
    replace_astream(monkeypatch, engine, breaks_later)
    response = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[1])["choices"][0]["delta"] == {"reasoning_content": "ab"}
    assert "the backend fell over" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_the_request_reaches_the_engine_as_openai_messages_and_settings(engine, monkeypatch):
    seen = {}

    async def record(prompt, **kwargs):
        seen.update(prompt=prompt, **kwargs)
        raise QueueFull("full")
        yield  # pragma: no cover

    replace_astream(monkeypatch, engine, record)
    tools = [{"type": "function", "function": {"name": "ab", "parameters": {"type": "object"}}}]
    body = {"model": "tiny-0", "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 4,
            "stop": "zz", "tools": tools, "tool_choice": {"type": "function", "function": {"name": "ab"}},
            "reasoning_effort": "low",
            "messages": [{"role": "developer", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "ab", "arguments": '{"x": 1}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "done"}]}
    assert TestClient(create_app(engine)).post("/v1/chat/completions", json=body).status_code == 503
    assert seen["prompt"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ab", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1", "name": "ab"}]
    assert seen["max_tokens"] == 9 and seen["temperature"] == 0.5 and seen["top_p"] == 0.9 and seen["seed"] == 4
    assert seen["stop"] == ["zz"] and seen["tool_choice"] == "ab" and seen["tools"] == tools
    assert seen["config"].max_think_tokens == 128  # reasoning_effort "low"


def test_the_server_imports_without_the_adapters():
    code = ("import sys\n"
            "for name in ('langchain_core', 'langchain_ssr', 'llama_index', 'langchain_openai'):\n"
            "    sys.modules[name] = None\n"
            "import ssr.serve, ssr.serve.app, ssr.cli\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_serve_command_and_its_options(capsys):
    from ssr.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--backend", "--host", "--port", "--api-key", "--timeout", "--max-queue"):
        assert option in text
    assert "127.0.0.1" in text
