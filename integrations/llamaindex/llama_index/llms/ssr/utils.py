"""Pure conversions between LlamaIndex objects and the SSR engine's plain dicts (no model, no I/O)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json

ROLE_MAP = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}

# blocks that carry nothing the model should read again (earlier reasoning is not re-sent, as chat templates of
# reasoning models drop it; tool calls travel in "tool_calls")
_SKIPPED_BLOCKS = (ThinkingBlock, ToolCallBlock, CachePoint)


# ---------------------------------------------------------------------------------------------------------------
# LlamaIndex -> engine


def tool_to_openai(tool: Any) -> Dict[str, Any]:
    """An OpenAI-style tool dict from a LlamaIndex tool (or a dict that already is one)."""
    if isinstance(tool, dict):
        return tool
    return tool.metadata.to_openai_tool(skip_length_check=True)


def resolve_tool_choice(tool_choice: Any = None, tool_required: bool = False) -> Optional[str]:
    """The engine's tool_choice: None/"auto", "none", "required" or a tool name."""
    if isinstance(tool_choice, dict):  # OpenAI style {"type": "function", "function": {"name": ...}}
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if tool_choice:
        return "required" if tool_choice == "any" else str(tool_choice)
    return "required" if tool_required else "auto"


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the engine takes them (dict, or a JSON string as given)."""
    if value is None:
        return {}
    if isinstance(value, (dict, str)):
        return value
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return dict(value)


def engine_tool_call(call: Any) -> Optional[Dict[str, Any]]:
    """One OpenAI-style tool call dict from any of the shapes LlamaIndex code stores in messages."""
    if isinstance(call, ToolCallBlock):
        return {"id": call.tool_call_id or "", "type": "function",
                "function": {"name": call.tool_name, "arguments": _arguments(call.tool_kwargs)}}
    if isinstance(call, ToolSelection):
        return {"id": call.tool_id, "type": "function",
                "function": {"name": call.tool_name, "arguments": _arguments(call.tool_kwargs)}}
    if hasattr(call, "model_dump"):  # e.g. an OpenAI SDK ChatCompletionMessageToolCall
        call = call.model_dump()
    if not isinstance(call, dict):
        return None
    if isinstance(call.get("function"), dict):  # OpenAI style
        fn = call["function"]
        return {"id": call.get("id") or "", "type": "function",
                "function": {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments"))}}
    if "name" in call:  # the engine's own {"id", "name", "arguments"}
        return {"id": call.get("id") or "", "type": "function",
                "function": {"name": call["name"], "arguments": _arguments(call.get("arguments", call.get("args")))}}
    return None


def _message_text(message: ChatMessage) -> str:
    texts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, _SKIPPED_BLOCKS):
            raise ValueError(
                f"SSR models read text only; a {message.role.value} message holds a {block.block_type!r} block"
            )
    return "\n".join(texts)


def to_engine_messages(messages: Sequence[ChatMessage]) -> List[Dict[str, Any]]:
    """LlamaIndex chat messages -> the engine's OpenAI-style message dicts.

    Assistant tool calls come from ``ToolCallBlock``s, else from ``additional_kwargs["tool_calls"]``; tool results
    (role "tool") take ``tool_call_id`` from ``additional_kwargs`` and their ``name`` from it or, failing that, from
    the assistant call with that id.
    """
    out: List[Dict[str, Any]] = []
    names_by_id: Dict[str, str] = {}
    for message in messages:
        role = ROLE_MAP.get(message.role, str(message.role.value))
        entry: Dict[str, Any] = {"role": role, "content": _message_text(message)}
        extra = message.additional_kwargs or {}
        if role == "assistant":
            calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)] or extra.get("tool_calls") or []
            tool_calls = [c for c in (engine_tool_call(call) for call in calls) if c is not None]
            if tool_calls:
                entry["tool_calls"] = tool_calls
                names_by_id.update({c["id"]: c["function"]["name"] for c in tool_calls if c["id"]})
        elif role == "tool":
            call_id = extra.get("tool_call_id") or extra.get("id")
            if call_id:
                entry["tool_call_id"] = str(call_id)
            name = extra.get("name") or extra.get("tool_name") or names_by_id.get(str(call_id or ""))
            if name:
                entry["name"] = name
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------------------------
# engine -> LlamaIndex


def openai_tool_calls(tool_calls: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The engine's ``[{"id", "name", "arguments": dict}]`` as OpenAI-style dicts (arguments as a JSON string)."""
    return [{"id": c.get("id") or "", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments") or {})}}
            for c in tool_calls]


def usage_of(result: Any) -> Dict[str, Any]:
    """OpenAI-style usage: token counts, ``reasoning_tokens`` (thinking) and ``cached_tokens`` (prompt tokens whose
    KV cache came from the previous request of the conversation: ``stats["reused_prompt_tokens"]``), flat and in
    ``prompt_tokens_details`` / ``completion_tokens_details`` as OpenAI nests them."""
    completion = len(result.token_ids)
    usage: Dict[str, Any] = {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
                             "total_tokens": result.prompt_tokens + completion}
    stats = result.stats or {}
    think = stats.get("think_tokens")
    if think is not None:
        usage["reasoning_tokens"] = think
        usage["completion_tokens_details"] = {"reasoning_tokens": think}
    cached = stats.get("reused_prompt_tokens")
    if cached is not None:
        usage["cached_tokens"] = cached
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def raw_of(result: Any, model_name: Optional[str] = None) -> Dict[str, Any]:
    """A JSON-able summary of a GenerationResult (the response's ``raw``)."""
    return {
        "model": model_name,
        "reasoning": result.reasoning,
        "answer": result.answer,
        "content": result.content if result.content is not None else result.answer,
        "tool_calls": list(result.tool_calls),
        "invalid_tool_calls": list(result.invalid_tool_calls),
        "finish_reason": result.finish_reason,
        "usage": usage_of(result),
        "stats": result.stats,
        "token_ids": list(result.token_ids),  # what was generated, to compare runs token for token
        "prompt_token_ids": list(result.prompt_token_ids),  # the prompt it came from (template and recipe applied)
        # positions decided within the kernel noise, on a backend whose rows depend on the batch (llama.cpp)
        **({"near_ties": dict(result.near_ties)} if result.near_ties else {}),
    }


def build_message(
    reasoning: str,
    content: str,
    tool_calls: Sequence[Dict[str, Any]] = (),
    think_tokens: Optional[int] = None,
    invalid_tool_calls: Sequence[Dict[str, Any]] = (),
) -> ChatMessage:
    """An assistant message: ThinkingBlock (if any reasoning), TextBlock, then one ToolCallBlock per call.

    ``tool_calls`` are the engine's ``{"id", "name", "arguments"}`` dicts (``id`` None while a call is still being
    streamed): the valid calls and the well-formed ones the engine flagged (an unknown tool, arguments that miss the
    schema), which a FunctionAgent answers with its error, as it does for any LLM. ``invalid_tool_calls`` (every
    flagged call, with the engine's error) go to ``additional_kwargs``.
    """
    blocks: List[Any] = []
    if reasoning:
        blocks.append(ThinkingBlock(content=reasoning, num_tokens=think_tokens))
    blocks.append(TextBlock(text=content))
    blocks.extend(ToolCallBlock(tool_call_id=c.get("id"), tool_name=c["name"], tool_kwargs=c.get("arguments") or {})
                  for c in tool_calls)
    extra: Dict[str, Any] = {}
    if tool_calls:
        extra["tool_calls"] = openai_tool_calls(tool_calls)
    if invalid_tool_calls:
        extra["invalid_tool_calls"] = list(invalid_tool_calls)
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def chat_response_from_result(result: Any, model_name: Optional[str] = None) -> ChatResponse:
    """A complete ChatResponse for a finished generation."""
    content = result.content if result.content is not None else result.answer
    message = build_message(result.reasoning, content, result.executable_tool_calls,
                            think_tokens=(result.stats or {}).get("think_tokens"),
                            invalid_tool_calls=result.invalid_tool_calls)
    usage = usage_of(result)
    return ChatResponse(
        message=message,
        raw=raw_of(result, model_name),
        additional_kwargs={**usage, "finish_reason": result.finish_reason, "ssr": result.stats},
    )


def reasoning_of(message: ChatMessage) -> str:
    return "".join(b.content or "" for b in message.blocks if isinstance(b, ThinkingBlock))


# ---------------------------------------------------------------------------------------------------------------
# tool calls in (partial) output


def _partial_json(text: str) -> Any:
    """Parse JSON that may be cut off anywhere; a dangling key or value is dropped. Raises ValueError if hopeless."""
    for _ in range(8):
        try:
            return parse_partial_json(text)
        except ValueError:
            cut = max(text.rfind(","), text.rfind("{") + 1 if text.rfind("{") > 0 else -1)
            if cut <= 0:
                raise
            text = text[:cut]
    raise ValueError("Malformed partial JSON encountered.")


def tool_selections_from_message(message: ChatMessage) -> List[ToolSelection]:
    """ToolSelections from a (possibly partial) assistant message: ToolCallBlocks first, else additional_kwargs."""
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if not calls:
        calls = (message.additional_kwargs or {}).get("tool_calls") or []
    selections = []
    for index, call in enumerate(calls):
        entry = engine_tool_call(call)
        if entry is None or not entry["function"]["name"]:
            continue
        arguments = entry["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = _partial_json(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = {}
        selections.append(ToolSelection(
            tool_id=entry["id"] or f"call_{index}",
            tool_name=entry["function"]["name"],
            tool_kwargs=arguments if isinstance(arguments, dict) else {},
        ))
    return selections


# ---------------------------------------------------------------------------------------------------------------
# streaming


def _settled(text: str) -> str:
    """Streamed text without leading whitespace and with trailing whitespace held back (the engine's final texts
    are stripped), so that the running text is always a prefix of the final one."""
    return text.strip()


@dataclass
class StreamAccumulator:
    """Turns the engine's stream events into ChatResponse chunks carrying the running text and the delta.

    Reasoning goes to a ThinkingBlock and ``additional_kwargs["thinking_delta"]``, never into the answer text. With
    tools bound the engine streams the text outside calls as "answer" and each call as "tool_call" deltas (id and
    name, then argument fragments): the running message carries the calls so far, arguments parsed partially. The
    last chunk (from the "done" event) is the full response with tool calls, usage and SSR stats.
    """

    model_name: Optional[str] = None
    raw_reasoning: str = ""
    raw_answer: str = ""
    reasoning: str = ""
    content: str = ""
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)
    _arguments: List[str] = field(default_factory=list)  # each call's argument JSON text so far

    def feed(self, event: Any) -> Optional[ChatResponse]:
        if event.kind == "reasoning":
            self.raw_reasoning += event.text
            reasoning = _settled(self.raw_reasoning)
            thinking_delta = reasoning[len(self.reasoning):]
            if not thinking_delta:
                return None
            self.reasoning = reasoning
            return self._chunk(delta="", thinking_delta=thinking_delta, raw={"kind": "reasoning", "text": event.text})
        if event.kind == "answer":
            self.raw_answer += event.text
            content = _settled(self.raw_answer)
            delta = content[len(self.content):]
            if not delta:
                return None
            self.content = content
            return self._chunk(delta=delta, thinking_delta="", raw={"kind": "answer", "text": event.text})
        if event.kind == "tool_call":
            call = event.tool_call
            if call.index == len(self.tool_calls):  # a new call: its id and name come first
                self.tool_calls.append({"id": call.id, "name": call.name, "arguments": {}})
                self._arguments.append("")
            self._arguments[call.index] += call.arguments
            try:
                partial = _partial_json(self._arguments[call.index]) if self._arguments[call.index].strip() else {}
            except ValueError:
                partial = {}
            self.tool_calls[call.index]["arguments"] = partial if isinstance(partial, dict) else {}
            return self._chunk(delta="", thinking_delta="", raw={"kind": "tool_call", "index": call.index,
                                                                 "arguments": call.arguments})
        if event.kind == "done":
            return self._final(event.result)
        return None

    def _chunk(self, delta: str, thinking_delta: str, raw: Dict[str, Any]) -> ChatResponse:
        return ChatResponse(
            message=build_message(self.reasoning, self.content, self.tool_calls),
            delta=delta,
            raw=raw,
            additional_kwargs={"thinking_delta": thinking_delta},
        )

    def _final(self, result: Any) -> ChatResponse:
        response = chat_response_from_result(result, self.model_name)
        content = response.message.content or ""
        response.delta = content[len(self.content):] if content.startswith(self.content) else ""
        reasoning = result.reasoning or ""
        response.additional_kwargs["thinking_delta"] = (
            reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        )
        self.content, self.reasoning = content, reasoning
        return response
