"""Fast tests of the LlamaIndex adapter: pure conversions, and the LLM over a scripted engine (no model)."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools import FunctionTool

from llama_index.llms.ssr import SSR
from llama_index.llms.ssr.utils import (
    StreamAccumulator,
    resolve_tool_choice,
    to_engine_messages,
    tool_selections_from_message,
)
from ssr import SSRConfig
from ssr.chat import ToolCallParse, parse_tool_calls
from ssr.engine import _events
from ssr.result import GenerationResult, StreamEvent
from ssr.toolstream import ToolCallStream

# ------------------------------------------------------------------------------------------------ scripted engine


class FakeEngine:
    """Speaks the engine API (docs/api.md) with a scripted reasoning and answer; records every call."""

    model_name = "fake-model"
    context_window = 4096

    def __init__(self, reasoning: str = "The user asks for 6*7. That is 42.", answer: str = "The answer is 42.",
                 piece: int = 4) -> None:
        self.config = SSRConfig()
        self.reasoning, self.answer, self.piece = reasoning, answer, piece
        self.calls: list[tuple[object, dict]] = []
        self.closed = False

    def _result(self, prompt, kwargs) -> GenerationResult:
        self.calls.append((prompt, kwargs))
        parsed = parse_tool_calls(self.answer, kwargs.get("tools"))
        think = len(self.reasoning.split())
        return GenerationResult(
            reasoning=self.reasoning, answer=self.answer, token_ids=list(range(think + len(self.answer.split()))),
            prompt_tokens=17, finish_reason="tool_calls" if parsed.tool_calls else "stop",
            stats={"think_tokens": think, "answer_tokens": len(self.answer.split()), "drafts": 1,
                   "accepted_tokens": 3, "forward_passes_saved": 2},
            tool_calls=parsed.tool_calls, invalid_tool_calls=parsed.invalid_tool_calls, content=parsed.content,
        )

    def _pieces(self, text):
        return [text[i:i + self.piece] for i in range(0, len(text), self.piece)]

    def generate(self, prompt, **kwargs):
        return self._result(prompt, kwargs)

    async def agenerate(self, prompt, **kwargs):
        await asyncio.sleep(0)
        return self._result(prompt, kwargs)

    def stream(self, prompt, **kwargs):
        """As the engine streams: with tools bound, the answer goes through the engine's own tool-call stream."""
        tools = kwargs.get("tools")
        calls = ToolCallStream(tools) if tools else None
        try:
            for text in self._pieces(self.reasoning):
                yield StreamEvent("reasoning", text)
            for text in self._pieces(self.answer):
                yield from _events(calls.feed(text)) if calls else [StreamEvent("answer", text)]
            result = self._result(prompt, kwargs)
            if calls:
                parsed = ToolCallParse(result.content, result.tool_calls, result.invalid_tool_calls)
                yield from _events(calls.finish(parsed))
            yield StreamEvent("done", result=result)
        finally:
            self.closed = True

    async def astream(self, prompt, **kwargs):
        for event in self.stream(prompt, **kwargs):
            await asyncio.sleep(0)
            yield event


TOOL_ANSWER = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


MULTIPLY = FunctionTool.from_defaults(fn=multiply)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


# ------------------------------------------------------------------------------------------------ pure functions


def test_tool_selections_from_blocks_and_additional_kwargs():
    message = ChatMessage(role="assistant", blocks=[
        TextBlock(text=""), ToolCallBlock(tool_call_id="call_1", tool_name="multiply", tool_kwargs={"a": 1, "b": 2}),
        ToolCallBlock(tool_call_id=None, tool_name="multiply", tool_kwargs='{"a": 3, "b"'),  # partial JSON string
    ])
    first, partial = tool_selections_from_message(message)
    assert first == ToolSelection(tool_id="call_1", tool_name="multiply", tool_kwargs={"a": 1, "b": 2})
    assert (partial.tool_name, partial.tool_kwargs) == ("multiply", {"a": 3})
    openai_style = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 4, "b": 5}'}}]})
    assert tool_selections_from_message(openai_style) == [
        ToolSelection(tool_id="c9", tool_name="multiply", tool_kwargs={"a": 4, "b": 5})]
    engine_style = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
        {"id": "c1", "name": "multiply", "arguments": {"a": 1}}]})
    assert tool_selections_from_message(engine_style)[0].tool_kwargs == {"a": 1}
    assert tool_selections_from_message(ChatMessage(role="assistant", content="no call")) == []


