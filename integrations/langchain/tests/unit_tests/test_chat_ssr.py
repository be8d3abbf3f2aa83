"""ChatSSR's own tests.

Adapter logic runs on a real ``SSREngine`` whose backend replays a scripted chain of thought and answer (see
``scripted.py``): drafting, verification, streaming and tool-call parsing are the engine's own, and the text is
known in advance. The tests marked ``real_model`` run the embedded default model (Qwen2.5-Coder-0.5B-Instruct).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langchain_ssr import ChatSSR
from langchain_ssr.chat_models import _tool_choice, convert_messages
from ssr import SSRConfig

CONFIG = SSRConfig(max_think_tokens=64, draft_start=4, max_tokens=256)
REASONING = "The user wants the weather. I should call the weather tool with the city."


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"It is sunny in {city}."


@tool
def get_time(city: str, utc: bool = False) -> str:
    """Current time in a city."""
    return "12:00"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Person(BaseModel):
    """A person."""

    name: str = Field(description="first name")
    age: int = Field(description="age in years")


class PersonDict(TypedDict):
    """A person."""

    name: str
    age: int


@pytest.fixture
def engine(tokenizer):
    from scripted import scripted_engine

    return scripted_engine(tokenizer, CONFIG)


# the model writes calls freely (no call grammar): what the parser makes of malformed calls
FREE_CALLS = CONFIG.override(constrain_tool_calls=False)


def scripted(engine, answer: str, reasoning: str = REASONING, **params: Any) -> ChatSSR:
    """ChatSSR over the scripted engine; a scripted chain of thought is a thinking turn (``reasoning=True``: with
    tools under "auto" the default would answer at once, ``ssr.chat.resolve_thinking``)."""
    engine.backend.set_script(reasoning, answer)
    if reasoning:
        params.setdefault("reasoning", True)
    return ChatSSR(engine=engine, **params)


def last_prompt(engine) -> str:
    return engine.tokenizer.decode(engine.backend.prompts[-1])


def collect(chunks) -> AIMessageChunk:
    full = None
    for chunk in chunks:
        assert isinstance(chunk, AIMessageChunk)
        full = chunk if full is None else full + chunk
    return full


async def acollect(chunks) -> AIMessageChunk:
    full = None
    async for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full


def without_index(content, drop=("index",)):
    if isinstance(content, str):
        return content
    return [{k: v for k, v in block.items() if k not in drop} for block in content]


def comparable_metadata(message) -> dict:
    """response_metadata without wall-clock fields (two runs never take the same time) and the cost model's online
    figures (each request updates the acceptance rates the next one is priced with)."""
    meta = dict(message.response_metadata)
    stats = dict(meta.pop("ssr"))
    for key in ("seconds", "time_to_think_end", "time_to_first_answer_token", "cost_model"):
        stats.pop(key, None)
    return {**meta, "ssr": stats}


# -- construction and identity ------------------------------------------------------------------------------------


def test_construction_is_lazy(monkeypatch):
    import ssr

    calls = []
    monkeypatch.setattr(ssr, "get_engine", lambda *a, **k: calls.append(a))
    llm = ChatSSR(model="qwen2.5-coder-0.5b-instruct", ssr_config=SSRConfig(enabled=False), temperature=0.5)
    assert calls == []
    assert llm._llm_type == "chat-ssr"
    assert llm._identifying_params["ssr_config"]["enabled"] is False
    params = llm._get_ls_params(stop=["x"])
    assert params["ls_provider"] == "ssr" and params["ls_model_name"] == "qwen2.5-coder-0.5b-instruct"
    assert params["ls_temperature"] == 0.5 and params["ls_stop"] == ["x"]
    assert params["ls_max_tokens"] == 1024  # from the SSRConfig default
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"


def test_engine_is_shared_per_model_and_backend(monkeypatch):
    import ssr

    calls = []
    monkeypatch.setattr(ssr, "get_engine", lambda *a, **k: calls.append(a) or object())
    llm = ChatSSR(backend="transformers")
    assert llm._get_engine() is llm._get_engine()
    assert calls == [(None, "transformers")]
    llm._get_engine("qwen2.5-coder-1.5b-instruct")  # a per-call model override goes through the shared cache
    assert calls[-1] == ("qwen2.5-coder-1.5b-instruct", "transformers")


def test_close_frees_the_loaded_engine_and_the_next_call_loads_again(monkeypatch):
    import ssr
    from tiny import tiny_engine

    loaded = []
    monkeypatch.setattr(ssr, "get_engine", lambda *a, **k: loaded.append(tiny_engine()) or loaded[-1])
    llm = ChatSSR()
    first = llm._get_engine()
    first.generate([5, 6, 7], config=SSRConfig(max_think_tokens=2, max_tokens=4))  # token ids: no template
    llm.close()
    assert first.closed and first.backend.live_lanes == 0
    assert llm._get_engine() is loaded[1] and len(loaded) == 2
    llm.close()


# -- reasoning separation -----------------------------------------------------------------------------------------


def test_reasoning_kept_out_of_content(engine):
    llm = scripted(engine, "Hello! How can I help?", reasoning="The user greets me. Greet back.")
    msg = llm.invoke("Hello")
    assert msg.content == "Hello! How can I help?"
    assert msg.additional_kwargs["reasoning_content"] == "The user greets me. Greet back."
    assert "think>" not in msg.content
    blocks = msg.content_blocks
    assert [b["type"] for b in blocks] == ["reasoning", "text"]
    assert blocks[0]["reasoning"] == "The user greets me. Greet back."
    assert msg.text == "Hello! How can I help?"


def test_reasoning_block_first_in_v1_output(engine):
    llm = scripted(engine, "Hi there.", output_version="v1")
    msg = llm.invoke("Hello")
    assert isinstance(msg.content, list)
    assert [b["type"] for b in msg.content] == ["reasoning", "text"]
    assert msg.content[0]["reasoning"] == REASONING
    assert msg.text == "Hi there."
    full = collect(llm.stream("Hello"))
    assert [b["type"] for b in full.content_blocks] == ["reasoning", "text"]
    assert full.content_blocks[0]["reasoning"] == REASONING and full.text == "Hi there."


def test_no_reasoning_key_when_there_is_no_reasoning(engine):
    llm = scripted(engine, "Direct answer.", reasoning="")
    msg = llm.invoke("Hello")
    assert "reasoning_content" not in msg.additional_kwargs
    assert [b["type"] for b in msg.content_blocks] == ["text"]


def test_usage_and_response_metadata(engine):
    llm = scripted(engine, "Hello!")
    msg = llm.invoke("Hello")
    res = engine.generate("Hello", config=CONFIG)  # the same request straight to the engine
    usage = msg.usage_metadata
    assert usage["input_tokens"] == res.prompt_tokens
    assert usage["output_tokens"] == len(res.token_ids)
    assert usage["total_tokens"] == res.prompt_tokens + len(res.token_ids)
    assert usage["output_token_details"] == {"reasoning": res.stats["think_tokens"]}
    meta = msg.response_metadata
    assert meta["model_name"] == "scripted" and meta["model_provider"] == "ssr"
    assert meta["finish_reason"] == "stop"
    assert set(meta["ssr"]) == set(res.stats)
    assert meta["ssr"]["accepted_tokens"] > 0  # the scripted drafts are right, so SSR accepts them


# -- tool calls through the adapter -------------------------------------------------------------------------------


def _call(tool_name: str, /, **args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": tool_name, "arguments": args})}\n</tool_call>'


def test_several_tool_calls(engine):
    answer = _call("get_weather", city="Paris") + "\n" + _call("get_time", city="Rome", utc=True)
    llm = scripted(engine, answer).bind_tools([get_weather, get_time])
    msg = llm.invoke("Weather in Paris and time in Rome?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                ("get_time", {"city": "Rome", "utc": True})]
    assert all(c["id"] and c["type"] == "tool_call" for c in msg.tool_calls)
    assert len({c["id"] for c in msg.tool_calls}) == 2
    assert msg.content == "" and msg.invalid_tool_calls == []
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert [b["type"] for b in msg.content_blocks] == ["reasoning", "tool_call", "tool_call"]


def test_tool_call_in_code_fence(engine):
    answer = 'Calling the tool.\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    msg = scripted(engine, answer).bind_tools([get_weather]).invoke("Weather in Oslo?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert msg.content == "Calling the tool."


def test_bare_json_tool_call(engine):
    answer = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    msg = scripted(engine, answer).bind_tools([get_weather]).invoke("Weather in Lima?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Lima"})]
    assert msg.content == ""


def test_truncated_tool_call_json_is_invalid_not_an_error(engine):
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    msg = scripted(engine, answer, ssr_config=FREE_CALLS).bind_tools([get_weather]).invoke("Weather in Paris?")
    assert msg.tool_calls == []
    [bad] = msg.invalid_tool_calls
    assert bad["name"] == "get_weather" and bad["id"] and "JSON" in bad["error"]
    assert bad["args"] == '{"city": "Par'  # the unparsed arguments, as LangChain's InvalidToolCall has them
    assert msg.content == ""


def test_unknown_tool_name_is_a_call_the_tool_node_rejects(engine):
    # as with ChatOpenAI: a well-formed call goes to the executor, whose error the model reads on the next turn
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    answer = _call("get_stock_price", ticker="ACME")
    msg = scripted(engine, answer, ssr_config=FREE_CALLS).bind_tools([get_weather]).invoke("ACME price?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_stock_price", {"ticker": "ACME"})]
    assert msg.invalid_tool_calls == []
    [error] = msg.response_metadata["tool_call_errors"]
    assert error["id"] == msg.tool_calls[0]["id"] and "unknown tool" in error["error"]
    graph = StateGraph(MessagesState)  # the tool step of an agent graph (create_agent's), alone
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    [_, reply] = graph.compile().invoke({"messages": [msg]})["messages"]
    assert reply.tool_call_id == msg.tool_calls[0]["id"] and reply.status == "error"
    assert "get_stock_price is not a valid tool" in reply.content


def test_call_ids_are_the_same_for_the_same_request(engine):
    # an agent's next prompt quotes ids back (create_agent's reply to an unparsed call): reruns must see the same
    llm = scripted(engine, _call("get_weather", city="Paris")).bind_tools([get_weather])
    first, again, other = llm.invoke("Weather?"), llm.invoke("Weather?"), llm.invoke("Weather in Paris?")
    streamed = collect(llm.stream("Weather?"))
    assert first.tool_calls[0]["id"] == again.tool_calls[0]["id"] == streamed.tool_calls[0]["id"]
    assert other.tool_calls[0]["id"] != first.tool_calls[0]["id"]


def test_arguments_failing_the_schema_are_calls_with_the_schema_errors(engine):
    answer = _call("get_weather", town="Paris") + "\n" + _call("get_weather", city=7)
    msg = scripted(engine, answer, ssr_config=FREE_CALLS).bind_tools([get_weather]).invoke("Weather?")
    assert [c["args"] for c in msg.tool_calls] == [{"town": "Paris"}, {"city": 7}] and msg.invalid_tool_calls == []
    errors = [e["error"] for e in msg.response_metadata["tool_call_errors"]]
    assert "'city' is a required property" in errors[0] and "7 is not of type 'string'" in errors[1]


def test_call_that_is_not_an_object_is_invalid(engine):
    msg = scripted(engine, '<tool_call>\n["get_weather", "Paris"]\n</tool_call>', ssr_config=FREE_CALLS).bind_tools([get_weather]).invoke("x")
    [bad] = msg.invalid_tool_calls
    assert bad["name"] is None and bad["args"] == '["get_weather", "Paris"]' and bad["error"]


def test_valid_and_invalid_calls_together(engine):
    unparsed = '<tool_call>\n{"name": "nope", "arguments": {"x": 1}\n</tool_call>'  # a brace short
    answer = _call("get_weather", city="Paris") + "\n" + unparsed
    msg = scripted(engine, answer, ssr_config=FREE_CALLS).bind_tools([get_weather]).invoke("Weather?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert [c["name"] for c in msg.invalid_tool_calls] == ["nope"] and "tool_call_errors" not in msg.response_metadata


def test_without_bound_tools_markup_stays_text(engine):
    answer = _call("get_weather", city="Paris")
    msg = scripted(engine, answer).invoke("Weather?")
    assert msg.tool_calls == [] and msg.content == answer


@pytest.mark.parametrize("spec", [get_weather, WEATHER, Person, PersonDict, Person.model_json_schema()],
                         ids=["tool", "openai-dict", "pydantic", "typeddict", "json-schema"])
def test_bind_tools_formats_reach_the_template(engine, spec):
    llm = scripted(engine, "ok").bind_tools([spec])
    llm.invoke("hi")
    name = "get_weather" if spec in (get_weather, WEATHER) else "Person" if spec is not PersonDict else "PersonDict"
    prompt = last_prompt(engine)
    assert "<tools>" in prompt and f'"name": "{name}"' in prompt


def test_tool_choice_forms():
    tools = [WEATHER]
    assert _tool_choice("any", tools) == "required"
    assert _tool_choice("required", tools) == "required"
    assert _tool_choice(True, tools) == "required"
    assert _tool_choice("auto", tools) == "auto"
    assert _tool_choice("none", tools) == "none"
    assert _tool_choice("get_weather", tools) == "get_weather"
    assert _tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools) == "get_weather"
    assert _tool_choice({"type": "tool", "name": "get_weather"}, tools) == "get_weather"
    assert _tool_choice({"type": "any"}, tools) == "required"
    with pytest.raises(ValueError):
        _tool_choice("get_time", tools)


def test_tool_choice_reaches_the_engine(engine):
    scripted(engine, "ok").bind_tools([get_weather, get_time], tool_choice="get_time").invoke("hi")
    assert "You must answer with a call to the tool `get_time`." in last_prompt(engine)
    scripted(engine, "ok").bind_tools([get_weather], tool_choice="any").invoke("hi")
    assert "You must answer with a tool call." in last_prompt(engine)
    scripted(engine, "ok").bind_tools([get_weather], tool_choice="none").invoke("hi")
    assert "<tools>" not in last_prompt(engine)


def test_tool_messages_round_trip(engine):
    history = [
        SystemMessage("Be brief."),
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
        ToolMessage("It is sunny in Paris.", tool_call_id="call_1"),
    ]
    assert convert_messages(history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "It is sunny in Paris.", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    msg = scripted(engine, "It is sunny in Paris.").bind_tools([get_weather]).invoke(history)
    assert msg.content == "It is sunny in Paris."
    prompt = last_prompt(engine)
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in prompt
    assert "<tool_response>\nIt is sunny in Paris.\n</tool_response>" in prompt


def test_list_content_and_v1_assistant_messages_convert_to_text():
    ai = AIMessage([{"type": "reasoning", "reasoning": "hmm"}, {"type": "text", "text": "Hi"},
                    {"type": "tool_use", "id": "a", "name": "f", "input": {}}])
    human = HumanMessage([{"type": "text", "text": "a"}, "b"])
    assert convert_messages([human, ai]) == [{"role": "user", "content": "ab"},
                                             {"role": "assistant", "content": "Hi"}]
    with pytest.raises(ValueError, match="text only"):
        convert_messages([HumanMessage([{"type": "image", "base64": "AAAA", "mime_type": "image/png"}])])


# -- streaming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output_version", ["v0", "v1"])
def test_stream_sum_equals_invoke(engine, output_version):
    llm = scripted(engine, "Here is a short answer with several words.", output_version=output_version)
    invoked = llm.invoke("Hello")
    chunks = list(llm.stream("Hello"))
    kinds = ["reasoning" if c.additional_kwargs.get("reasoning_content") else "text" if c.text else "other"
             for c in chunks]
    assert kinds[0] == "reasoning" and "text" in kinds
    assert kinds.index("text") > max(i for i, k in enumerate(kinds) if k == "reasoning")  # reasoning first
    assert sum(k == "reasoning" for k in kinds) > 1  # reasoning streams as it is generated
    assert chunks[-1].chunk_position == "last"
    streamed = collect(chunks)
    assert without_index(streamed.content) == invoked.content  # v1 stream blocks also carry their "index"
    assert streamed.additional_kwargs == invoked.additional_kwargs
    assert streamed.usage_metadata == invoked.usage_metadata
    assert comparable_metadata(streamed) == comparable_metadata(invoked)
    assert [b["type"] for b in streamed.content_blocks] == [b["type"] for b in invoked.content_blocks]


@pytest.mark.parametrize("output_version", ["v0", "v1"])
def test_stream_tool_calls_merge_like_invoke(engine, output_version):
    answer = "Let me check.\n" + _call("get_weather", city="Paris") + "\n" + _call("get_time", city="Rome")
    llm = scripted(engine, answer, output_version=output_version).bind_tools([get_weather, get_time])
    invoked = llm.invoke("Weather and time?")
    chunks = list(llm.stream("Weather and time?"))
    assert not any("<tool_call>" in c.text or "```" in c.text for c in chunks)  # markup never streams as text
    streamed = collect(chunks)
    assert without_index(streamed.content, ("index",)) == without_index(invoked.content, ())
    assert streamed.text == "Let me check."
    assert streamed.tool_calls == invoked.tool_calls  # ids too: they derive from the request
    assert all(c["id"] for c in streamed.tool_calls)
    assert streamed.usage_metadata == invoked.usage_metadata
    assert comparable_metadata(streamed) == comparable_metadata(invoked)
    # tool-call chunk indices never collide with the reasoning and text blocks
    assert [b["type"] for b in streamed.content_blocks] == ["reasoning", "text", "tool_call", "tool_call"]
    indices = [c["index"] for c in chunks for c in c.tool_call_chunks]
    assert indices == sorted(indices) and set(indices) == {2, 3}
    assert len(indices) > 2  # the arguments arrive in fragments, as the engine streams them


def test_stream_text_before_a_call_arrives_before_the_call(engine):
    answer = "Checking the weather for you now.\n" + _call("get_weather", city="Paris")
    llm = scripted(engine, answer).bind_tools([get_weather])
    chunks = list(llm.stream("Weather?"))
    text_at = [i for i, c in enumerate(chunks) if c.text]
    call_at = [i for i, c in enumerate(chunks) if c.tool_call_chunks]
    assert text_at and call_at and max(text_at) < min(call_at)
    assert "".join(c.text for c in chunks) == "Checking the weather for you now."


def test_stream_unknown_tool_calls_arrive_as_tool_call_chunks(engine):
    # the aggregate equals invoke: a tool call the executor rejects, the engine's reason in the metadata
    llm = scripted(engine, _call("nope", x=1), ssr_config=FREE_CALLS).bind_tools([get_weather])
    invoked = llm.invoke("hi")
    streamed = collect(llm.stream("hi"))
    [tcc] = streamed.tool_call_chunks  # the fragments, merged by index
    assert tcc["name"] == "nope" and json.loads(tcc["args"]) == {"x": 1}
    assert tcc["id"].startswith("call_")
    calls = [[(c["name"], c["args"]) for c in m.tool_calls] for m in (streamed, invoked)]
    assert calls[0] == calls[1]
    assert invoked.tool_calls[0]["name"] == "nope" and streamed.invalid_tool_calls == invoked.invalid_tool_calls == []
    assert "unknown tool" in streamed.response_metadata["tool_call_errors"][0]["error"]


async def test_astream_and_ainvoke_equal_invoke(engine):
    answer = "Sure.\n" + _call("get_weather", city="Paris")
    llm = scripted(engine, answer).bind_tools([get_weather])
    invoked = llm.invoke("Weather?")
    ainvoked = await llm.ainvoke("Weather?")
    astreamed = await acollect(llm.astream("Weather?"))
    for other in (ainvoked, astreamed):
        assert other.content == invoked.content
        assert other.additional_kwargs == invoked.additional_kwargs
        assert [(c["name"], c["args"]) for c in other.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert comparable_metadata(other) == comparable_metadata(invoked)


async def test_abatch_and_batch(engine):
    llm = scripted(engine, "Same answer.")
    assert [m.content for m in llm.batch(["a", "b"])] == ["Same answer.", "Same answer."]
    assert [m.content for m in await llm.abatch(["a", "b"])] == ["Same answer.", "Same answer."]


def test_closing_a_stream_early_frees_the_engine(engine):
    llm = scripted(engine, "A long answer " * 5)
    stream = llm.stream("Hello")
    next(stream)
    stream.close()
    assert llm.invoke("Hello").content == "A long answer " * 5  # the engine's lock was released


async def test_closing_an_astream_early_frees_the_engine(engine):
    llm = scripted(engine, "A long answer " * 5)
    stream = llm.astream("Hello")
    await stream.__anext__()
    await stream.aclose()
    assert (await llm.ainvoke("Hello")).content == "A long answer " * 5


def test_stop_strings(engine):
    llm = scripted(engine, "one two STOP three")
    assert llm.invoke("count", stop=["STOP"]).content == "one two "
    assert collect(llm.stream("count", stop=["STOP"])).content == "one two "
    assert scripted(engine, "one two STOP three", stop=["STOP"]).invoke("count").content == "one two "


def test_sampling_settings_are_passed_to_the_engine(engine, monkeypatch):
    seen = {}
    original = engine.generate

    def spy(prompt, **kwargs):
        seen.update(kwargs)
        return original(prompt, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    llm = scripted(engine, "ok", temperature=0.7, top_p=0.9, top_k=20, seed=3, max_tokens=99, ssr_config=CONFIG)
    llm.invoke("hi", max_tokens=50)
    assert seen["config"] is CONFIG
    sampling = (seen["temperature"], seen["top_p"], seen["top_k"], seen["seed"], seen["max_tokens"])
    assert sampling == (0.7, 0.9, 20, 3, 50)


# -- structured output --------------------------------------------------------------------------------------------


def test_structured_output_function_calling(engine):
    answer = _call("Person", name="Ann", age=31)
    llm = scripted(engine, answer)
    assert llm.with_structured_output(Person).invoke("Ann is 31.") == Person(name="Ann", age=31)
    assert "You must answer with a call to the tool `Person`." in last_prompt(engine)
    llm_dict = scripted(engine, _call("PersonDict", name="Ann", age=31))
    assert llm_dict.with_structured_output(PersonDict).invoke("Ann is 31.") == {"name": "Ann", "age": 31}
    engine.backend.set_script(REASONING, answer)
    raw = llm.with_structured_output(Person, include_raw=True).invoke("Ann is 31.")
    assert raw["parsed"] == Person(name="Ann", age=31) and raw["parsing_error"] is None
    assert isinstance(raw["raw"], AIMessage) and raw["raw"].additional_kwargs["reasoning_content"] == REASONING
    chunks = list(llm.with_structured_output(Person).stream("Ann is 31."))
    assert chunks[-1] == Person(name="Ann", age=31)


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_structured_output_json(engine, method):
    llm = scripted(engine, '{"name": "Ann", "age": 31}')  # the answer's grammar allows JSON only, no code fence
    assert llm.with_structured_output(Person, method=method).invoke("Ann is 31.") == Person(name="Ann", age=31)
    prompt = last_prompt(engine)
    assert "Answer with one JSON object" in prompt
    assert ('"age"' in prompt) == (method == "json_schema")
    assert llm.with_structured_output(PersonDict, method=method).invoke("Ann is 31.") == {"name": "Ann", "age": 31}
    raw = llm.with_structured_output(Person, method=method, include_raw=True).invoke("x")
    assert raw["parsed"] == Person(name="Ann", age=31)


def test_structured_output_parse_failure_with_include_raw(engine):
    # the grammar keeps the answer to the schema, but a token budget can still cut the JSON off
    llm = scripted(engine, '{"name": "Ann", "age": 31}', reasoning="Ann.", max_tokens=12)
    out = llm.with_structured_output(Person, method="json_schema", include_raw=True).invoke("x")
    assert out["parsed"] is None and out["parsing_error"] is not None
    assert out["raw"].content.startswith('{"') and out["raw"].response_metadata["finish_reason"] == "length"


# -- the real model -----------------------------------------------------------------------------------------------

REAL = SSRConfig(max_think_tokens=32, draft_start=8, max_tokens=120)


@pytest.fixture(scope="module")
def real_llm():
    return ChatSSR(ssr_config=REAL, temperature=0)


@pytest.mark.real_model
def test_real_model_reasoning_stream_and_invoke_agree(real_llm):
    prompt = "Write a one-line Python expression that reverses the string s."
    invoked = real_llm.invoke(prompt)
    assert invoked.additional_kwargs["reasoning_content"].strip()
    assert "<think>" not in invoked.content and "</think>" not in invoked.content
    assert invoked.content.strip()
    assert invoked.content_blocks[0]["type"] == "reasoning"
    assert invoked.usage_metadata["output_token_details"]["reasoning"] > 0
    assert invoked.response_metadata["ssr"]["enabled"] is True
    streamed = collect(real_llm.stream(prompt))
    assert streamed.content == invoked.content  # greedy, float32: the same tokens every time
    assert streamed.additional_kwargs == invoked.additional_kwargs

    def counts(message):  # cache reads depend on what the previous request left in the KV cache
        return {k: v for k, v in message.usage_metadata.items() if k != "input_token_details"}

    assert counts(streamed) == counts(invoked)
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == \
        streamed.response_metadata["ssr"]["reused_prompt_tokens"]
    plain = ChatSSR(ssr_config=SSRConfig(**{**REAL.to_dict(), "enabled": False}), temperature=0).invoke(prompt)
    assert plain.content == invoked.content  # SSR changes nothing but the speed
    assert plain.additional_kwargs == invoked.additional_kwargs


@pytest.mark.real_model
def test_real_model_agent_loop(real_llm):
    llm = real_llm.bind_tools([get_weather])
    messages: list = [HumanMessage("What is the weather in Paris? Use the get_weather tool.")]
    called = []
    for _ in range(3):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            called.append(call)
            messages.append(get_weather.invoke(call))  # a ToolMessage carrying the call's id
    assert called and called[0]["name"] == "get_weather" and "paris" in called[0]["args"]["city"].lower()
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert final.content.strip()
    assert any(isinstance(m, ToolMessage) for m in messages)


def test_stream_events_v3_with_reasoning_and_tool_calls(engine):
    from langchain_tests.utils.stream_lifecycle import assert_valid_event_stream

    answer = "Let me check.\n" + _call("get_weather", city="Paris")
    llm = scripted(engine, answer).bind_tools([get_weather])
    stream = llm.stream_events("Weather?", version="v3")
    events = list(stream)
    assert_valid_event_stream(events)
    starts = [e["content"]["type"] for e in events if e["event"] == "content-block-start"]
    assert starts == ["reasoning", "text", "tool_call_chunk"]
    message = stream.output
    assert [b["type"] for b in message.content_blocks] == ["reasoning", "text", "tool_call"]
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert message.text == "Let me check."


@pytest.mark.parametrize("n", [8, 32])
def test_batch_runs_together_and_equals_one_by_one(n):
    """``batch`` / ``abatch`` of n prompts on one engine: its scheduler runs them together (fewer passes than their
    sum), and every message equals the same prompt invoked alone."""
    import asyncio

    from tiny import tiny_chat_engine

    engine = tiny_chat_engine(max_think_tokens=8, max_tokens=24, draft_start=2)
    llm = ChatSSR(engine=engine)
    prompts = ["abc"[: 1 + i % 3] + "xyz"[i % 3:] + "h" * (i % 5) for i in range(n)]
    alone = [llm.invoke(p) for p in prompts]
    before = engine.scheduler.passes
    together = llm.batch(prompts, config={"max_concurrency": n})
    assert engine.scheduler.passes - before < sum(m.response_metadata["ssr"]["forward_passes"] for m in together)
    assert [(m.content, m.additional_kwargs) for m in together] == [(m.content, m.additional_kwargs) for m in alone]
    async_together = asyncio.run(llm.abatch(prompts, config={"max_concurrency": n}))
    assert [m.content for m in async_together] == [m.content for m in alone]
