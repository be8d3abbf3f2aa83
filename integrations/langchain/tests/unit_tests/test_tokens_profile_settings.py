"""ChatSSR: token counting, the model profile, usage with cache reads, the server backend's key, timeout and
retries, serialisation, constructor checking, and the reasoning settings (issue 19, issue 14 item 4).

Counting and the profile run on the real default model's tokenizer and config (no weights); the generation tests
run on a real ``SSREngine`` over the scripted backend (see ``scripted.py``); the server tests talk to real TCP
servers on 127.0.0.1 (see ``servers.py``).
"""

from __future__ import annotations

import logging

import pytest
from langchain_core.load import dumpd, dumps, load
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from servers import TcpServer, call_with_deadline, free_port

import ssr
import ssr.models
from langchain_ssr import ChatSSR
from langchain_ssr import chat_models
from langchain_ssr.chat_models import convert_messages
from ssr.settings import REASONING_EFFORT_BUDGETS
from ssr import SSRConfig
from ssr.backends.vllm_server import SSRBackendConnectionError, SSRBackendTimeout, VLLMServerBackend
from ssr.chat import THINK_INSTRUCTION

CONFIG = SSRConfig(max_think_tokens=64, draft_start=4, max_tokens=256)
KEY = "sk-ssr-test-4f1c9e0b7d2a"


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"It is sunny in {city}."


@tool
def get_time(city: str, utc: bool = False) -> str:
    """Current time in a city."""
    return "12:00"


CONVERSATION = [
    SystemMessage("You are terse."),
    HumanMessage("What is the weather in Paris?"),
    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
    ToolMessage("It is sunny in Paris.", tool_call_id="call_1"),
    HumanMessage("And in Rome?"),
]


@pytest.fixture
def engine(tokenizer):
    from scripted import scripted_engine

    return scripted_engine(tokenizer, CONFIG)


def scripted(engine, answer: str, reasoning: str = "Short thought.", **params) -> ChatSSR:
    engine.backend.set_script(reasoning, answer)
    return ChatSSR(engine=engine, **params)


# -- token counting ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, tool_choice", [
    (None, None),
    ([get_weather, get_time], None),
    ([get_weather, get_time], "any"),
    ([get_weather, get_time], "get_time"),
    ([get_weather], True),
])
def test_message_counts_equal_the_engines_prompt_length(engine, no_network, tools, tool_choice):
    llm = ChatSSR()  # no engine: the tokenizer alone, loaded here with sockets blocked
    count = llm.get_num_tokens_from_messages(CONVERSATION, tools=tools, tool_choice=tool_choice)
    openai_tools = [convert_to_openai_tool(t) for t in tools] if tools else None
    choice = chat_models._tool_choice(tool_choice, openai_tools) if tool_choice is not None else None
    assert count == len(engine.encode(convert_messages(CONVERSATION), openai_tools, choice))
    assert llm._loaded is None


def test_counts_equal_the_prompt_the_engine_prefills(engine, no_network):
    counter = ChatSSR()
    for tools, kwargs in ((None, {}), ([get_weather], {"tool_choice": "get_weather"})):
        llm = scripted(engine, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
        runnable = llm.bind_tools(tools, **kwargs) if tools else llm
        msg = runnable.invoke(CONVERSATION)
        expected = counter.get_num_tokens_from_messages(CONVERSATION, tools=tools, **kwargs)
        assert msg.usage_metadata["input_tokens"] == expected == len(engine.backend.prompts[-1])


def test_text_counts_and_token_ids(tokenizer, no_network):
    llm = ChatSSR()
    text = "def is_even(n):\n    return n % 2 == 0  # ünïcode"
    assert llm.get_token_ids(text) == tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_num_tokens(text) == len(tokenizer.encode(text, add_special_tokens=False))
    assert llm.get_num_tokens_from_messages([]) == 0
    assert ChatSSR(custom_get_token_ids=lambda t: [1, 2, 3]).get_num_tokens(text) == 3


def test_counts_use_a_loaded_engines_tokenizer(engine, monkeypatch):
    monkeypatch.setattr(ssr.models, "_tokenizers", {})
    llm = ChatSSR(engine=engine)
    assert llm.get_num_tokens_from_messages(CONVERSATION) == len(engine.encode(convert_messages(CONVERSATION)))
    assert ssr.models._tokenizers == {}  # the engine's own tokenizer and family were used


# -- the profile ------------------------------------------------------------------------------------------------


def test_profile_matches_the_model_config(no_network):
    from transformers import AutoConfig

    from ssr.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None), local_files_only=True)
    profile = ChatSSR().profile
    assert profile["max_input_tokens"] == config.max_position_embeddings == 32768
    assert profile["name"] == "qwen2.5-coder-0.5b-instruct"
    assert profile["max_output_tokens"] == SSRConfig().max_tokens
    assert profile["reasoning_output"] is True
    assert profile["reasoning_effort_levels"] == ["low", "medium", "high"]
    assert profile["tool_calling"] and profile["tool_choice"] and profile["tool_call_streaming"]
    assert profile["structured_output"] is True  # grammar-constrained JSON answers and calls (ssr.grammar)
    assert profile["text_inputs"] and not profile["image_inputs"]
    assert ChatSSR(max_tokens=77).profile["max_output_tokens"] == 77
    assert ChatSSR(ssr_config=SSRConfig(max_tokens=99)).profile["max_output_tokens"] == 99