def test_get_tool_calls_error_on_no_tool_call():
    llm = SSR(engine=FakeEngine())
    response = ChatResponse(message=ChatMessage(role="assistant", content="plain"))
    with pytest.raises(ValueError, match="Expected at least one tool call"):
        llm.get_tool_calls_from_response(response)
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []


def test_resolve_tool_choice():
    assert resolve_tool_choice() == "auto"
    assert resolve_tool_choice(tool_required=True) == "required"
    assert resolve_tool_choice("any") == "required"
    assert resolve_tool_choice("multiply") == "multiply"
    assert resolve_tool_choice({"type": "function", "function": {"name": "multiply"}}) == "multiply"


def test_to_engine_messages_roles_tool_calls_and_results():
    history = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="6*7?"),
        ChatMessage(role=MessageRole.ASSISTANT, blocks=[
            ThinkingBlock(content="need the tool"), TextBlock(text=""),
            ToolCallBlock(tool_call_id="call_1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7})]),
        ChatMessage(role=MessageRole.TOOL, blocks=[TextBlock(text="42")], additional_kwargs={"tool_call_id": "call_1"}),
        ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 1, "b": 1}'}}]}),
        ChatMessage(role=MessageRole.TOOL, content="1", additional_kwargs={"tool_call_id": "call_2", "name": "multiply"}),
        ChatMessage(role=MessageRole.ASSISTANT, content="It is 42."),
    ]
    assert to_engine_messages(history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "multiply"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 1, "b": 1}'}}]},
        {"role": "tool", "content": "1", "tool_call_id": "call_2", "name": "multiply"},
        {"role": "assistant", "content": "It is 42."},
    ]


def test_to_engine_messages_rejects_images():
    with pytest.raises(ValueError, match="text only"):
        to_engine_messages([ChatMessage(role="user", blocks=[ImageBlock(url="http://x/y.png")])])


def test_stream_accumulator_keeps_reasoning_out_of_text():
    engine = FakeEngine(answer="Sure. " + TOOL_ANSWER, piece=5)
    acc = StreamAccumulator()
    chunks = [c for c in (acc.feed(e) for e in engine.stream("q", tools=[MULTIPLY.metadata.to_openai_tool()])) if c]
    thinking = "".join(c.additional_kwargs["thinking_delta"] for c in chunks)
    assert thinking == engine.reasoning
    for chunk in chunks:
        assert "<tool_call>" not in (chunk.message.content or "")
        assert engine.reasoning not in (chunk.message.content or "")
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].message.content == "Sure."
    # partial calls show up before the end, the final one carries the engine's id
    partial = [c for c in chunks[:-1] if any(isinstance(b, ToolCallBlock) for b in c.message.blocks)]
    assert partial
    final_calls = [b for b in chunks[-1].message.blocks if isinstance(b, ToolCallBlock)]
    assert final_calls[0].tool_call_id.startswith("call_") and final_calls[0].tool_kwargs == {"a": 6, "b": 7}
    assert chunks[-1].additional_kwargs["ssr"]["drafts"] == 1


# ------------------------------------------------------------------------------------------------ the LLM


def test_metadata_comes_from_the_engine():
    llm = SSR(engine=FakeEngine(), max_tokens=64)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.model_name) == (4096, 64, "fake-model")
    assert meta.is_chat_model and meta.is_function_calling_model
    assert SSR(engine=FakeEngine()).metadata.num_output == SSRConfig().max_tokens


