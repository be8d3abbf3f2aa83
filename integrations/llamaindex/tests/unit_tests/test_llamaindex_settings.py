"""The LlamaIndex SSR LLM: token counting and the tokenizer, metadata without weights, usage with cache reads,
the server backend's key, timeout and retries, constructor checking, and the thinking settings (issue 19, issue 14
item 4).

Counting and metadata run on the real default model's tokenizer and config; generation runs on a real
``SSREngine`` over the scripted backend the adapter tests share (``tests/scripted.py``, which needs only
``ssr``); the server test talks to a real TCP server on 127.0.0.1 (``tests/servers.py``).
"""

from __future__ import annotations

import logging

import pytest
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.tools import FunctionTool
from llama_index.llms.ssr import SSR
from llama_index.llms.ssr import base as ssr_base
from llama_index.llms.ssr.utils import resolve_tool_choice, to_engine_messages, tool_to_openai
from servers import TcpServer, call_with_deadline
from ssr import SSRConfig
from ssr.backends.vllm_server import SSRBackendTimeout
from ssr.chat import THINK_INSTRUCTION

CONFIG = SSRConfig(max_think_tokens=64, draft_start=4, max_tokens=256)
KEY = "sk-ssr-test-llamaindex-90ab"


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


MULTIPLY, ADD = FunctionTool.from_defaults(fn=multiply), FunctionTool.from_defaults(fn=add)

HISTORY = [
    ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
    ChatMessage(role=MessageRole.USER, content="6*7?"),
    ChatMessage(role=MessageRole.ASSISTANT, blocks=[
        ThinkingBlock(content="need the tool"), TextBlock(text=""),
        ToolCallBlock(tool_call_id="call_1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7})]),
    ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"tool_call_id": "call_1"}),
    ChatMessage(role=MessageRole.USER, content="And 2+3?"),
]


@pytest.fixture
def engine(tokenizer):
    from scripted import scripted_engine

    return scripted_engine(tokenizer, CONFIG)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


# -- token counting and the tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("tools, tool_choice, required", [
    (None, None, False),
    ([MULTIPLY, ADD], None, False),
    ([MULTIPLY, ADD], None, True),
    ([MULTIPLY, ADD], "add", False),
])
def test_message_counts_equal_the_engines_prompt_length(engine, no_network, tools, tool_choice, required):
    llm = SSR()  # no engine: the tokenizer alone, loaded here with sockets blocked
    count = llm.get_num_tokens_from_messages(HISTORY, tools=tools, tool_choice=tool_choice, tool_required=required)
    specs = [tool_to_openai(t) for t in tools] if tools else None
    choice = resolve_tool_choice(tool_choice, required) if tools else None
    assert count == len(engine.encode(to_engine_messages(HISTORY), specs, choice))
    assert llm._engine is None


def test_counts_equal_the_prompt_tokens_of_a_response(engine, no_network):
    engine.backend.set_script("Add them.", "5")
    response = SSR(engine=engine).chat(HISTORY)
    assert response.raw["usage"]["prompt_tokens"] == SSR().get_num_tokens_from_messages(HISTORY)
    engine.backend.set_script("Use add.", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    response = SSR(engine=engine).chat_with_tools([MULTIPLY, ADD], chat_history=HISTORY, tool_required=True)
    assert response.raw["usage"]["prompt_tokens"] == \
        SSR().get_num_tokens_from_messages(HISTORY, tools=[MULTIPLY, ADD], tool_required=True)


def test_tokenizer_for_llamaindex_token_counting(tokenizer, no_network):
    import llama_index.core
    from llama_index.core import Settings

    llm = SSR()
    text = "def is_even(n):\n    return n % 2 == 0  # ünïcode"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_token_ids(text) == ids and llm.get_num_tokens(text) == len(ids)
    previous = llama_index.core.global_tokenizer
    try:
        Settings.tokenizer = llm.tokenizer  # the Hugging Face tokenizer: LlamaIndex counts with its encode
        assert Settings.tokenizer(text) == ids
    finally:
        llama_index.core.global_tokenizer = previous


# -- metadata without weights -----------------------------------------------------------------------------------


def test_metadata_matches_the_model_config_without_loading_weights(no_network):
    from transformers import AutoConfig

    from ssr.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None), local_files_only=True)
    meta = SSR().metadata
    assert meta.context_window == config.max_position_embeddings == 32768
    assert meta.num_output == SSRConfig().max_tokens
    assert meta.model_name == "qwen2.5-coder-0.5b-instruct"
    assert meta.is_chat_model and meta.is_function_calling_model
    assert SSR(num_output=64).metadata.num_output == SSR(max_tokens=64).metadata.num_output == 64
    assert SSR(ssr_config=SSRConfig(max_tokens=99)).metadata.num_output == 99


