"""OpenAI requests -> the engine's call; the engine's results and stream events -> OpenAI responses and chunks."""

from __future__ import annotations

import json
from typing import Any

from ..settings import REASONING_EFFORT_BUDGETS, normalise_settings
from .protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ToolMessage,
    bad_request,
    content_text,
)

# -- requests ----------------------------------------------------------------------------------------------------

def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the engine's OpenAI-style dicts (text content; assistant calls; tool results)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> tool name, for tool results that do not name their tool
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": content_text(m.content, where)}
        if isinstance(m, AssistantMessage):
            if not entry["content"] and m.refusal:
                entry["content"] = m.refusal
            if m.tool_calls:
                calls = []
                for j, call in enumerate(m.tool_calls):
                    arguments = call.function.arguments
                    if isinstance(arguments, str):
                        try:
                            arguments = json.loads(arguments) if arguments.strip() else {}
                        except json.JSONDecodeError as exc:
                            raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                                              f"JSON: {exc}", f"messages[{i}].tool_calls[{j}].function.arguments"
                                              ) from None
                    calls.append({"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": arguments}})
                    if call.id:
                        names[call.id] = call.function.name
                entry["tool_calls"] = calls
            elif not entry["content"]:
                raise bad_request(f"messages[{i}]: an assistant message needs content or tool_calls",
                                  f"messages[{i}].content")
        elif isinstance(m, ToolMessage):
            entry["tool_call_id"] = m.tool_call_id
            if name := m.name or names.get(m.tool_call_id):
                entry["name"] = name
        out.append(entry)
    return out


