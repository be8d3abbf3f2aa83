"""SSR chat model: a local reasoning model that drafts its answer while it thinks (self-speculation).

``ChatSSR`` is a thin adapter over ``ssr.SSREngine``: it turns LangChain messages into OpenAI-style message dicts,
passes tools and sampling settings to the engine, and turns the engine's results and stream events back into
``AIMessage`` / ``AIMessageChunk``. The chain of thought is kept out of ``content``: it travels in
``additional_kwargs["reasoning_content"]`` (the convention ChatOllama, DeepSeek and others use), so
``message.content_blocks`` starts with a ``reasoning`` block.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr

from ssr import SSRConfig

PROVIDER = "ssr"

# Markup after which streamed answer text may belong to a tool call (what ``ssr.chat.parse_tool_calls`` reads:
# Hermes/Qwen tags, a fenced JSON call, or a bare JSON object as the whole answer). While tools are bound, the
# answer is streamed up to the first of these; the rest follows, markup removed, when the engine has parsed it.
_TOOL_MARKERS = ("<tool_call>", "```")

# kwargs that LangChain helpers pass to any chat model and that mean nothing here
_IGNORED_KWARGS = frozenset({"parallel_tool_calls", "strict", "stream", "ls_structured_output_format",
                             "structured_output_format"})

# content blocks that carry no prompt text for the engine (the assistant's earlier reasoning and tool-call blocks,
# whose calls travel in ``AIMessage.tool_calls``)
_SKIPPED_BLOCKS = frozenset({"reasoning", "thinking", "redacted_thinking", "tool_use", "tool_call",
                             "tool_call_chunk", "invalid_tool_call", "server_tool_call", "server_tool_call_chunk",
                             "server_tool_result", "function_call"})

_engine_lock = threading.Lock()


class ChatSSR(BaseChatModel):
    """Chat model over an in-process SSR engine: think, draft the answer concurrently, verify it, answer sooner.

    The output is exactly what plain decoding of the same model would produce (token for token when greedy; the
    model's own distribution when sampling). ``ssr_config=SSRConfig(enabled=False)`` *is* plain decoding.

    Setup:
        ```bash
        pip install "ssr[langchain]"   # the embedded default model ships with ssr
        ```

    Instantiate (cheap: the engine is loaded on first use and shared process-wide per ``(model, backend)``):
        ```python
        from langchain_ssr import ChatSSR
        from ssr import SSRConfig

        llm = ChatSSR(ssr_config=SSRConfig(max_think_tokens=256), temperature=0)
        ```

    Invoke:
        ```python
        msg = llm.invoke("Write a Python function that reverses a string.")
        msg.content                                  # the answer
        msg.additional_kwargs["reasoning_content"]   # the chain of thought
        msg.content_blocks[0]                        # {"type": "reasoning", "reasoning": "..."}
        msg.response_metadata["ssr"]                 # drafts, accepted tokens, forward passes saved, timings
        msg.usage_metadata["output_token_details"]["reasoning"]
        ```

    Stream (reasoning as it is generated, answer text as soon as it is verified):
        ```python
        for chunk in llm.stream("Explain recursion in one sentence."):
            print(chunk.additional_kwargs.get("reasoning_content", ""), chunk.text, sep="", end="")
        ```

    Tool calling:
        ```python
        from langchain_core.tools import tool

        @tool
        def get_weather(city: str) -> str:
            "Current weather in a city."
            return "sunny"

        msg = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
        msg.tool_calls   # [{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_...", ...}]
        ```

    Structured output:
        ```python
        from pydantic import BaseModel

        class Person(BaseModel):
            name: str
            age: int

        llm.with_structured_output(Person).invoke("Alice is 30.")          # via a forced tool call
        llm.with_structured_output(Person, method="json_schema").invoke(...)  # via a JSON answer
        ```
    """

    model: str | None = None
    """Model name (an embedded model such as ``"qwen2.5-coder-0.5b-instruct"``) or a local directory.
    ``None`` is the embedded default model."""

    backend: str = "transformers"
    """Engine backend: ``"transformers"`` (in-process PyTorch) or ``"vllm"``."""

    backend_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for ``ssr.get_engine`` (e.g. ``dtype``, ``device``). Only used when this
    ``(model, backend)`` pair is loaded for the first time in the process."""

    ssr_config: SSRConfig | None = None
    """Thinking budget, drafting and sampling settings (``None``: the engine's defaults).
    ``SSRConfig(enabled=False)`` is plain decoding."""

    temperature: float | None = None
    """Sampling temperature; 0 is greedy. Overrides ``ssr_config.temperature`` when set."""

    max_tokens: int | None = None
    """Most tokens to generate (thinking and answer together). Overrides ``ssr_config.max_tokens`` when set."""

    top_p: float | None = None
    """Nucleus sampling mass. Overrides ``ssr_config.top_p`` when set."""

    top_k: int | None = None
    """Top-k sampling (0 disables it). Overrides ``ssr_config.top_k`` when set."""

    seed: int | None = None
    """Random seed for sampling."""

    stop: list[str] | None = None
    """Stop strings (applied to the answer). A ``stop`` given per call replaces these."""

    streaming: bool = False
    """Whether ``invoke`` should stream internally (so callbacks see tokens as they arrive)."""

    engine: Any | None = Field(default=None, exclude=True)
    """An already built ``ssr.SSREngine`` to use instead of ``ssr.get_engine(model, backend)``."""

    _loaded: Any = PrivateAttr(default=None)

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    # -- identity --------------------------------------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "chat-ssr"

    @property
    def model_name(self) -> str:
        """The model's name as the engine reports it (without loading the engine)."""
        if self.engine is not None:
            return self.engine.model_name
        return _canonical_name(self.model)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "backend": self.backend,
            "ssr_config": self.ssr_config.to_dict() if self.ssr_config is not None else None,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider=PROVIDER, ls_model_type="chat")
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model_name
        config = kwargs.get("ssr_config") or self.ssr_config
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is None and config is not None:
            temperature = config.temperature
        if temperature is not None:
            params["ls_temperature"] = float(temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is None and config is not None:
            max_tokens = config.max_tokens
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := (stop if stop is not None else self.stop):
            params["ls_stop"] = list(stop)
        return params

    # -- engine ----------------------------------------------------------------------------------------------------

    def _get_engine(self, model: str | None = None) -> Any:
        """The engine for this model (loaded on first use; ``model`` overrides the configured model)."""
        if model is not None and model != self.model:
            import ssr

            return ssr.get_engine(model, self.backend, **(self.backend_kwargs or {}))
        if self.engine is not None:
            return self.engine
        if self._loaded is None:
            import ssr

            with _engine_lock:
                if self._loaded is None:
                    self._loaded = ssr.get_engine(self.model, self.backend, **(self.backend_kwargs or {}))
        return self._loaded

    async def _aget_engine(self, model: str | None = None) -> Any:
        if model is None or model == self.model:
            if self.engine is not None:
                return self.engine
            if self._loaded is not None:
                return self._loaded
        return await asyncio.to_thread(self._get_engine, model)

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], dict[str, Any]]:
        """(model override, engine messages, engine call kwargs) for one call."""
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        config = kwargs.pop("ssr_config", None) or self.ssr_config
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        response_format = kwargs.pop("response_format", None)
        call: dict[str, Any] = {"config": config}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            value = kwargs.pop(name, None)
            call[name] = value if value is not None else getattr(self, name)
        stop = stop if stop is not None else kwargs.get("stop")
        kwargs.pop("stop", None)
        call["stop"] = list(stop) if stop is not None else self.stop
        unknown = set(kwargs) - _IGNORED_KWARGS
        if unknown:
            warnings.warn(f"ChatSSR ignores unsupported argument(s) {sorted(unknown)}", stacklevel=4)
        if tools:
            call["tools"] = [convert_to_openai_tool(t) for t in tools]
            if tool_choice is not None:
                call["tool_choice"] = _tool_choice(tool_choice, call["tools"])
        engine_messages = convert_messages(messages)
        if response_format:
            _add_instruction(engine_messages, _format_instruction(response_format))
        return model, engine_messages, {k: v for k, v in call.items() if v is not None}

    # -- generation ------------------------------------------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        model, prompt, call = self._request(messages, stop, kwargs)
        engine = self._get_engine(model)
        return _chat_result(engine.generate(prompt, **call), engine.model_name)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        model, prompt, call = self._request(messages, stop, kwargs)
        engine = await self._aget_engine(model)
        return _chat_result(await engine.agenerate(prompt, **call), engine.model_name)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        model, prompt, call = self._request(messages, stop, kwargs)
        engine = self._get_engine(model)
        assembler = _StreamAssembler(tools_bound=bool(call.get("tools")), model_name=engine.model_name)
        events = engine.stream(prompt, **call)
        try:
            for event in events:
                yield from assembler.feed(event)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # stops the request early when the consumer stops reading

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        model, prompt, call = self._request(messages, stop, kwargs)
        engine = await self._aget_engine(model)
        assembler = _StreamAssembler(tools_bound=bool(call.get("tools")), model_name=engine.model_name)
        events = engine.astream(prompt, **call)
        try:
            async for event in events:
                for chunk in assembler.feed(event):
                    yield chunk
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()  # cancels the request and frees its lanes

    # -- tools and structured output -------------------------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic models, functions, TypedDicts, JSON schemas, OpenAI tool dicts).

        The engine renders them with the model's chat template. ``tool_choice``: ``"auto"`` (default), ``"none"``,
        ``"any"``/``"required"``/``True`` (some tool must be called), or a tool name (that tool must be called).
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Answers parsed into ``schema`` (a pydantic class, TypedDict or JSON schema).

        ``method="function_calling"`` forces a call to a tool shaped like the schema; ``"json_schema"`` asks (in the
        last user turn) for a JSON answer that follows the schema; ``"json_mode"`` asks for a JSON answer and leaves
        the keys to the prompt. No constrained decoding is done: the model writes the JSON, and ``strict`` is only
        passed on to the tool schema.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema must be given for method='function_calling'")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=trace)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                if schema is None:
                    raise ValueError("schema must be given for method='json_schema'")
                response_format = {"type": "json_schema", "schema": convert_to_json_schema(schema)}
            else:
                response_format = {"type": "json_object"}
            llm = self.bind(response_format=response_format,
                            ls_structured_output_format=trace if schema is not None else None)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