def test_profile_of_a_given_engine(engine):
    profile = ChatSSR(engine=engine).profile
    assert profile["max_input_tokens"] == engine.context_window
    assert profile["name"] == "scripted"
    assert profile["max_output_tokens"] == CONFIG.max_tokens


# -- usage: cache reads and reasoning ---------------------------------------------------------------------------


def test_cache_read_is_the_reused_prompt_on_the_next_step(tokenizer):
    from scripted import scripted_engine

    engine = scripted_engine(tokenizer, CONFIG, reuse_prefix=True)
    llm = scripted(engine, "It is sunny.")
    first = llm.invoke([HumanMessage("Weather in Paris?")])
    second_prompt = [HumanMessage("Weather in Paris?"), first, HumanMessage("And in Rome?")]
    second = llm.invoke(second_prompt)
    reused = second.response_metadata["ssr"]["reused_prompt_tokens"]
    assert reused > 0
    assert second.usage_metadata["input_token_details"] == {"cache_read": reused}
    assert second.usage_metadata["output_token_details"] == {"reasoning": second.response_metadata["ssr"]["think_tokens"]}
    streamed = None
    for chunk in llm.stream(second_prompt):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == \
        streamed.response_metadata["ssr"]["reused_prompt_tokens"] > 0


def test_cache_salt_scopes_the_cache_read(tokenizer):
    """vLLM's ``cache_salt``, as a field and per call (the call's replacing the field's): a step reads from the
    cache only a prompt that an earlier call of its own salt left there."""
    from scripted import scripted_engine

    engine = scripted_engine(tokenizer, CONFIG, reuse_prefix=True)
    alice, shared = scripted(engine, "It is sunny.", cache_salt="alice"), ChatSSR(engine=engine)
    first = alice.invoke([HumanMessage("Weather in Paris?")])
    nxt = [HumanMessage("Weather in Paris?"), first, HumanMessage("And in Rome?")]

    def cache_read(message: AIMessage) -> int:
        assert message.usage_metadata["input_token_details"]["cache_read"] == \
            message.response_metadata["ssr"]["reused_prompt_tokens"]
        return message.usage_metadata["input_token_details"]["cache_read"]

    assert cache_read(shared.invoke(nxt)) == 0  # alice's prompt is not the unsalted cache's
    assert cache_read(shared.invoke(nxt, cache_salt="bob")) == 0  # nor is the unsalted prompt bob's
    assert cache_read(alice.invoke(nxt, cache_salt="bob")) > 0  # bob's, read by a call salted bob
    with pytest.raises(ValueError):
        ChatSSR(engine=engine, cache_salt="")


# -- the API key, timeout and retries of the server backend -----------------------------------------------------