# -- usage: cache reads -----------------------------------------------------------------------------------------


def test_cached_tokens_are_the_reused_prompt_on_the_next_step(tokenizer):
    from scripted import scripted_engine

    engine = scripted_engine(tokenizer, CONFIG, reuse_prefix=True)
    engine.backend.set_script("Multiply.", "42")
    llm = SSR(engine=engine)
    first = llm.chat(user("6*7?"))
    second = llm.chat([*user("6*7?"), first.message, *user("And 6*8?")])
    reused = second.additional_kwargs["ssr"]["reused_prompt_tokens"]
    assert reused > 0
    usage = second.raw["usage"]
    assert usage["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == reused
    assert second.additional_kwargs["cached_tokens"] == reused
    assert usage["completion_tokens_details"]["reasoning_tokens"] == second.additional_kwargs["ssr"]["think_tokens"]
    last = list(llm.stream_chat([*user("6*7?"), first.message, *user("And 6*8?")]))[-1]
    assert last.raw["usage"]["cached_tokens"] == last.additional_kwargs["ssr"]["reused_prompt_tokens"] > 0


def test_cache_salt_scopes_the_cached_tokens(tokenizer):
    """vLLM's ``cache_salt``, as a field and per call (the call's replacing the field's): a step reads from the
    cache only a prompt that an earlier call of its own salt left there."""
    from scripted import scripted_engine

    engine = scripted_engine(tokenizer, CONFIG, reuse_prefix=True)
    engine.backend.set_script("Multiply.", "42")
    alice, shared = SSR(engine=engine, cache_salt="alice"), SSR(engine=engine)
    first = alice.chat(user("6*7?"))
    nxt = [*user("6*7?"), first.message, *user("And 6*8?")]

    def cached(response: ChatResponse) -> int:
        assert response.raw["usage"]["cached_tokens"] == response.additional_kwargs["ssr"]["reused_prompt_tokens"]
        return response.raw["usage"]["cached_tokens"]

    assert cached(shared.chat(nxt)) == 0  # alice's prompt is not the unsalted cache's
    assert cached(shared.chat(nxt, cache_salt="bob")) == 0  # nor is the unsalted prompt bob's
    assert cached(alice.chat(nxt, cache_salt="bob")) > 0  # bob's, read by a call salted bob
    with pytest.raises(ValueError):
        SSR(engine=engine, cache_salt="")


# -- the API key and the server backend's timeout ---------------------------------------------------------------


def test_api_key_is_secret(monkeypatch):
    monkeypatch.delenv("SSR_API_KEY", raising=False)
    llm = SSR(backend="vllm-server", api_key=KEY, timeout=5, max_retries=1)
    assert llm.api_key.get_secret_value() == KEY
    for text in (repr(llm), str(llm), str(llm.to_dict()), llm.to_json()):
        assert KEY not in text
    assert KEY not in repr(llm._backend_kwargs())
    restored = SSR.from_json(llm.to_json())
    assert (restored.backend, restored.timeout, restored.max_retries) == ("vllm-server", 5, 1)
    monkeypatch.setenv("SSR_API_KEY", KEY)
    assert SSR().api_key.get_secret_value() == KEY
    moved = SSR(backend_kwargs={"api_key": KEY})
    assert moved.backend_kwargs == {} and moved.api_key.get_secret_value() == KEY


def test_server_timeout_is_a_clear_error_and_the_key_stays_out_of_logs(monkeypatch, caplog):
    monkeypatch.delenv("SSR_API_KEY", raising=False)
    caplog.set_level(logging.DEBUG)
    with TcpServer() as server:  # accepts, reads the request, never answers
        llm = SSR(backend="vllm-server", backend_kwargs={"base_url": server.url}, api_key=KEY, timeout=0.5)
        _, error = call_with_deadline(lambda: llm.chat(user("hi")), seconds=60)
        assert isinstance(error, SSRBackendTimeout)
        assert "timeout of 0.5 s" in str(error)
        assert server.connections == 1
        assert f"Authorization: Bearer {KEY}".encode() in server.requests[0]
    assert KEY not in str(error) and KEY not in caplog.text


# -- constructor arguments --------------------------------------------------------------------------------------


def test_unknown_constructor_arguments_are_an_error():
    with pytest.raises(TypeError) as err:
        SSR(num_predict=5)
    message = str(err.value)
    assert "num_predict" in message and "max_tokens" in message and "num_output" in message
    with pytest.raises(TypeError, match="give only one"):
        SSR(max_tokens=5, num_output=6)
    assert SSR.from_dict(SSR(num_output=12).to_dict()).max_tokens == 12


def test_num_output_per_call(engine):
    engine.backend.set_script("", "one two three four five six seven eight nine ten")
    response = SSR(engine=engine).chat(user("count"), num_output=6)
    assert response.raw["usage"]["completion_tokens"] == 6 and response.raw["finish_reason"] == "length"


# -- thinking toggle and reasoning effort -----------------------------------------------------------------------


def test_thinking_false_answers_without_thinking(engine):
    engine.backend.set_script("", "42", thinking=False)
    for llm, kwargs in ((SSR(engine=engine, thinking=False), {}), (SSR(engine=engine), {"thinking": False})):
        response = llm.chat(user("6*7?"), **kwargs)
        assert response.message.content == "42"
        assert not any(isinstance(b, ThinkingBlock) for b in response.message.blocks)
        assert response.additional_kwargs["ssr"]["think_tokens"] == 0
        prompt = engine.tokenizer.decode(engine.backend.prompts[-1])
        assert THINK_INSTRUCTION not in prompt and not prompt.endswith("<think>\n")
        assert response.raw["usage"]["prompt_tokens"] == SSR(thinking=False).get_num_tokens_from_messages(user("6*7?"))
    chunks = list(SSR(engine=engine, thinking=False).stream_chat(user("6*7?")))
    assert chunks[-1].message.content == "42" and not "".join(c.additional_kwargs["thinking_delta"] for c in chunks)


def test_reasoning_effort_sets_the_thinking_budget(engine):
    assert ssr_base.REASONING_EFFORT_BUDGETS == {"low": 128, "medium": 512, "high": 2048}
    reasoning = " ".join(f"step{i}" for i in range(150))  # 490 tokens of thinking
    engine.backend.set_script(reasoning, "Done.")
    config = SSRConfig(max_think_tokens=256, min_think_tokens=200, draft_start=4, max_tokens=1024)
    low = SSR(engine=engine, ssr_config=config, reasoning_effort="low").chat(user("go")).additional_kwargs["ssr"]
    high = SSR(engine=engine, ssr_config=config).chat(user("go"), reasoning_effort="high")
    assert low["think_closed_by"] == "budget" and low["think_tokens"] - low["forced_tokens"] == 128
    assert high.additional_kwargs["ssr"]["think_closed_by"] == "model" and high.message.content == "Done."
    with pytest.raises(ValueError, match="reasoning_effort"):
        SSR(engine=engine).chat(user("go"), reasoning_effort="extreme")
