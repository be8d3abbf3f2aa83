"""SSR: a LlamaIndex LLM over the self-speculative reasoning engine (in-process, no server)."""

from __future__ import annotations

import asyncio
import difflib
import os
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, SecretStr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from ssr import SSRConfig
from ssr.models import context_window as context_window_of
from ssr.models import model_config, tokenizer_and_family
from ssr.settings import REASONING_EFFORT_BUDGETS, backend_kwargs, normalise_settings

from .utils import (
    StreamAccumulator,
    chat_response_from_result,
    reasoning_of,
    resolve_tool_choice,
    to_engine_messages,
    tool_selections_from_message,
    tool_to_openai,
)

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

# per-call keyword arguments that go to the engine; anything else LlamaIndex passes along is ignored
_ENGINE_KWARGS = ("tools", "tool_choice", "config", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "cache_salt")

API_KEY_ENV = "SSR_API_KEY"
"""The environment variable ``SSR.api_key`` is read from (the ``vllm-server`` backend's key)."""


_MAX_TOKENS_ALIASES = ("max_tokens", "num_output")  # num_output: LlamaIndex's LLMMetadata name for it

def _api_key_from_env() -> Optional[SecretStr]:
    value = os.environ.get(API_KEY_ENV)
    return SecretStr(value) if value else None


def _to_completion(response: ChatResponse) -> CompletionResponse:
    return CompletionResponse(
        text=response.message.content or "",
        delta=response.delta,
        raw=response.raw,
        additional_kwargs={**response.message.additional_kwargs, **response.additional_kwargs,
                           "thinking": reasoning_of(response.message)},
    )