def test_api_key_is_secret_everywhere(monkeypatch, caplog):
    monkeypatch.delenv("SSR_API_KEY", raising=False)
    llm = ChatSSR(backend="vllm-server", api_key=KEY, timeout=5, max_retries=1)
    assert llm.api_key.get_secret_value() == KEY
    for text in (repr(llm), str(llm), dumps(llm), str(dumpd(llm)), str(llm._identifying_params),
                 str(llm._get_ls_params()), llm.model_dump_json()):
        assert KEY not in text
    assert dumpd(llm)["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["SSR_API_KEY"]}
    assert KEY not in repr(llm._backend_kwargs())  # the engine registry keys engines by this repr
    monkeypatch.setenv("SSR_API_KEY", KEY)
    assert ChatSSR().api_key.get_secret_value() == KEY  # read from the environment by default
    moved = ChatSSR(backend="vllm-server", backend_kwargs={"api_key": KEY, "base_url": "http://127.0.0.1:1"})
    assert moved.backend_kwargs == {"base_url": "http://127.0.0.1:1"} and moved.api_key.get_secret_value() == KEY
    assert KEY not in dumps(moved) and KEY not in repr(moved)


def test_server_timeout_is_a_clear_error_and_the_key_stays_out_of_logs(monkeypatch, caplog):
    monkeypatch.delenv("SSR_API_KEY", raising=False)
    caplog.set_level(logging.DEBUG)
    with TcpServer() as server:  # accepts, reads the request, never answers
        llm = ChatSSR(backend="vllm-server", backend_kwargs={"base_url": server.url}, api_key=KEY, timeout=0.5,
                      max_retries=3)
        _, error = call_with_deadline(lambda: llm.invoke("hi"), seconds=60)
        assert isinstance(error, SSRBackendTimeout)
        assert "timeout of 0.5 s" in str(error) and server.url in str(error)
        assert server.connections == 1  # a timeout is not retried
        assert f"Authorization: Bearer {KEY}".encode() in server.requests[0]  # the key did reach the server
    assert KEY not in str(error) and KEY not in repr(error)
    assert KEY not in caplog.text


def test_server_connection_errors_are_retried(tokenizer):
    from ssr.models import resolve_model

    models = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 2048}]}
    with TcpServer(drop_first=2, models=models) as server:  # drops two connections, then answers
        backend = VLLMServerBackend(resolve_model(None), base_url=server.url, timeout=10, max_retries=2)
        assert backend.served_model == "tiny" and backend.context_window == 2048
        assert server.connections == 3
        backend.close()
    with TcpServer(drop_first=5, models=models) as server:
        with pytest.raises(SSRBackendConnectionError, match=r"after 2 attempts; max_retries=1"):
            VLLMServerBackend(resolve_model(None), base_url=server.url, timeout=10, max_retries=1)
        assert server.connections == 2


def test_adapter_max_retries_reaches_the_backend():
    llm = ChatSSR(backend="vllm-server", backend_kwargs={"base_url": f"http://127.0.0.1:{free_port()}"},
                  max_retries=1, timeout=5)
    with pytest.raises(SSRBackendConnectionError, match=r"cannot reach .*after 2 attempts; max_retries=1"):
        llm.invoke("hi")


# -- serialisation ----------------------------------------------------------------------------------------------


def test_dumpd_load_round_trip_without_secrets(monkeypatch):
    monkeypatch.setenv("SSR_API_KEY", KEY)
    llm = ChatSSR(model="qwen2.5-coder-0.5b-instruct", backend="vllm-server",
                  backend_kwargs={"base_url": "http://127.0.0.1:8000"}, num_predict=64, temperature=0.2,
                  stop=["END"], reasoning=False, reasoning_effort="low", timeout=30, max_retries=4,
                  ssr_config=SSRConfig(max_think_tokens=96, draft_start=8, stop=("x",)))
    data = dumpd(llm)
    assert data["id"] == ["langchain_ssr", "chat_models", "ChatSSR"]
    assert KEY not in dumps(llm)
    assert data["kwargs"]["ssr_config"]["max_think_tokens"] == 96  # a plain dict, not "not_implemented"
    restored = load(data, valid_namespaces=["langchain_ssr"], allowed_objects=[ChatSSR], secrets_from_env=True)
    assert isinstance(restored, ChatSSR)
    assert restored.asdict() == llm.asdict()
    assert restored.ssr_config == llm.ssr_config
    for name in ("model", "backend", "backend_kwargs", "max_tokens", "temperature", "stop", "reasoning",
                 "reasoning_effort", "timeout", "max_retries"):
        assert getattr(restored, name) == getattr(llm, name), name
    assert restored.api_key.get_secret_value() == KEY  # from the environment, not from the serialised text


# -- constructor arguments --------------------------------------------------------------------------------------