def test_chat_response_shape_and_engine_arguments():
    engine = FakeEngine()
    config = SSRConfig(max_think_tokens=16)
    llm = SSR(engine=engine, ssr_config=config, temperature=0.0, max_tokens=40)
    response = llm.chat(user("6*7?"), top_k=5, unrelated="ignored")
    assert response.message.content == "The answer is 42."
    assert isinstance(response.message.blocks[0], ThinkingBlock)
    assert response.message.blocks[0].content == engine.reasoning
    assert response.additional_kwargs["ssr"]["forward_passes_saved"] == 2
    assert response.raw["usage"]["prompt_tokens"] == 17
    words = len(engine.reasoning.split()) + len(engine.answer.split())
    assert response.additional_kwargs["completion_tokens"] == response.raw["usage"]["completion_tokens"] == words
    prompt, kwargs = engine.calls[0]
    assert prompt == [{"role": "user", "content": "6*7?"}]
    assert kwargs == {"config": config, "max_tokens": 40, "temperature": 0.0, "top_k": 5}


def test_complete_and_stream_complete():
    llm = SSR(engine=FakeEngine())
    completion = llm.complete("6*7?")
    assert completion.text == "The answer is 42."
    assert completion.additional_kwargs["thinking"] == llm.engine.reasoning
    chunks = list(llm.stream_complete("6*7?"))
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].text == "The answer is 42."
    assert "".join(c.additional_kwargs.get("thinking_delta") or "" for c in chunks) == llm.engine.reasoning


async def test_async_forms():
    llm = SSR(engine=FakeEngine())
    assert (await llm.achat(user("q"))).message.content == "The answer is 42."
    assert (await llm.acomplete("q")).text == "The answer is 42."
    chunks = [c async for c in await llm.astream_chat(user("q"))]
    assert chunks[-1].message.content == "The answer is 42."
    assert "".join(c.delta or "" for c in chunks) == "The answer is 42."
    texts = [c.text async for c in await llm.astream_complete("q")]
    assert texts[-1] == "The answer is 42."


async def test_closing_a_stream_early_closes_the_engine_stream():
    engine = FakeEngine()
    llm = SSR(engine=engine)
    stream = await llm.astream_chat(user("q"))
    await stream.__anext__()
    await stream.aclose()  # LlamaIndex's callback wrapper drops our generator; the loop finalises it soon after
    for _ in range(5):
        await asyncio.sleep(0)
    assert engine.closed
    engine.closed = False
    sync_stream = llm.stream_chat(user("q"))
    next(sync_stream)
    sync_stream.close()
    assert engine.closed


