"""SSR chat model: a local reasoning model that drafts its answer while it thinks (self-speculation).

``ChatSSR`` is a thin adapter over ``ssr.SSREngine``: it turns LangChain messages into OpenAI-style message dicts,
passes tools and sampling settings to the engine, and turns the engine's results and stream events back into
``AIMessage`` / ``AIMessageChunk``. The chain of thought is kept out of ``content``: it travels in
``additional_kwargs["reasoning_content"]`` (the convention ChatOllama, DeepSeek and others use), so
``message.content_blocks`` starts with a ``reasoning`` block.
"""

from __future__ import annotations

import asyncio
import difflib
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
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ssr import SSRConfig
from ssr.models import context_window as context_window_of
from ssr.models import model_config, tokenizer_and_family
from ssr.settings import REASONING_EFFORT_BUDGETS, backend_kwargs, normalise_settings

try:
    from langchain_core.language_models.model_profile import ModelProfile
except ImportError:  # pragma: no cover - langchain-core < 1.1 has no model profiles
    ModelProfile = dict  # type: ignore[misc,assignment]

PROVIDER = "ssr"

API_KEY_ENV = "SSR_API_KEY"
"""The environment variable ``ChatSSR.api_key`` is read from (the ``vllm-server`` backend's key)."""


# the backends that talk to a server: ``api_key``, ``timeout`` and ``max_retries`` are theirs

# names users type for the most tokens to generate (OpenAI: max_tokens / max_completion_tokens, Ollama: num_predict)
_MAX_TOKENS_ALIASES = ("max_tokens", "max_completion_tokens", "num_predict")

# kwargs that LangChain helpers pass to any chat model and that mean nothing here
_IGNORED_KWARGS = frozenset({"parallel_tool_calls", "strict", "stream", "ls_structured_output_format",
                             "structured_output_format"})

# content blocks that carry no prompt text for the engine (the assistant's earlier reasoning and tool-call blocks,
# whose calls travel in ``AIMessage.tool_calls``)
_SKIPPED_BLOCKS = frozenset({"reasoning", "thinking", "redacted_thinking", "tool_use", "tool_call",
                             "tool_call_chunk", "invalid_tool_call", "server_tool_call", "server_tool_call_chunk",
                             "server_tool_result", "function_call"})

_engine_lock = threading.Lock()


def _usable(engine: Any) -> bool:
    """A loaded engine that has not been closed since."""
    return engine is not None and not getattr(engine, "closed", False)


def _accepted_arguments(cls: type) -> frozenset[str]:
    names = set(cls.model_fields) | set(_MAX_TOKENS_ALIASES)
    names |= {f.alias for f in cls.model_fields.values() if f.alias}
    return frozenset(names)


def _unknown_arguments_message(cls: type, unknown: list[str], accepted: frozenset[str]) -> str:
    own = sorted(n for n in accepted if n not in BaseChatModel.model_fields)
    hints = [f"{close[0]!r} for {name!r}" for name in unknown
             if (close := difflib.get_close_matches(name, accepted, n=1))]
    return (f"{cls.__name__} got unknown argument(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)" if hints
                                                                    else "")
            + f". It accepts: {', '.join(own)}; and LangChain's {', '.join(sorted(BaseChatModel.model_fields))}. "
            "Backend options (base_url, dtype, device, ...) go in backend_kwargs={...}, SSR's decoding settings in "
            "ssr_config=SSRConfig(...).")