def tool_choice(req: ChatCompletionRequest) -> str | None:
    """OpenAI's tool_choice as the engine's: "auto" | "none" | "required" | the named tool."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return choice


def _max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    values = {"max_tokens": req.max_tokens}
    aliases: tuple[str, ...] = ("max_tokens",)
    if isinstance(req, ChatCompletionRequest):
        values["max_completion_tokens"] = req.max_completion_tokens
        aliases = ("max_tokens", "max_completion_tokens")
        if req.max_tokens is not None and req.max_tokens == req.max_completion_tokens:
            values.pop("max_completion_tokens")  # the same value twice: one setting
    try:
        return normalise_settings("the request", values, aliases).get("max_tokens")
    except TypeError as exc:
        raise bad_request(str(exc), "max_completion_tokens") from None


def sampling(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The engine's keyword arguments both endpoints share: sampling, limits and the cache salt."""
    call = {"max_tokens": _max_tokens(req), "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "seed": req.seed, "stop": req.stop, "cache_salt": req.cache_salt}
    return {k: v for k, v in call.items() if v is not None}


def chat_call(req: ChatCompletionRequest, engine) -> dict[str, Any]:
    """The engine's keyword arguments for a chat request (the prompt is ``chat_messages(req)``)."""
    call = sampling(req)
    if req.tools:
        call["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        if (choice := tool_choice(req)) is not None:
            call["tool_choice"] = choice
    if isinstance(req.response_format, JsonObjectFormat):
        call["response_format"] = {"type": "json_object"}
    elif isinstance(req.response_format, JsonSchemaFormat):
        schema = req.response_format.json_schema.schema_
        call["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if req.reasoning_effort == "none":
        thinking = False
    if thinking is not None:
        call["thinking"] = thinking
    if req.reasoning_effort in REASONING_EFFORT_BUDGETS and thinking is not False:
        budget = REASONING_EFFORT_BUDGETS[req.reasoning_effort]
        base = engine.config
        call["config"] = base.override(max_think_tokens=budget, min_think_tokens=min(base.min_think_tokens, budget))
    return call


# -- results -----------------------------------------------------------------------------------------------------

def usage(result) -> dict[str, Any]:
    """OpenAI usage: every generated token counts (reasoning included), reasoning tokens and reused prompt tokens
    (``stats["reused_prompt_tokens"]``, the prompt's KV cache kept from an earlier request) in the details."""
    completion = len(result.token_ids)
    out = {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
           "total_tokens": result.prompt_tokens + completion,
           "completion_tokens_details": {"reasoning_tokens": int(result.stats.get("think_tokens", 0))}}
    if "reused_prompt_tokens" in result.stats:
        out["prompt_tokens_details"] = {"cached_tokens": int(result.stats["reused_prompt_tokens"])}
    return out


def ssr_extension(result, return_token_ids: bool, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The extension field ``ssr``: the engine's stats as they are, the calls the parser refused, the token ids."""
    out: dict[str, Any] = {"stats": result.stats}
    if result.invalid_tool_calls:
        out["invalid_tool_calls"] = result.invalid_tool_calls
    if return_token_ids:
        out["token_ids"] = list(result.token_ids)
        if prompt_ids is not None:
            out["prompt_token_ids"] = list(prompt_ids)
    return out


def openai_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def chat_finish_reason(result) -> str:
    """The engine's reason, "tool_calls" wherever the message carries calls (``executable_tool_calls``)."""
    return "tool_calls" if result.finish_reason == "stop" and result.executable_tool_calls else result.finish_reason


def chat_response(result, *, id: str, created: int, model: str, parallel_tool_calls: bool = True,
                  return_token_ids: bool = False) -> dict[str, Any]:
    """The message's calls are the well-formed ones, as vLLM's and OpenAI's carry whatever the model called: a call
    naming an unknown tool or missing its schema is the client's tool executor's to reject (the engine's reason is in
    ``ssr.invalid_tool_calls``), as the stream's tool-call deltas already carry it."""
    executable = result.executable_tool_calls
    calls = executable if parallel_tool_calls else executable[:1]
    content = result.content if result.content is not None else result.answer
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if calls:
        message["tool_calls"] = [openai_tool_call(c) for c in calls]
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": chat_finish_reason(result)}],
            "usage": usage(result), "ssr": ssr_extension(result, return_token_ids)}


def completion_response(result, *, id: str, created: int, model: str, return_token_ids: bool = False,
                        prompt_ids: list[int] | None = None) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": result.answer, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result), "ssr": ssr_extension(result, return_token_ids, prompt_ids)}


class ChatChunks:
    """Engine stream events -> ``chat.completion.chunk`` dicts, whose deltas add up to the non-streamed message.

    Reasoning deltas go in ``delta.reasoning_content``, answer text in ``delta.content``, the engine's tool-call
    deltas in ``delta.tool_calls`` (the first piece of a call with its index, id, type and name; later pieces with the
    index and a fragment of the arguments' JSON). The "done" event adds any text the stream did not carry, then the
    chunk with the finish reason (and the ``ssr`` extension), then, with ``include_usage``, the usage chunk.
    """

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool = False,
                 parallel_tool_calls: bool = True, return_token_ids: bool = False) -> None:
        self.id, self.created, self.model = id, created, model
        self.include_usage, self.parallel, self.return_token_ids = include_usage, parallel_tool_calls, return_token_ids
        self.reasoning = ""
        self.text = ""
        self.calls = 0  # tool-call deltas sent

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None, **extra) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        chunk.update(extra)
        return chunk

    def first(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def feed(self, event) -> list[dict[str, Any]]:
        if event.kind == "reasoning":
            if not event.text:
                return []
            self.reasoning += event.text
            return [self._chunk({"reasoning_content": event.text})]
        if event.kind == "answer":
            if not event.text:
                return []
            self.text += event.text
            return [self._chunk({"content": event.text})]
        if event.kind == "tool_call":
            delta = event.tool_call
            if delta.index > 0 and not self.parallel:
                return []  # parallel_tool_calls: false keeps the first call only
            piece: dict[str, Any] = {"index": delta.index}
            if delta.id is not None:
                piece.update(id=delta.id, type="function",
                             function={"name": delta.name, "arguments": delta.arguments or ""})
            else:
                piece["function"] = {"arguments": delta.arguments}
            self.calls += 1
            return [self._chunk({"tool_calls": [piece]})]
        if event.kind == "done":
            return self._finish(event.result)
        return []

    def _finish(self, result) -> list[dict[str, Any]]:
        out = []
        if not self.text and result.reasoning.startswith(self.reasoning) and result.reasoning != self.reasoning:
            out.append(self._chunk({"reasoning_content": result.reasoning[len(self.reasoning):]}))
        content = result.content if result.content is not None else result.answer
        if content.startswith(self.text) and content != self.text:
            out.append(self._chunk({"content": content[len(self.text):]}))
        out.append(self._chunk({}, chat_finish_reason(result), ssr=ssr_extension(result, self.return_token_ids)))
        if self.include_usage:
            out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                        "choices": [], "usage": usage(result)})
        return out


class CompletionChunks:
    """Engine stream events -> ``text_completion`` chunks (the answer text; no thinking on this endpoint)."""

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool = False,
                 return_token_ids: bool = False, prompt_ids: list[int] | None = None) -> None:
        self.id, self.created, self.model = id, created, model
        self.include_usage, self.return_token_ids, self.prompt_ids = include_usage, return_token_ids, prompt_ids
        self.text = ""

    def _chunk(self, text: str, finish_reason: str | None = None, **extra) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        chunk.update(extra)
        return chunk

    def feed(self, event) -> list[dict[str, Any]]:
        if event.kind in ("answer", "reasoning") and event.text:
            self.text += event.text
            return [self._chunk(event.text)]
        if event.kind != "done":
            return []
        result = event.result
        out = []
        if result.answer.startswith(self.text) and result.answer != self.text:
            out.append(self._chunk(result.answer[len(self.text):]))
        out.append(self._chunk("", result.finish_reason,
                               ssr=ssr_extension(result, self.return_token_ids, self.prompt_ids)))
        if self.include_usage:
            out.append({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                        "choices": [], "usage": usage(result)})
        return out