def test_chat_with_tools_passes_openai_tools_and_returns_selections():
    engine = FakeEngine(answer=TOOL_ANSWER)
    llm = SSR(engine=engine)
    response = llm.chat_with_tools([MULTIPLY], user_msg="What is 6 times 7?", tool_required=True)
    _, kwargs = engine.calls[0]
    assert kwargs["tools"] == [MULTIPLY.metadata.to_openai_tool(skip_length_check=True)]
    assert kwargs["tool_choice"] == "required"
    [selection] = llm.get_tool_calls_from_response(response)
    assert (selection.tool_name, selection.tool_kwargs) == ("multiply", {"a": 6, "b": 7})
    assert response.message.content == ""
    # the assistant turn and the tool result round-trip to the engine's message dicts
    history = [*user("What is 6 times 7?"), response.message,
               ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": selection.tool_id})]
    messages = to_engine_messages(history)
    assert messages[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert messages[2] == {"role": "tool", "content": "42", "tool_call_id": selection.tool_id, "name": "multiply"}


def test_parallel_calls_trimmed_unless_allowed():
    engine = FakeEngine(answer=TOOL_ANSWER + "\n" + TOOL_ANSWER.replace("6", "3"))
    llm = SSR(engine=engine)
    one = llm.chat_with_tools([MULTIPLY], user_msg="q")
    assert len(llm.get_tool_calls_from_response(one)) == 1
    assert len(one.message.additional_kwargs["tool_calls"]) == 1
    both = llm.chat_with_tools([MULTIPLY], user_msg="q", allow_parallel_tool_calls=True)
    assert len(llm.get_tool_calls_from_response(both)) == 2


def test_no_tools_means_no_tool_choice():
    engine = FakeEngine()
    SSR(engine=engine).chat(user("q"), tools=[], tool_choice="required")
    assert "tool_choice" not in engine.calls[0][1] and "tools" not in engine.calls[0][1]


def test_predict_and_call_with_scripted_engine():
    llm = SSR(engine=FakeEngine(answer=TOOL_ANSWER))
    result = llm.predict_and_call([MULTIPLY], user_msg="What is 6 times 7?")
    assert result.response == "42"


async def test_function_agent_over_scripted_engine_streams_thinking():
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent

    class TwoStep(FakeEngine):
        def _result(self, prompt, kwargs):
            self.answer = "It is 42." if any(m["role"] == "tool" for m in prompt) else TOOL_ANSWER
            return super()._result(prompt, kwargs)

        def stream(self, prompt, **kwargs):
            self.answer = "It is 42." if any(m["role"] == "tool" for m in prompt) else TOOL_ANSWER
            return super().stream(prompt, **kwargs)

    agent = FunctionAgent(tools=[MULTIPLY], llm=SSR(engine=TwoStep()))
    handler = agent.run("What is 6 times 7?")
    thinking = []
    async for event in handler.stream_events():
        if isinstance(event, AgentStream) and event.thinking_delta:
            thinking.append(event.thinking_delta)
    result = await handler
    assert str(result) == "It is 42."
    assert "".join(thinking).count("That is 42.") == 2


async def test_function_agent_answers_an_unknown_tool_name_and_goes_on():
    # a well-formed call with a made-up name is a ToolCallBlock: the agent answers it with its own error (as for any
    # LLM), the model reads that and calls the right tool; the engine's reason stays in additional_kwargs
    from llama_index.core.agent.workflow import FunctionAgent

    class Retry(FakeEngine):
        def _result(self, prompt, kwargs):
            results = [m["content"] for m in prompt if m["role"] == "tool"]
            self.answer = ("It is 42." if len(results) == 2 else TOOL_ANSWER if results
                           else TOOL_ANSWER.replace('"multiply"', '"multiplie"'))
            return super()._result(prompt, kwargs)

    engine = Retry()
    first = SSR(engine=engine).chat_with_tools([MULTIPLY], user_msg="What is 6 times 7?")
    [block] = [b for b in first.message.blocks if isinstance(b, ToolCallBlock)]
    assert (block.tool_name, block.tool_kwargs) == ("multiplie", {"a": 6, "b": 7})
    assert "unknown tool" in first.message.additional_kwargs["invalid_tool_calls"][0]["error"]
    engine = Retry()
    result = await FunctionAgent(tools=[MULTIPLY], llm=SSR(engine=engine), streaming=False).run("What is 6 times 7?")
    assert str(result) == "It is 42."
    tool_results = [m["content"] for m in engine.calls[-1][0] if m["role"] == "tool"]
    assert "Tool multiplie not found" in tool_results[0] and tool_results[1] == "42"


def test_close_frees_the_loaded_engine_and_the_next_call_loads_again(monkeypatch):
    import ssr
    from tiny import tiny_engine

    loaded = []
    monkeypatch.setattr(ssr, "get_engine", lambda *a, **k: loaded.append(tiny_engine()) or loaded[-1])
    llm = SSR()
    first = llm.engine
    first.generate([5, 6, 7], config=SSRConfig(max_think_tokens=2, max_tokens=4))  # token ids: no template
    llm.close()
    assert first.closed and first.backend.live_lanes == 0
    assert llm.engine is loaded[1] and len(loaded) == 2
    llm.close()
    passed_in = FakeEngine()
    SSR(engine=passed_in).close()  # an engine passed in is the caller's to close
    assert passed_in.closed is False


@pytest.mark.parametrize("n", [8, 32])
def test_concurrent_achat_runs_together_and_equals_one_by_one(n):
    from tiny import tiny_chat_engine

    engine = tiny_chat_engine(max_think_tokens=8, max_tokens=24, draft_start=2)
    llm = SSR(engine=engine)
    prompts = [[ChatMessage(role="user", content="abc"[: 1 + i % 3] + "h" * (i % 5))] for i in range(n)]
    alone = [llm.chat(p).message.content for p in prompts]
    before = engine.scheduler.passes

    async def together():
        return await asyncio.gather(*(llm.achat(p) for p in prompts))

    responses = asyncio.run(together())
    assert [r.message.content for r in responses] == alone
    assert engine.scheduler.passes - before < sum(r.additional_kwargs["ssr"]["forward_passes"] for r in responses)
