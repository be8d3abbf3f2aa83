"""``ssr serve`` as a real process on a tiny random model: the OpenAI client and raw HTTP against it, outputs
token-identical to the engine's, concurrent streams, the API key, and every bad request's status and message."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from serve_process import ServerProcess
from tiny_dir import CONTEXT, save_tiny_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.allow_hosts(["127.0.0.1"])  # pytest-socket: the clients reach this server and nothing else

KEY = "sk-ssr-test-key"
NAME = "tiny"
MAX = 40
NO_ARGS = [{"type": "function", "function": {"name": "ab", "description": "a tool without arguments",
                                             "parameters": {"type": "object", "properties": {},
                                                            "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server for the module, the API key from $SSR_API_KEY."""
    proc = ServerProcess(["--model", model_dir, "--served-model-name", NAME],
                         log=tmp_path_factory.mktemp("logs") / "tiny-server.log", api_key=KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same model in this process: the reference every output through the server must equal."""
    from ssr import SSREngine
    from ssr.costs import CostTable

    return SSREngine.from_pretrained(model_dir, costs=CostTable.flat())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST (no client library: the exact status and error body)."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{server.url}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


CONVERSATIONS = [
    [{"role": "user", "content": "abc de"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hh"},
                                                                           {"type": "text", "text": "h"}]}],
    [{"role": "user", "content": "xyz"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ab", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "abc"},
     {"role": "user", "content": "again"}],
]


def engine_messages(conversation):
    """The conversation as the server hands it to the engine: text content, call arguments parsed."""
    out = []
    for m in conversation:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


# -- the basics ----------------------------------------------------------------------------------------------------

def test_health_models_and_metrics(server):
    health = server.health()
    assert health["status"] == "ok" and health["model"] == NAME and "live_lanes" in health
    status, text = server.get("/metrics")
    assert status == 200 and "# TYPE ssr_requests_total counter" in text and "ssr_live_lanes " in text
    request = urllib.request.Request(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.loads(response.read())
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["max_model_len"] == CONTEXT
    request = urllib.request.Request(f"{server.url}/v1/models/nope", headers={"Authorization": f"Bearer {KEY}"})
    try:
        urllib.request.urlopen(request, timeout=30)
        raise AssertionError("an unknown model was found")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404 and json.loads(exc.read())["error"]["code"] == "model_not_found"


def test_api_key_is_enforced(server, client):
    body = {"model": NAME, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}
    status, error, headers = post(server, "/v1/chat/completions", body, key=None)
    assert status == 401 and "missing API key" in error["error"]["message"]
    assert error["error"]["code"] == "invalid_api_key" and headers.get("www-authenticate", "").lower() == "bearer"
    status, error, _ = post(server, "/v1/chat/completions", body, key="sk-wrong")
    assert status == 401 and error["error"]["message"] == "incorrect API key"
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "a"}, key=None)[0] == 401
    try:
        urllib.request.urlopen(f"{server.url}/v1/models", timeout=30)
        raise AssertionError("/v1/models answered without a key")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [NAME]
    assert server.get("/health")[0] == 200  # health and metrics stay open


# -- identical to the engine ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_is_token_identical_to_the_engine(client, engine, i):
    conversation = CONVERSATIONS[i]
    reference = engine.generate(engine_messages(conversation), max_tokens=MAX)
    response = client.chat.completions.create(model=NAME, messages=conversation, max_tokens=MAX, temperature=0,
                                              extra_body={"return_token_ids": True})
    ssr = response.model_extra["ssr"]
    assert ssr["token_ids"] == reference.token_ids
    message = response.choices[0].message
    assert message.content == reference.content
    assert message.model_extra.get("reasoning_content", "") == reference.reasoning
    assert response.choices[0].finish_reason == reference.finish_reason
    usage = response.usage
    assert usage.prompt_tokens == reference.prompt_tokens
    assert usage.completion_tokens == len(reference.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == reference.stats["think_tokens"]
    assert usage.prompt_tokens_details.cached_tokens == ssr["stats"]["reused_prompt_tokens"]
    assert ssr["stats"]["think_tokens"] == reference.stats["think_tokens"]
    assert response.model == NAME and response.id.startswith("chatcmpl-")


def test_cache_salt_scopes_the_reused_prompt(client):
    """vLLM's ``cache_salt``: a request reuses the cached prompt of an earlier one with its salt only (counted in
    ``cached_tokens``); an empty salt is a 400."""
    conversation = CONVERSATIONS[0]

    def cached(salt: str) -> int:
        response = client.chat.completions.create(model=NAME, messages=conversation, max_tokens=4, temperature=0,
                                                  extra_body={"cache_salt": salt})
        return response.usage.prompt_tokens_details.cached_tokens

    cached("alpha")
    assert cached("alpha") > 0
    assert cached("beta") == 0
    with pytest.raises(openai.BadRequestError):
        cached("")


def test_streamed_chat_is_token_identical_to_the_engine(client, engine):
    conversation = CONVERSATIONS[0]
    reference = engine.generate(engine_messages(conversation), max_tokens=MAX)
    stream = client.chat.completions.create(model=NAME, messages=conversation, max_tokens=MAX, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    reasoning, content, finish, usage, ssr, roles = "", "", None, None, None, []
    chunks = list(stream)
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        roles.append(delta.role)
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        if choice.finish_reason:
            finish, ssr = choice.finish_reason, chunk.model_extra["ssr"]
    assert roles[0] == "assistant"
    assert reasoning == reference.reasoning and content == reference.content
    assert finish == reference.finish_reason
    assert ssr["token_ids"] == reference.token_ids
    assert usage.completion_tokens == len(reference.token_ids)
    assert usage.completion_tokens_details.reasoning_tokens == reference.stats["think_tokens"]
    assert not chunks[-1].choices  # the usage chunk comes last, with no choices


def test_completions_are_raw_continuations_identical_to_the_engine(client, engine):
    prompt = "abc\nde"
    ids = engine.tokenizer.encode(prompt)
    reference = engine.generate(ids, thinking=False, max_tokens=MAX)
    response = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX,
                                         extra_body={"return_token_ids": True})
    assert response.choices[0].text == reference.answer
    assert response.model_extra["ssr"]["token_ids"] == reference.token_ids
    assert response.model_extra["ssr"]["prompt_token_ids"] == ids
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == len(reference.token_ids)
    streamed = client.completions.create(model=NAME, prompt=[ids], max_tokens=MAX, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.answer
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason


# -- concurrency ---------------------------------------------------------------------------------------------------

def test_eight_concurrent_streaming_clients_all_complete(server, engine):
    prompts = ["abc", "hhh", "xyz", "de de", "a b c", "zzz", "fgh", "cab"]
    references = [engine.generate([{"role": "user", "content": p}], max_tokens=MAX) for p in prompts]

    async def one(client, prompt):
        stream = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=MAX, stream=True,
                                                      extra_body={"return_token_ids": True})
        text, finish, ssr = "", None, None
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += ((delta.model_extra or {}).get("reasoning_content") or "") + (delta.content or "")
                if chunk.choices[0].finish_reason:
                    finish, ssr = chunk.choices[0].finish_reason, chunk.model_extra["ssr"]
        return text, finish, ssr

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    for (text, finish, ssr), reference in zip(results, references):
        assert finish == reference.finish_reason
        assert text == reference.reasoning + reference.content
        assert ssr["token_ids"] == reference.token_ids  # batched with others, float32: the same tokens
    assert server.health()["in_flight"] == 0


def test_async_client_gets_the_same_answer(server, engine):
    reference = engine.generate([{"role": "user", "content": "abc de"}], max_tokens=MAX)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
            return await client.chat.completions.create(model=NAME, max_tokens=MAX,
                                                        messages=[{"role": "user", "content": "abc de"}])

    response = asyncio.run(main())
    assert response.choices[0].message.content == reference.content
    assert response.choices[0].message.model_extra.get("reasoning_content", "") == reference.reasoning


# -- bad requests --------------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "abc"}]
BAD_REQUESTS = [
    # (name, body, status, param, words in the message)
    ("unknown model", {"model": "gpt-9", "messages": USER}, 400, "model", ["unknown model 'gpt-9'", NAME]),
    ("unknown parameter", {"model": NAME, "messages": USER, "frobnicate": 1}, 400, "frobnicate",
     ["unknown parameter", "frobnicate"]),
    ("no messages", {"model": NAME, "messages": []}, 400, "messages", ["messages", "at least 1"]),
    ("missing messages", {"model": NAME}, 400, "messages", ["messages", "required"]),
    ("unknown role", {"model": NAME, "messages": [{"role": "wizard", "content": "a"}]}, 400, "messages[0]",
     ["wizard"]),
    ("missing content", {"model": NAME, "messages": [{"role": "user"}]}, 400, "messages[0].content",
     ["messages[0].content", "required"]),
    ("image part", {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0].type",
     ["text only", "image_url"]),
    ("tool result without id", {"model": NAME, "messages": USER + [{"role": "tool", "content": "x"}]}, 400,
     "messages[1].tool_call_id", ["tool_call_id", "required"]),
    ("bad call arguments", {"model": NAME, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ab", "arguments": "{oops"}}]}] + USER}, 400,
     "messages[0].tool_calls[0].function.arguments", ["not valid JSON"]),
    ("over-long prompt", {"model": NAME, "messages": [{"role": "user", "content": "a" * (CONTEXT + 10)}]}, 400,
     "messages", ["context window of 1024 tokens"]),
    ("n", {"model": NAME, "messages": USER, "n": 2}, 400, "n", ["n=2", "not supported"]),
    ("temperature", {"model": NAME, "messages": USER, "temperature": 3}, 400, "temperature",
     ["temperature", "less than or equal to 2"]),
    ("top_p", {"model": NAME, "messages": USER, "top_p": 0}, 400, "top_p", ["top_p", "greater than 0"]),
    ("max_tokens", {"model": NAME, "messages": USER, "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ("two token limits", {"model": NAME, "messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, 400,
     "max_completion_tokens", ["give only one"]),
    ("logprobs", {"model": NAME, "messages": USER, "logprobs": True}, 400, "logprobs", ["not supported"]),
    ("penalty", {"model": NAME, "messages": USER, "presence_penalty": 0.5}, 400, "presence_penalty",
     ["non-zero presence_penalty"]),
    ("functions", {"model": NAME, "messages": USER, "functions": [{"name": "f"}]}, 400, "functions",
     ["deprecated functions API"]),
    ("stream_options without stream", {"model": NAME, "messages": USER, "stream_options": {"include_usage": True}},
     400, "stream_options", ["stream: true"]),
    ("tool type", {"model": NAME, "messages": USER, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type",
     ["tools[0].type"]),
    ("tool name", {"model": NAME, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "bad name!"}}]}, 400, "tools[0].function.name", ["tool name 'bad name!'"]),
    ("tool parameters not an object schema", {"model": NAME, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "ab", "parameters": {"type": "string"}}}]}, 400,
     "tools[0].function.parameters", ["type 'object'"]),
    ("tool schema the grammar refuses", {"model": NAME, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "ab", "parameters": {
            "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]}, 400, "tools",
     ["schema", "frobnicate"]),
    ("duplicate tools", {"model": NAME, "messages": USER, "tools": NO_ARGS + NO_ARGS}, 400, "tools",
     ["more than once"]),
    ("tool_choice of no bound tool", {"model": NAME, "messages": USER, "tools": NO_ARGS,
                                      "tool_choice": {"type": "function", "function": {"name": "zz"}}}, 400,
     "tool_choice", ["'zz'", "not among"]),
    ("tool_choice without tools", {"model": NAME, "messages": USER, "tool_choice": "required"}, 400, "tool_choice",
     ["requires tools"]),
    ("bad response_format", {"model": NAME, "messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format", ["xml"]),
    ("response_format schema the grammar refuses", {"model": NAME, "messages": USER, "stream": True,
                                                    "response_format": {"type": "json_schema", "json_schema": {
                                                        "name": "x", "schema": {"type": "frob"}}}}, 400,
     "response_format", ["schema", "frob"]),
    ("response_format with tools", {"model": NAME, "messages": USER, "tools": NO_ARGS,
                                    "response_format": {"type": "json_object"}}, 400, "response_format",
     ["cannot both"]),
]


@pytest.mark.parametrize("name,body,status,param,words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_their_status_and_message(server, name, body, status, param, words):
    got, error, _ = post(server, "/v1/chat/completions", body)
    assert got == status, error
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    for word in words:
        assert word in error["error"]["message"], error


def test_bad_bodies_and_completions_errors(server, client):
    status, error, _ = post(server, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in error["error"]["message"]
    status, error, _ = post(server, "/v1/completions", {"model": NAME, "prompt": ["a", "b"]})
    assert status == 400 and "batch of 2 prompts" in error["error"]["message"]
    status, error, _ = post(server, "/v1/completions", {"model": NAME, "prompt": [1, 99999]})
    assert status == 400 and "outside the vocabulary" in error["error"]["message"]
    status, error, _ = post(server, "/v1/completions", {"model": NAME, "prompt": "a" * (CONTEXT + 1)})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    status, error, _ = post(server, "/v1/completions", {"model": NAME, "prompt": "a", "echo": True})
    assert status == 400 and "echo" in error["error"]["message"]
    status, error, _ = post(server, "/v1/nowhere", {})
    assert status == 404 and "no such endpoint" in error["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client.chat.completions.create(model="nope", messages=USER)


def test_default_client_fields_are_accepted(server):
    """What SDKs send unasked (user, zero penalties, logprobs false, parallel_tool_calls, ...) is no error."""
    body = {"model": NAME, "messages": USER, "max_tokens": 4, "user": "u1", "frequency_penalty": 0,
            "presence_penalty": 0.0, "logprobs": False, "n": 1, "parallel_tool_calls": True, "stream": False,
            "logit_bias": {}, "store": False, "metadata": {"a": "b"}, "seed": 3, "stop": ["zz"], "top_p": 1,
            "service_tier": "auto"}
    status, response, _ = post(server, "/v1/chat/completions", body)
    assert status == 200, response
    assert response["object"] == "chat.completion" and response["choices"][0]["message"]["role"] == "assistant"


def test_metrics_count_requests_and_tokens(server, client):
    before = server.metric("ssr_completion_tokens_total")
    done = server.metric("ssr_requests_total", '{endpoint="chat.completions",status="200"}')
    response = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8)
    assert server.metric("ssr_completion_tokens_total") == before + response.usage.completion_tokens
    assert server.metric("ssr_requests_total", '{endpoint="chat.completions",status="200"}') == done + 1
    refused = server.metric("ssr_requests_total", '{endpoint="chat.completions",status="400"}')
    assert post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, "n": 3})[0] == 400
    assert server.metric("ssr_requests_total", '{endpoint="chat.completions",status="400"}') == refused + 1
    assert server.metric("ssr_request_duration_seconds_count") >= done + 1
    assert "chat.completions 200" in server.log_text()  # one log line per request