# -- messages ------------------------------------------------------------------------------------------------------


def convert_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> the engine's OpenAI-style message dicts (assistant tool calls and tool results kept)."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for message in messages:
        if isinstance(message, SystemMessage):
            out.append({"role": "system", "content": _text(message.content)})
        elif isinstance(message, HumanMessage):
            out.append({"role": "user", "content": _text(message.content)})
        elif isinstance(message, AIMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": tc.get("id"), "type": "function", "function": {"name": tc["name"], "arguments": tc["args"]}}
                    for tc in message.tool_calls
                ]
                call_names.update({tc["id"]: tc["name"] for tc in message.tool_calls if tc.get("id")})
            out.append(entry)
        elif isinstance(message, ToolMessage):
            entry = {"role": "tool", "content": _text(message.content), "tool_call_id": message.tool_call_id}
            if name := message.name or call_names.get(message.tool_call_id):
                entry["name"] = name
            out.append(entry)
        elif isinstance(message, FunctionMessage):
            out.append({"role": "tool", "content": _text(message.content), "name": message.name})
        elif isinstance(message, ChatMessage):
            role = {"human": "user", "ai": "assistant"}.get(message.role, message.role)
            out.append({"role": role, "content": _text(message.content)})
        else:
            raise TypeError(f"ChatSSR cannot send a message of type {type(message).__name__}")
    return out