def test_unknown_constructor_arguments_are_an_error():
    with pytest.raises(TypeError) as err:
        ChatSSR(num_ctx=4096)
    message = str(err.value)
    assert "num_ctx" in message and "max_tokens" in message and "reasoning_effort" in message
    assert "num_predict" in message  # the close match is suggested
    with pytest.raises(TypeError, match="give only one"):
        ChatSSR(max_tokens=5, num_predict=6)


@pytest.mark.parametrize("alias", ["max_tokens", "max_completion_tokens", "num_predict"])
def test_max_tokens_aliases(engine, alias):
    assert ChatSSR(**{alias: 7}).max_tokens == 7
    llm = scripted(engine, "one two three four five six seven eight nine ten eleven twelve", reasoning="")
    msg = llm.invoke("count", **{alias: 6})
    assert msg.usage_metadata["output_tokens"] == 6 and msg.response_metadata["finish_reason"] == "length"
    msg = scripted(engine, "one two three four five six seven eight nine ten", reasoning="", **{alias: 5}).invoke("x")
    assert msg.usage_metadata["output_tokens"] == 5


# -- reasoning toggle and effort --------------------------------------------------------------------------------


def test_reasoning_false_answers_without_thinking(engine):
    engine.backend.set_script("", "Paris.", thinking=False)
    for llm, kwargs in ((ChatSSR(engine=engine, reasoning=False), {}), (ChatSSR(engine=engine), {"reasoning": False})):
        msg = llm.invoke("Capital of France?", **kwargs)
        assert msg.content == "Paris."
        assert "reasoning_content" not in msg.additional_kwargs
        assert msg.usage_metadata["output_token_details"] == {"reasoning": 0}
        assert msg.response_metadata["ssr"]["think_tokens"] == 0
        prompt = engine.tokenizer.decode(engine.backend.prompts[-1])
        assert THINK_INSTRUCTION not in prompt and not prompt.endswith("<think>\n")  # the model's own template
        assert msg.usage_metadata["input_tokens"] == \
            ChatSSR(reasoning=False).get_num_tokens_from_messages([HumanMessage("Capital of France?")])
    engine.backend.set_script("Thinking.", "Paris.")
    assert ChatSSR(engine=engine, reasoning=True).invoke("Capital of France?").additional_kwargs["reasoning_content"]


def test_reasoning_effort_sets_the_thinking_budget(engine):
    assert REASONING_EFFORT_BUDGETS == {"low": 128, "medium": 512, "high": 2048}
    reasoning = " ".join(f"step{i}" for i in range(150))  # 490 tokens of thinking
    engine.backend.set_script(reasoning, "Done.")
    config = SSRConfig(max_think_tokens=256, min_think_tokens=200, draft_start=4, max_tokens=1024)
    low = ChatSSR(engine=engine, ssr_config=config, reasoning_effort="low").invoke("go")
    high = ChatSSR(engine=engine, ssr_config=config).invoke("go", reasoning_effort="high")
    plain = ChatSSR(engine=engine, ssr_config=config.override(min_think_tokens=0)).invoke("go")
    assert low.response_metadata["ssr"]["think_closed_by"] == "budget"
    assert high.response_metadata["ssr"]["think_closed_by"] == "model"
    assert plain.response_metadata["ssr"]["think_closed_by"] == "budget"  # ssr_config's 256 without an effort
    budget_low = low.response_metadata["ssr"]["think_tokens"] - low.response_metadata["ssr"]["forced_tokens"]
    budget_plain = plain.response_metadata["ssr"]["think_tokens"] - plain.response_metadata["ssr"]["forced_tokens"]
    assert budget_low == 128 and budget_plain == 256
    assert high.additional_kwargs["reasoning_content"] == reasoning and high.content == "Done."
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatSSR(engine=engine).invoke("go", reasoning_effort="extreme")
    with pytest.raises(ValueError):
        ChatSSR(reasoning_effort="extreme")


# -- the real model ---------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_model_reasoning_false_answers_directly():
    llm = ChatSSR(reasoning=False, max_tokens=40, temperature=0)
    msg = llm.invoke("What is 2 + 2? Answer with the number only.")
    assert "reasoning_content" not in msg.additional_kwargs
    assert "think>" not in msg.content and msg.content.strip()
    assert msg.response_metadata["ssr"]["think_tokens"] == 0
    assert msg.usage_metadata["input_tokens"] == \
        llm.get_num_tokens_from_messages([HumanMessage("What is 2 + 2? Answer with the number only.")])