class SSR(FunctionCallingLLM):
    """A reasoning model served in-process by SSR (self-speculative decoding).

    While the model thinks, drafts of its answer are written alongside and verified afterwards, so the answer
    arrives sooner and is exactly what plain decoding would produce. Reasoning arrives as ``ThinkingBlock``s
    (streaming: ``additional_kwargs["thinking_delta"]``), never in the answer text; each response carries the
    engine's SSR stats in ``additional_kwargs["ssr"]``.

    Examples:
        `pip install llama-index-llms-ssr` (from a checkout: `pip install ./integrations/llamaindex`)

        ```python
        from llama_index.core.llms import ChatMessage
        from llama_index.llms.ssr import SSR
        from ssr import SSRConfig

        llm = SSR(ssr_config=SSRConfig(max_think_tokens=256))   # the embedded default model
        response = llm.chat([ChatMessage(role="user", content="What is 17 * 23?")])
        print(response.message.content, response.additional_kwargs["ssr"])
        ```

    ``thinking=False`` answers without thinking (the model's own chat template); ``reasoning_effort`` sets the
    thinking budget (``"low"``: 128, ``"medium"``: 512, ``"high"``: 2048 tokens of ``SSRConfig.max_think_tokens``).
    Both work per call too (``llm.chat(messages, thinking=False)``). ``llm.metadata`` and the token counts
    (``get_num_tokens``, ``get_num_tokens_from_messages``; ``Settings.tokenizer = llm.tokenizer``) read the
    model's config and tokenizer alone: no weights are loaded. With ``backend="vllm-server"``, ``api_key`` (default
    ``$SSR_API_KEY``, a ``SecretStr``, never serialised), ``timeout`` and ``max_retries`` go to the backend.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    model: Optional[str] = Field(
        default=None,
        description="Model name or local directory; None is the embedded default (Qwen2.5-Coder-0.5B-Instruct).",
    )
    backend: str = Field(default="auto", description="Engine backend: 'auto' (llama.cpp for the embedded model when "
                         "llama-cpp-python is installed, else transformers), 'transformers', 'llama.cpp', 'vllm' or "
                         "'vllm-server'.")
    backend_kwargs: Dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for loading the backend (dtype, device, ...)."
    )
    ssr_config: Optional[SSRConfig] = Field(
        default=None,
        description="Budgets, drafting and sampling (an ssr.SSRConfig); None is the engine's default. "
        "SSRConfig(enabled=False) is plain decoding.",
    )
    temperature: Optional[float] = Field(
        default=None, ge=0.0, description="Sampling temperature; None keeps ssr_config's (0.0, greedy, by default)."
    )
    max_tokens: Optional[int] = Field(
        default=None, gt=0,
        description="Most tokens generated (reasoning + answer); None keeps ssr_config's. Also accepted as num_output.",
    )
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling; None keeps ssr_config's.")
    top_k: Optional[int] = Field(default=None, ge=0, description="Top-k sampling (0 disables); None keeps ssr_config's.")
    seed: Optional[int] = Field(default=None, description="Sampling seed; None keeps ssr_config's.")
    stop: Optional[List[str]] = Field(default=None, description="Stop strings; None keeps ssr_config's.")
    cache_salt: Optional[str] = Field(
        default=None, min_length=1,
        description="vLLM's cache_salt: a call reuses only the cached prompts of calls with the same salt, and its "
        "own prompt is kept under it (per tenant or user); None: the engine's shared cache. Also per call.",
    )
    thinking: Optional[bool] = Field(
        default=None,
        description="False: answer without thinking (the model's own chat template, no ThinkingBlock); "
        "True or None: think first (the engine's default).",
    )
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = Field(
        default=None,
        description="Thinking budget by name: low = 128, medium = 512, high = 2048 thinking tokens "
        "(SSRConfig.max_think_tokens); max_tokens still caps thinking and answer together. None keeps ssr_config's.",
    )
    api_key: Optional[SecretStr] = Field(
        default_factory=_api_key_from_env, exclude=True,
        description="API key of the vllm-server backend's server (default: $SSR_API_KEY, then the backend's "
        "$VLLM_API_KEY); hidden in repr, never serialised.",
    )
    timeout: Optional[float] = Field(
        default=None, gt=0,
        description="Seconds the vllm-server backend waits for each HTTP call (None: 120); in-process backends "
        "ignore it.",
    )
    max_retries: Optional[int] = Field(
        default=None, ge=0,
        description="Retries of a vllm-server HTTP call that could not connect (None: 2); timeouts are not "
        "retried; in-process backends ignore it.",
    )

    _engine: Any = PrivateAttr(default=None)
    _owns_engine: bool = PrivateAttr(default=False)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        """``engine``: an already built ``ssr.SSREngine`` to use instead of ``ssr.get_engine(model, backend)``.

        Unknown arguments raise ``TypeError`` naming them and the accepted ones; ``num_output`` is ``max_tokens``.
        An ``api_key`` in ``backend_kwargs`` moves to the ``api_key`` field (kept secret).
        """
        accepted = set(type(self).model_fields) | set(_MAX_TOKENS_ALIASES)
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            hints = [f"{close[0]!r} for {name!r}" for name in unknown
                     if (close := difflib.get_close_matches(name, accepted, n=1))]
            raise TypeError(
                f"SSR got unknown argument(s) {unknown}" + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                + f". It accepts: engine, {', '.join(sorted(accepted))}. Backend options (base_url, dtype, device, "
                "...) go in backend_kwargs={...}, SSR's decoding settings in ssr_config=SSRConfig(...)."
            )
        super().__init__(**normalise_settings("SSR", kwargs, _MAX_TOKENS_ALIASES))
        self._engine = engine
        self._owns_engine = False

    @classmethod
    def class_name(cls) -> str:
        return "SSR_llm"

    # -- engine --------------------------------------------------------------------------------------------------

    def _backend_kwargs(self) -> Dict[str, Any]:
        """``backend_kwargs`` plus, for a server backend, the API key, timeout and retries."""
        return backend_kwargs(self.backend, self.backend_kwargs, self.api_key, self.timeout, self.max_retries)

    @property
    def engine(self) -> Any:
        """The engine, loaded on first use from the process-wide cache (one per (model, backend))."""
        if self._engine is None or (self._owns_engine and self._engine.closed):
            from ssr import get_engine

            self._engine = get_engine(model=self.model, backend=self.backend, **self._backend_kwargs())
            self._owns_engine = True
        return self._engine

    def close(self) -> None:
        """Free the engine this LLM loaded: its requests end, its lanes and weights are released (instances naming
        the same model share it, and load it again on their next call). An ``engine=`` passed in is the caller's."""
        if self._owns_engine and self._engine is not None:
            self._engine.close()
            self._engine, self._owns_engine = None, False

    async def _aengine(self) -> Any:
        if self._engine is None or (self._owns_engine and self._engine.closed):  # loading takes seconds: off the loop
            await asyncio.to_thread(lambda: self.engine)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """Context window (the loaded engine's, else the model config's ``max_position_embeddings``), the output
        budget (``max_tokens``, else ``ssr_config``'s), chat and function calling; no weights are loaded."""
        engine = self._engine
        if engine is not None:
            context_window, name, config = engine.context_window, engine.model_name, self.ssr_config or engine.config
        else:
            from ssr.models import canonical_name

            context_window = context_window_of(model_config(self.model))
            name, config = canonical_name(self.model), self.ssr_config or SSRConfig()
        return LLMMetadata(
            context_window=context_window or LLMMetadata.model_fields["context_window"].default,
            num_output=self.max_tokens or config.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=name,
        )

    # -- token counting (the model's tokenizer alone: no weights, nothing downloaded) -----------------------------

    def _tokenizer_and_family(self) -> Any:
        engine = self._engine
        if engine is not None and getattr(engine, "tokenizer", None) is not None:
            return engine.tokenizer, engine.family
        return tokenizer_and_family(self.model)

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (``Settings.tokenizer = llm.tokenizer`` counts with it)."""
        return self._tokenizer_and_family()[0]

    def get_token_ids(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added); a ``TokenCountingHandler(tokenizer=...)`` callable."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(
        self,
        messages: Sequence[ChatMessage],
        tools: Optional[Sequence[Any]] = None,
        tool_choice: Union[str, Dict[str, Any], None] = None,
        tool_required: bool = False,
    ) -> int:
        """The prompt length the engine will prefill for ``messages`` (equals the response's ``prompt_tokens``):
        the exact chat template it renders, with SSR's thinking setup (none with ``thinking=False``), the tools
        and the ``tool_choice`` instruction."""
        if not messages:
            return 0
        from ssr.chat import encode_prompt

        tokenizer, family = self._tokenizer_and_family()
        specs = [tool_to_openai(t) for t in tools] if tools else None
        choice = resolve_tool_choice(tool_choice, tool_required) if specs else None
        extra = {"thinking": self.thinking} if self.thinking is not None else {}
        return len(encode_prompt(tokenizer, family, to_engine_messages(messages), specs, choice, **extra))

    # -- engine arguments ----------------------------------------------------------------------------------------

    def _engine_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        params: Dict[str, Any] = {
            "config": self.ssr_config, "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
            "cache_salt": self.cache_salt,
        }
        if kwargs.get("num_output") is not None and kwargs.get("max_tokens") is None:
            params["max_tokens"] = kwargs["num_output"]
        params.update({k: kwargs[k] for k in _ENGINE_KWARGS if k in kwargs and kwargs[k] is not None})
        if params.get("tools"):
            params["tools"] = [tool_to_openai(t) for t in params["tools"]]
        else:
            params.pop("tools", None)
            params.pop("tool_choice", None)
        thinking = kwargs.get("thinking", self.thinking)
        if thinking is not None:
            params["thinking"] = thinking
        effort = kwargs.get("reasoning_effort") or self.reasoning_effort
        if effort is not None:
            if effort not in REASONING_EFFORT_BUDGETS:
                raise ValueError(f"reasoning_effort must be one of {sorted(REASONING_EFFORT_BUDGETS)}, got {effort!r}")
            if thinking is not False:
                params["reasoning_effort"] = effort  # resolved against the engine's config in _call_kwargs
        return {k: v for k, v in params.items() if v is not None}

    @staticmethod
    def _call_kwargs(params: Dict[str, Any], engine: Any) -> Dict[str, Any]:
        """``reasoning_effort`` as a config override of the thinking budget (everything else kept)."""
        params = dict(params)
        effort = params.pop("reasoning_effort", None)
        if effort is not None:
            budget = REASONING_EFFORT_BUDGETS[effort]
            base = params.get("config") or engine.config
            params["config"] = base.override(max_think_tokens=budget,
                                             min_think_tokens=min(base.min_think_tokens, budget))
        return params

    # -- chat ----------------------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = self.engine
        params = self._call_kwargs(self._engine_kwargs(kwargs), engine)
        result = engine.generate(to_engine_messages(messages), **params)
        return chat_response_from_result(result, engine.model_name)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = await self._aengine()
        params = self._call_kwargs(self._engine_kwargs(kwargs), engine)
        result = await engine.agenerate(to_engine_messages(messages), **params)
        return chat_response_from_result(result, engine.model_name)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, params = to_engine_messages(messages), self._engine_kwargs(kwargs)

        def gen() -> ChatResponseGen:
            engine = self.engine
            events = engine.stream(prompt, **self._call_kwargs(params, engine))
            acc = StreamAccumulator(model_name=engine.model_name)
            try:
                for event in events:
                    chunk = acc.feed(event)
                    if chunk is not None:
                        yield chunk
            finally:  # stopping early cancels the request
                if hasattr(events, "close"):
                    events.close()

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, params = to_engine_messages(messages), self._engine_kwargs(kwargs)

        async def gen() -> ChatResponseAsyncGen:
            engine = await self._aengine()
            events = engine.astream(prompt, **self._call_kwargs(params, engine))
            acc = StreamAccumulator(model_name=engine.model_name)
            try:
                async for event in events:
                    chunk = acc.feed(event)
                    if chunk is not None:
                        yield chunk
            finally:  # stopping early cancels the request and frees its lanes
                if hasattr(events, "aclose"):
                    await events.aclose()

        return gen()

    # -- completion (one user message) ---------------------------------------------------------------------------

    def _completion_messages(self, prompt: str, formatted: bool) -> List[ChatMessage]:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return [ChatMessage(role=MessageRole.USER, content=prompt)]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _to_completion(self.chat(self._completion_messages(prompt, formatted), **kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _to_completion(await self.achat(self._completion_messages(prompt, formatted), **kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        chunks = self.stream_chat(self._completion_messages(prompt, formatted), **kwargs)
        return (_to_completion(chunk) for chunk in chunks)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        chunks = await self.astream_chat(self._completion_messages(prompt, formatted), **kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async for chunk in chunks:
                yield _to_completion(chunk)

        return gen()

    # -- tools ---------------------------------------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence["BaseTool"],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[List[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Union[str, Dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        tool_specs = [tool_to_openai(tool) for tool in tools]
        return {
            "messages": messages,
            "tools": tool_specs or None,
            "tool_choice": resolve_tool_choice(tool_choice, tool_required) if tool_specs else None,
            **kwargs,
        }

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence["BaseTool"],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:  # keep only the first call
            message = response.message
            calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
            message.blocks = [b for b in message.blocks if not isinstance(b, ToolCallBlock)] + calls[:1]
            if message.additional_kwargs.get("tool_calls"):
                message.additional_kwargs["tool_calls"] = message.additional_kwargs["tool_calls"][:1]
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> List[ToolSelection]:
        """Tool calls of a response; works on every streamed chunk (calls still being written have partial args)."""
        selections = tool_selections_from_message(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but the model answered: {response.message.content!r}")
        return selections