class ChatSSR(BaseChatModel):
    """Chat model over an in-process SSR engine: think, draft the answer concurrently, verify it, answer sooner.

    The output is exactly what plain decoding of the same model would produce (token for token when greedy; the
    model's own distribution when sampling). ``ssr_config=SSRConfig(enabled=False)`` *is* plain decoding.

    Setup:
        ```bash
        pip install langchain-ssr   # from a checkout: pip install ./integrations/langchain (the model ships with ssr)
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

    Reasoning: ``reasoning=False`` answers without thinking (the model's own chat template, no chain of thought);
    ``reasoning_effort`` sets the thinking budget (``"low"``: 128, ``"medium"``: 512, ``"high"``: 2048 tokens of
    ``SSRConfig.max_think_tokens``). Both also work per call: ``llm.invoke(..., reasoning=False)``.

    Token counting (the model's own tokenizer; no weights are loaded, nothing is downloaded):
        ```python
        llm.get_num_tokens("some text")
        llm.get_num_tokens_from_messages(messages, tools=[get_weather])   # == usage_metadata["input_tokens"]
        llm.profile["max_input_tokens"]                                    # the model's context window
        ```

    Server backend (``backend="vllm-server"``): ``api_key`` (default: ``$SSR_API_KEY``; a ``SecretStr``, never shown
    or serialised), ``timeout`` (seconds per HTTP call) and ``max_retries`` (on connection errors) go to the backend;
    ``backend_kwargs={"base_url": ...}`` names the server.
    """

    model: str | None = None
    """Model name (an embedded model such as ``"qwen2.5-coder-0.5b-instruct"``) or a local directory.
    ``None`` is the embedded default model."""

    backend: str = "auto"
    """Engine backend: ``"auto"`` (llama.cpp for the embedded model when llama-cpp-python is installed, else
    transformers; ``ssr.backends.choose_backend``), ``"transformers"`` (in-process PyTorch), ``"llama.cpp"``,
    ``"vllm"`` or ``"vllm-server"``."""

    backend_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for ``ssr.get_engine`` (e.g. ``dtype``, ``device``). Only used when this
    ``(model, backend)`` pair is loaded for the first time in the process."""

    ssr_config: SSRConfig | None = None
    """Thinking budget, drafting and sampling settings (``None``: the engine's defaults).
    ``SSRConfig(enabled=False)`` is plain decoding."""

    temperature: float | None = None
    """Sampling temperature; 0 is greedy. Overrides ``ssr_config.temperature`` when set."""

    max_tokens: int | None = Field(default=None, gt=0, validation_alias=AliasChoices(*_MAX_TOKENS_ALIASES))
    """Most tokens to generate (thinking and answer together). Overrides ``ssr_config.max_tokens`` when set.
    Also accepted as ``max_completion_tokens`` (OpenAI) and ``num_predict`` (Ollama)."""

    top_p: float | None = None
    """Nucleus sampling mass. Overrides ``ssr_config.top_p`` when set."""

    top_k: int | None = None
    """Top-k sampling (0 disables it). Overrides ``ssr_config.top_k`` when set."""

    seed: int | None = None
    """Random seed for sampling."""

    cache_salt: str | None = Field(default=None, min_length=1)
    """vLLM's ``cache_salt``: a call reuses only the cached prompts of calls with the same salt, and its own prompt is
    kept under it (per tenant or user, where one engine serves several). ``None``: the engine's shared cache. Also
    per call: ``llm.invoke(..., cache_salt="user-1")``."""

    stop: list[str] | None = None
    """Stop strings (applied to the answer). A ``stop`` given per call replaces these."""

    streaming: bool = False
    """Whether ``invoke`` should stream internally (so callbacks see tokens as they arrive)."""

    reasoning: bool | None = None
    """``False``: answer without thinking (the model's own chat template; no reasoning in the output). ``True``:
    think first, the chain of thought in ``additional_kwargs["reasoning_content"]``. ``None``: the engine's default
    (think first)."""

    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """The thinking budget by name: ``"low"`` = 128, ``"medium"`` = 512, ``"high"`` = 2048 thinking tokens
    (``SSRConfig.max_think_tokens``, replacing ``ssr_config``'s). ``max_tokens`` still caps thinking and answer
    together: raise it with ``"high"``. ``None``: ``ssr_config``'s budget."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env(API_KEY_ENV, default=None))
    """API key of the ``vllm-server`` backend's server (default: ``$SSR_API_KEY``; the backend then falls back to
    ``$VLLM_API_KEY``). Held as a ``SecretStr``: hidden in ``repr`` and replaced by its variable name in ``dumpd``."""

    timeout: float | None = Field(default=None, gt=0)
    """Seconds the ``vllm-server`` backend waits for each HTTP call before raising ``SSRBackendTimeout`` (``None``:
    the backend's 120 s). In-process backends have no requests to time out and ignore it."""

    max_retries: int | None = Field(default=None, ge=0)
    """Retries of a ``vllm-server`` HTTP call that could not connect or lost its connection (``None``: the
    backend's 2). Timeouts are not retried. In-process backends ignore it."""

    engine: Any | None = Field(default=None, exclude=True)
    """An already built ``ssr.SSREngine`` to use instead of ``ssr.get_engine(model, backend)``."""

    _loaded: Any = PrivateAttr(default=None)

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, extra="forbid")

    # -- construction ----------------------------------------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _check_ssr_arguments(cls, values: Any) -> Any:
        """Unknown arguments are an error (naming the accepted ones); ``max_tokens``' aliases become ``max_tokens``;
        an ``api_key`` in ``backend_kwargs`` moves to the ``api_key`` field (so it is kept secret)."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        accepted = _accepted_arguments(cls)
        unknown = sorted(k for k in values if k not in accepted)
        if unknown:
            raise TypeError(_unknown_arguments_message(cls, unknown, accepted))
        return normalise_settings("ChatSSR", values, _MAX_TOKENS_ALIASES)

    # -- serialisation ---------------------------------------------------------------------------------------------

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd`` / ``load`` round-trip it (``load(..., valid_namespaces=["langchain_ssr"])``); an ``engine``
        object is not serialised, the API key travels as its environment variable's name."""
        return True

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": API_KEY_ENV}

    def to_json(self) -> Any:
        data = super().to_json()
        kwargs = data.get("kwargs") if isinstance(data, dict) else None
        if isinstance(kwargs, dict) and isinstance(kwargs.get("ssr_config"), SSRConfig):
            kwargs["ssr_config"] = kwargs["ssr_config"].to_dict()  # a plain dict; ChatSSR(ssr_config={...}) reads it
        return data

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
            "reasoning": self.reasoning,
            "reasoning_effort": self.reasoning_effort,
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

    def _backend_kwargs(self) -> dict[str, Any]:
        """``backend_kwargs`` plus, for a server backend, the API key, timeout and retries."""
        return backend_kwargs(self.backend, self.backend_kwargs, self.api_key, self.timeout, self.max_retries)

    def _get_engine(self, model: str | None = None) -> Any:
        """The engine for this model (loaded on first use; ``model`` overrides the configured model)."""
        if model is not None and model != self.model:
            import ssr

            return ssr.get_engine(model, self.backend, **self._backend_kwargs())
        if self.engine is not None:
            return self.engine
        if not _usable(self._loaded):
            import ssr

            with _engine_lock:
                if not _usable(self._loaded):
                    self._loaded = ssr.get_engine(self.model, self.backend, **self._backend_kwargs())
        return self._loaded

    async def _aget_engine(self, model: str | None = None) -> Any:
        if model is None or model == self.model:
            if self.engine is not None:
                return self.engine
            if _usable(self._loaded):
                return self._loaded
        return await asyncio.to_thread(self._get_engine, model)

    def close(self) -> None:
        """Free the engine this model loaded: its requests end, its lanes and weights are released (instances
        naming the same model share it, and load it again on their next call). An ``engine=`` passed in is the
        caller's to close."""
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], dict[str, Any], str | None]:
        """(model override, engine messages, engine call kwargs, reasoning effort) for one call."""
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        config = kwargs.pop("ssr_config", None) or self.ssr_config
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        response_format = kwargs.pop("response_format", None)
        call: dict[str, Any] = {"config": config}
        for alias in _MAX_TOKENS_ALIASES[1:]:  # per call too: max_completion_tokens / num_predict are max_tokens
            if kwargs.get(alias) is not None and kwargs.get("max_tokens") is None:
                kwargs["max_tokens"] = kwargs[alias]
            kwargs.pop(alias, None)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "cache_salt"):
            value = kwargs.pop(name, None)
            call[name] = value if value is not None else getattr(self, name)
        stop = stop if stop is not None else kwargs.get("stop")
        kwargs.pop("stop", None)
        call["stop"] = list(stop) if stop is not None else self.stop
        reasoning = kwargs.pop("reasoning", None)
        if (reasoning if reasoning is not None else self.reasoning) is not None:
            call["thinking"] = reasoning if reasoning is not None else self.reasoning
        effort = kwargs.pop("reasoning_effort", None) or self.reasoning_effort
        if effort is not None and effort not in REASONING_EFFORT_BUDGETS:
            raise ValueError(f"reasoning_effort must be one of {sorted(REASONING_EFFORT_BUDGETS)}, got {effort!r}")
        unknown = set(kwargs) - _IGNORED_KWARGS
        if unknown:
            warnings.warn(f"ChatSSR ignores unsupported argument(s) {sorted(unknown)}", stacklevel=4)
        if tools:
            call["tools"] = [convert_to_openai_tool(t) for t in tools]
            if tool_choice is not None:
                call["tool_choice"] = _tool_choice(tool_choice, call["tools"])
        engine_messages = convert_messages(messages)
        if response_format:  # the schema in words, for the model; the engine's grammar makes the answer follow it
            _add_instruction(engine_messages, _format_instruction(response_format))
            call["response_format"] = response_format
        return model, engine_messages, {k: v for k, v in call.items() if v is not None}, effort

    @staticmethod
    def _with_effort(call: dict[str, Any], effort: str | None, engine: Any) -> dict[str, Any]:
        """``reasoning_effort`` as a config override: the thinking budget replaced, everything else kept."""
        if effort is None or call.get("thinking") is False:
            return call
        budget = REASONING_EFFORT_BUDGETS[effort]
        base = call.get("config") or engine.config
        config = base.override(max_think_tokens=budget, min_think_tokens=min(base.min_think_tokens, budget))
        return {**call, "config": config}

    # -- generation ------------------------------------------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        model, prompt, call, effort = self._request(messages, stop, kwargs)
        engine = self._get_engine(model)
        return _chat_result(engine.generate(prompt, **self._with_effort(call, effort, engine)), engine.model_name)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        model, prompt, call, effort = self._request(messages, stop, kwargs)
        engine = await self._aget_engine(model)
        result = await engine.agenerate(prompt, **self._with_effort(call, effort, engine))
        return _chat_result(result, engine.model_name)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        model, prompt, call, effort = self._request(messages, stop, kwargs)
        engine = self._get_engine(model)
        assembler = _StreamAssembler(model_name=engine.model_name)
        events = engine.stream(prompt, **self._with_effort(call, effort, engine))
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
        model, prompt, call, effort = self._request(messages, stop, kwargs)
        engine = await self._aget_engine(model)
        assembler = _StreamAssembler(model_name=engine.model_name)
        events = engine.astream(prompt, **self._with_effort(call, effort, engine))
        try:
            async for event in events:
                for chunk in assembler.feed(event):
                    yield chunk
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()  # cancels the request and frees its lanes

    # -- token counting and the model profile (the tokenizer and config alone: no weights) ------------------------

    def _tokenizer_and_family(self) -> tuple[Any, Any]:
        """The loaded engine's tokenizer and chat family, else the model's tokenizer alone (cached per model)."""
        engine = self.engine if self.engine is not None else self._loaded
        if engine is not None:
            return engine.tokenizer, engine.family
        return tokenizer_and_family(self.model)

    def get_token_ids(self, text: str) -> list[int]:
        """The model's token ids for ``text`` (no special tokens added; offline, no weights loaded)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        tokenizer, _ = self._tokenizer_and_family()
        return list(tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None, *,
                                     tool_choice: dict | str | bool | None = None) -> int:
        """The prompt length the engine will prefill for ``messages``: the exact chat template it renders, with
        SSR's thinking setup (or without it, with ``reasoning=False``), ``tools`` and ``tool_choice`` (whose
        instruction and demonstration change the prompt). Equals ``usage_metadata["input_tokens"]`` of the call."""
        if not isinstance(messages, list):
            messages = self._convert_input(messages).to_messages()
        if not messages:
            return 0
        tokenizer, family = self._tokenizer_and_family()
        from ssr.chat import encode_prompt

        openai_tools = [convert_to_openai_tool(t) for t in tools] if tools else None
        choice = _tool_choice(tool_choice, openai_tools) if openai_tools and tool_choice not in (None, False) else None
        extra = {"thinking": self.reasoning} if self.reasoning is not None else {}
        return len(encode_prompt(tokenizer, family, convert_messages(messages), openai_tools, choice, **extra))

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What the model can do, from its config (no weights): context window, output budget, reasoning, tools."""
        engine = self.engine
        if engine is not None:
            context_window = engine.context_window
        else:
            config = model_config(self.model, build=False)  # building a ChatSSR never converts the model
            context_window = context_window_of(config) if config is not None else None
        base = self.ssr_config or (engine.config if engine is not None else SSRConfig())
        profile = ModelProfile(
            name=self.model_name,
            open_weights=True,
            text_inputs=True,
            image_inputs=False,
            image_url_inputs=False,
            pdf_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            image_tool_message=False,
            pdf_tool_message=False,
            max_output_tokens=self.max_tokens or base.max_tokens,
            reasoning_output=True,
            reasoning_effort_levels=list(REASONING_EFFORT_BUDGETS),
            reasoning_effort_default="medium",  # SSRConfig's default thinking budget, 512 tokens
            text_outputs=True,
            image_outputs=False,
            audio_outputs=False,
            video_outputs=False,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,  # grammar-constrained: json_schema / json_mode answers and forced tool calls
            temperature=True,
        )
        if context_window:
            profile["max_input_tokens"] = int(context_window)
        return profile

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
        last user turn) for a JSON answer that follows the schema; ``"json_mode"`` asks for a JSON object and leaves
        the keys to the prompt. The answer is grammar-constrained in every method (the engine's ``ssr.grammar``):
        the call's or the answer's JSON always parses and follows the schema, unless the token budget cuts it off.
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
    """Token counts; ``cache_read``: prompt tokens whose KV cache came from the previous request of the
    conversation (``stats["reused_prompt_tokens"]``), ``reasoning``: thinking tokens."""
    output = len(res.token_ids)
    usage = UsageMetadata(
        input_tokens=res.prompt_tokens,
        output_tokens=output,
        total_tokens=res.prompt_tokens + output,
        output_token_details={"reasoning": int(res.stats.get("think_tokens", 0))},
    )
    if "reused_prompt_tokens" in res.stats:
        usage["input_token_details"] = {"cache_read": int(res.stats["reused_prompt_tokens"])}
    return usage


def _response_metadata(res: Any, model_name: str) -> dict[str, Any]:
    """``token_ids``/``prompt_token_ids``: what was generated and the prompt it was generated from (template and
    recipe applied), to compare runs token for token and to see what an agent step's cache could reuse.
    ``tool_call_errors``: what the engine found wrong with the well-formed calls that still go out as tool calls
    (``GenerationResult.executable_tool_calls``: the tool executor rejects them, the model reads why)."""
    errors = [{"id": c.get("id"), "name": c["name"], "error": c.get("error")}
              for c in res.invalid_tool_calls if "arguments" in c]
    return {"model_name": model_name, "model_provider": PROVIDER, "finish_reason": res.finish_reason,
            "token_ids": list(res.token_ids), "prompt_token_ids": list(res.prompt_token_ids), "ssr": res.stats,
            **({"tool_call_errors": errors} if errors else {}),
            **({"near_ties": dict(res.near_ties)} if res.near_ties else {})}


def _content(res: Any) -> str:
    return res.content if res.content is not None else res.answer


def _chat_result(res: Any, model_name: str) -> ChatResult:
    message = AIMessage(
        content=_content(res),
        additional_kwargs={"reasoning_content": res.reasoning} if res.reasoning else {},
        tool_calls=[tool_call(name=c["name"], args=c["arguments"], id=c.get("id"))
                    for c in res.executable_tool_calls],
        invalid_tool_calls=[invalid_tool_call(name=c.get("name"), args=_raw_arguments(c.get("args")), id=c.get("id"),
                                              error=c.get("error")) for c in res.unparsed_tool_calls],
        usage_metadata=_usage(res),
        response_metadata=_response_metadata(res, model_name),
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


class _StreamAssembler:
    """Engine stream events -> ``ChatGenerationChunk``s whose sum equals the ``invoke`` message.

    Reasoning deltas become chunks with ``additional_kwargs["reasoning_content"]``; answer deltas (with tools
    bound, the engine sends only the text outside tool calls) become text chunks; the engine's tool-call deltas
    become ``tool_call_chunks`` as they arrive (id and name first, then argument fragments). The ``done`` event
    adds any remaining text, calls the stream never carried, and a last chunk with usage and response metadata.
    Tool-call chunk indices start after the reasoning and text blocks, so the ``index``-keyed merging of v1
    content blocks never folds a tool call into them.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.reasoning = ""  # reasoning emitted
        self.text = ""  # answer text emitted
        self.blocks = 0  # runs of block types emitted so far (reasoning, text)
        self.last_kind: str | None = None
        self.call_index: dict[int, int] = {}  # the engine's call index -> this message's chunk index
        self.streamed_ids: set[str] = set()

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

    def _call_chunk(self, call_id: str | None, name: str | None, args: str | None, index: int) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", tool_call_chunks=[tool_call_chunk(name=name, args=args, id=call_id, index=index)],
            response_metadata={"model_provider": PROVIDER}))

    def feed(self, event: Any) -> Iterator[ChatGenerationChunk]:
        if event.kind == "reasoning":
            if event.text:
                yield self._chunk("reasoning", event.text)
        elif event.kind == "answer":
            if event.text:
                yield self._chunk("text", event.text)
        elif event.kind == "tool_call":
            delta = event.tool_call
            index = self.call_index.setdefault(delta.index, self.blocks + len(self.call_index))
            if delta.id:
                self.streamed_ids.add(delta.id)
            yield self._call_chunk(delta.id, delta.name, delta.arguments, index)
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
        calls = [(c.get("id"), c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                 for c in res.executable_tool_calls]
        calls += [(c.get("id"), c.get("name"), _raw_arguments(c.get("args"))) for c in res.unparsed_tool_calls]
        first = self.blocks + len(self.call_index)
        for i, (call_id, name, args) in enumerate(c for c in calls if c[0] not in self.streamed_ids):
            yield self._call_chunk(call_id, name, args, first + i)
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