def _text(content: str | list[str | dict[str, Any]]) -> str:
    """The text of message content; reasoning and tool-call blocks are skipped, media is refused."""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind in ("text", "input_text", "output_text"):
            parts.append(block.get("text") or "")
        elif kind in _SKIPPED_BLOCKS:
            continue
        elif kind in ("json",):
            parts.append(json.dumps(block.get("json"), ensure_ascii=False))
        elif isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            raise ValueError(f"ChatSSR reads text only; cannot send a {kind!r} content block")
    return "".join(parts)


def _add_instruction(messages: list[dict[str, Any]], instruction: str) -> None:
    """Append an instruction to the last user turn (where small models heed it), else add a system message."""
    for message in reversed(messages):
        if message["role"] == "user":
            message["content"] = f"{message['content']}\n\n{instruction}" if message["content"] else instruction
            return
    messages.insert(0, {"role": "system", "content": instruction})


def _format_instruction(response_format: dict[str, Any]) -> str:
    kind = response_format.get("type")
    if kind == "json_schema":
        schema = response_format.get("schema") or (response_format.get("json_schema") or {}).get("schema")
        return ("Answer with one JSON object that follows this JSON schema, and nothing else: "
                f"{json.dumps(schema, ensure_ascii=False)}")
    if kind == "json_object":
        return "Answer with one JSON object, and nothing else."
    raise ValueError(f"unsupported response_format {response_format!r}")


