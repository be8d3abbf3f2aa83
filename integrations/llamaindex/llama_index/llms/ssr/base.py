"""SSR: a LlamaIndex LLM over the self-speculative reasoning engine (in-process, no server)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

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
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from ssr import SSRConfig

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
_ENGINE_KWARGS = ("tools", "tool_choice", "config", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


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
        `pip install "ssr[llamaindex]"`

        ```python
        from llama_index.core.llms import ChatMessage
        from llama_index.llms.ssr import SSR
        from ssr import SSRConfig

        llm = SSR(ssr_config=SSRConfig(max_think_tokens=256))   # the embedded default model
        response = llm.chat([ChatMessage(role="user", content="What is 17 * 23?")])
        print(response.message.content, response.additional_kwargs["ssr"])
        ```
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: Optional[str] = Field(
        default=None,
        description="Model name or local directory; None is the embedded default (Qwen2.5-Coder-0.5B-Instruct).",
    )
    backend: str = Field(default="transformers", description="Engine backend: 'transformers' or 'vllm'.")
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
        default=None, gt=0, description="Most tokens generated (reasoning + answer); None keeps ssr_config's."
    )
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling; None keeps ssr_config's.")
    top_k: Optional[int] = Field(default=None, ge=0, description="Top-k sampling (0 disables); None keeps ssr_config's.")
    seed: Optional[int] = Field(default=None, description="Sampling seed; None keeps ssr_config's.")
    stop: Optional[List[str]] = Field(default=None, description="Stop strings; None keeps ssr_config's.")

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        """``engine``: an already built ``ssr.SSREngine`` to use instead of ``ssr.get_engine(model, backend)``."""
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "SSR_llm"

    # -- engine --------------------------------------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The engine, loaded on first use from the process-wide cache (one per (model, backend))."""
        if self._engine is None:
            from ssr import get_engine

            self._engine = get_engine(model=self.model, backend=self.backend, **self.backend_kwargs)
        return self._engine

    async def _aengine(self) -> Any:
        if self._engine is None:  # loading takes seconds: keep it off the event loop
            await asyncio.to_thread(lambda: self.engine)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        config = self.ssr_config or engine.config
        return LLMMetadata(
            context_window=engine.context_window,
            num_output=self.max_tokens or config.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=engine.model_name,
        )

    def _engine_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        params: Dict[str, Any] = {
            "config": self.ssr_config, "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
        }
        params.update({k: kwargs[k] for k in _ENGINE_KWARGS if k in kwargs})
        if params.get("tools"):
            params["tools"] = [tool_to_openai(t) for t in params["tools"]]
        else:
            params.pop("tools", None)
            params.pop("tool_choice", None)
        return {k: v for k, v in params.items() if v is not None}

    # -- chat ----------------------------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = self.engine
        result = engine.generate(to_engine_messages(messages), **self._engine_kwargs(kwargs))
        return chat_response_from_result(result, engine.model_name)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        engine = await self._aengine()
        result = await engine.agenerate(to_engine_messages(messages), **self._engine_kwargs(kwargs))
        return chat_response_from_result(result, engine.model_name)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, params = to_engine_messages(messages), self._engine_kwargs(kwargs)

        def gen() -> ChatResponseGen:
            engine = self.engine
            events = engine.stream(prompt, **params)
            acc = StreamAccumulator(model_name=engine.model_name, tools_bound=bool(params.get("tools")))
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
            events = engine.astream(prompt, **params)
            acc = StreamAccumulator(model_name=engine.model_name, tools_bound=bool(params.get("tools")))
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