def _tool_choice(choice: dict | str | bool, tools: list[dict[str, Any]]) -> str:
    """LangChain/OpenAI/Anthropic tool_choice forms -> the engine's: "auto" | "none" | "required" | a tool name."""
    names = [t["function"]["name"] for t in tools]
    if choice is True:
        return "required"
    if isinstance(choice, dict):
        if choice.get("type") in ("any", "required", "auto", "none"):
            return "required" if choice["type"] == "any" else choice["type"]
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if not isinstance(choice, str):
        raise ValueError(f"unrecognised tool_choice {choice!r}")
    if choice in names:
        return choice
    if choice in ("any", "required"):
        return "required"
    if choice in ("auto", "none"):
        return choice
    raise ValueError(f"tool_choice {choice!r} is not one of the bound tools {names}")


# -- results -------------------------------------------------------------------------------------------------------


def _usage(res: Any) -> UsageMetadata:
    output = len(res.token_ids)
    return UsageMetadata(
        input_tokens=res.prompt_tokens,
        output_tokens=output,
        total_tokens=res.prompt_tokens + output,
        output_token_details={"reasoning": int(res.stats.get("think_tokens", 0))},
    )


def _response_metadata(res: Any, model_name: str) -> dict[str, Any]:
    return {"model_name": model_name, "model_provider": PROVIDER, "finish_reason": res.finish_reason,
            "token_ids": list(res.token_ids), "ssr": res.stats}


def _content(res: Any) -> str:
    return res.content if res.content is not None else res.answer


def _chat_result(res: Any, model_name: str) -> ChatResult:
    message = AIMessage(
        content=_content(res),
        additional_kwargs={"reasoning_content": res.reasoning} if res.reasoning else {},
        tool_calls=[tool_call(name=c["name"], args=c["arguments"], id=c.get("id")) for c in res.tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.get("name"), args=_raw_arguments(c.get("args")), id=c.get("id"),
                                              error=c.get("error")) for c in res.invalid_tool_calls],
        usage_metadata=_usage(res),
        response_metadata=_response_metadata(res, model_name),
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


class _StreamAssembler:
    """Engine stream events -> ``ChatGenerationChunk``s whose sum equals the ``invoke`` message.

    Reasoning deltas become chunks with ``additional_kwargs["reasoning_content"]``; answer deltas become text
    chunks (while tools are bound, text that could be tool-call markup is held back until the engine has parsed
    it). The ``done`` event adds the remaining text, one ``tool_call_chunk`` per tool call, and a last chunk with
    usage and response metadata. Tool-call chunk indices start after the reasoning and text blocks, so the
    ``index``-keyed merging of v1 content blocks never folds a tool call into them.
    """

    def __init__(self, tools_bound: bool, model_name: str) -> None:
        self.tools_bound = tools_bound
        self.model_name = model_name
        self.reasoning = ""  # reasoning emitted
        self.answer = ""  # raw answer received
        self.text = ""  # answer text emitted
        self.blocks = 0  # runs of block types emitted so far (reasoning, text)
        self.last_kind: str | None = None

    def _chunk(self, kind: str, text: str) -> ChatGenerationChunk:
        if kind != self.last_kind:
            self.blocks += 1
            self.last_kind = kind
        if kind == "reasoning":
            self.reasoning += text
            message = AIMessageChunk(content="", additional_kwargs={"reasoning_content": text},
                                     response_metadata={"model_provider": PROVIDER})
        else:
            self.text += text
            message = AIMessageChunk(content=text, response_metadata={"model_provider": PROVIDER})
        return ChatGenerationChunk(message=message)

    def _safe_text(self) -> str:
        """The longest prefix of the answer that cannot turn out to be tool-call markup."""
        if not self.tools_bound:
            return self.answer
        text = self.answer.lstrip()
        if text.startswith("{"):
            return ""  # the whole answer may be one bare JSON tool call
        cut = len(text)
        for marker in _TOOL_MARKERS:
            at = text.find(marker)
            if at >= 0:
                cut = min(cut, at)
                continue
            for k in range(len(marker) - 1, 0, -1):  # a marker may be arriving: hold its first characters
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return text[:cut].rstrip()  # parse_tool_calls strips the content

    def feed(self, event: Any) -> Iterator[ChatGenerationChunk]:
        if event.kind == "reasoning":
            if event.text:
                yield self._chunk("reasoning", event.text)
        elif event.kind == "answer":
            self.answer += event.text
            safe = self._safe_text()
            if len(safe) > len(self.text) and safe.startswith(self.text):
                yield self._chunk("text", safe[len(self.text):])
        elif event.kind == "done":
            yield from self._finish(event.result)

    def _finish(self, res: Any) -> Iterator[ChatGenerationChunk]:
        if not self.text and res.reasoning.startswith(self.reasoning) and len(res.reasoning) > len(self.reasoning):
            yield self._chunk("reasoning", res.reasoning[len(self.reasoning):])
        content = _content(res)
        if content.startswith(self.text):
            if rest := content[len(self.text):]:
                yield self._chunk("text", rest)
        else:  # not expected: the engine's streamed answer and its final content disagree
            warnings.warn("ChatSSR: streamed answer text is not a prefix of the final content", stacklevel=2)
        calls = [(c.get("id"), c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in res.tool_calls]
        calls += [(c.get("id"), c.get("name"), _raw_arguments(c.get("args"))) for c in res.invalid_tool_calls]
        if calls:
            yield ChatGenerationChunk(message=AIMessageChunk(
                content="",
                tool_call_chunks=[tool_call_chunk(name=name, args=args, id=call_id, index=self.blocks + i)
                                  for i, (call_id, name, args) in enumerate(calls)],
                response_metadata={"model_provider": PROVIDER},
            ))
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="",
            usage_metadata=_usage(res),
            response_metadata=_response_metadata(res, self.model_name),
            chunk_position="last",
        ))


def _raw_arguments(body: str | None) -> str | None:
    """The arguments text in an invalid call's raw body (LangChain's ``args``: the unparsed arguments).

    The engine's invalid calls carry the whole call (``{"name": ..., "arguments": ...}``) as written; LangChain's
    ``InvalidToolCall`` and ``ToolCallChunk`` carry only the arguments, as an OpenAI-style server would send them.
    A body whose arguments cannot be located is kept whole.
    """
    if not body:
        return body
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        at = re.search(r'"(?:arguments|parameters)"\s*:\s*', body)
        return body[at.end():] if at else body
    if isinstance(data, dict) and isinstance(args := data.get("arguments", data.get("parameters")), (dict, str)):
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return body


def _canonical_name(model: str | None) -> str:
    try:
        from ssr.models import canonical_name
    except ImportError:  # pragma: no cover - older engines
        return model or "default"
    return canonical_name(model)
