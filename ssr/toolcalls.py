"""Tool calls in the model's answer: the Hermes/Qwen tagged form or a fenced JSON call, parsed, validated against
the tools' JSON schemas, and given ids. Shared by the chat families (``ssr.chat``), the harmony format
(``ssr.harmony``), the transcript and the streaming parser (``ssr.toolstream``), none of which it imports."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
FENCE_OPEN = r"```[\w-]*\s*\n"  # a code fence's opening, any language (small models mislabel); the call grammar's too
_FENCED = re.compile(FENCE_OPEN + r"(.*?)```", re.DOTALL)
_FENCE_OPEN = re.compile(FENCE_OPEN)
_JSON = json.JSONDecoder()


@dataclass
class ToolCallParse:
    content: str  # the text with tool-call markup removed
    tool_calls: list[dict[str, Any]]  # {"id", "name", "arguments": dict}
    # {"id", "name", "args": str, "error": str}, and "arguments" (a dict) where the call itself is well formed but
    # names an unknown tool or fails its tool's schema: frameworks hand such calls to their tool executor, whose
    # error the model then reads (LangChain's ToolNode, LlamaIndex's agents), as they do with any provider's
    invalid_tool_calls: list[dict[str, Any]]


def call_id(seed: str | None, key: str) -> str:
    """A tool call's id: derived from ``seed`` (the engine passes a digest of the request's prompt) and the call's
    place, so the same request gives the same ids, run after run and method after method (an agent loop's next prompt
    holds them: LangChain quotes an unparsed call's id back to the model); random where there is no seed."""
    if seed is None:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{seed}:{key}'.encode()).hexdigest()[:24]}"


def prompt_seed(prompt_ids: list[int]) -> str:
    """The digest of a request's prompt that its tool-call ids derive from (each turn of a conversation differs)."""
    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None, id_seed: str | None = None) -> ToolCallParse:
    """Tool calls in the Hermes/Qwen format (``<tool_call>{json}</tool_call>``), or, when tools are bound and no tag
    is present, a JSON object with "name" and "arguments" in a code fence or as the whole answer.

    Never raises: malformed JSON, unknown tool names and arguments that miss required parameters become invalid
    tool calls carrying the error. Ids: ``call_id(id_seed, ...)``.
    """
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    spans = [(m.start(), m.end(), m.group(1)) for m in _TAGGED.finditer(text)]
    if not spans and tools:
        spans = [span for span in _fenced_spans(text) if _looks_like_call(span[2])]
        if not spans and _looks_like_call(text.strip()):
            spans = [(0, len(text), text)]
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    for i, (_, _, body) in enumerate(spans):
        call, error = _parse_one(body.strip(), schemas if tools else None, call_id(id_seed, f"parse:{i}"))
        if error:
            invalid.append(error)
        elif call is not None:  # one of the two is None
            calls.append(call)
    content = text
    for start, end, _ in reversed(spans):
        content = content[:start] + content[end:]
    return ToolCallParse(content.strip(), calls, invalid)


def _fenced_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, body) of each code fence, as ``_FENCED.finditer`` finds them, except that a body opening on a
    JSON object that decodes and is followed by the closing fence ends there: a fence inside one of its strings (a
    Markdown file written back) does not cut the call short."""
    spans, at = [], 0
    while (opening := _FENCE_OPEN.search(text, at)) is not None:
        body_start = opening.end()
        close = text.find("```", body_start)
        brace = len(text) - len(text[body_start:].lstrip())
        if text.startswith("{", brace):
            try:
                end = _JSON.raw_decode(text, brace)[1]
            except json.JSONDecodeError:
                pass
            else:
                after = len(text) - len(text[end:].lstrip())
                if text.startswith("```", after):
                    close = after
        if close < 0:
            break
        spans.append((opening.start(), close + 3, text[body_start:close]))
        at = close + 3
    return spans


def _looks_like_call(body: str) -> bool:
    return body.lstrip().startswith("{") and '"name"' in body


def _parse_one(body: str, schemas: dict[str, dict] | None, id: str) -> tuple[dict | None, dict | None]:
    def bad(name, error, arguments=None):
        parsed = {} if arguments is None else {"arguments": arguments}
        return None, {"id": id, "name": name, "args": body, "error": error, **parsed}

    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return bad(name.group(1) if name else None, f"malformed tool-call JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return bad(None, 'a tool call must be a JSON object with a string "name"')
    if "arguments" not in data and isinstance(data.get("parameters"), dict) and "properties" in data["parameters"]:
        return bad(data["name"], "this is a tool definition (a JSON schema), not a call")
    name, args = data["name"], data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return bad(name, f"tool-call arguments are not valid JSON: {exc}")
    if not isinstance(args, dict):
        return bad(name, "tool-call arguments must be a JSON object")
    if schemas is not None:
        if name not in schemas:
            return bad(name, f"unknown tool {name!r}; bound tools: {sorted(schemas)}", args)
        problem = check_arguments(args, schemas[name])
        if problem:
            return bad(name, problem, args)
    return {"id": id, "name": name, "arguments": args}, None


def check_arguments(args: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """The arguments checked against the tool's whole JSON schema (nested objects, enums, required) by the
    ``jsonschema`` validator. Returns the validator's message for the most relevant error, or None when valid.
    A schema the validator cannot read is reported as the problem, never raised."""
    try:
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(args))
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType) as exc:
        return f"the tool's parameter schema is not valid JSON schema: {str(exc).splitlines()[0]}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"arguments do not match the tool's schema{f' at {where!r}' if where else ''}: {error.message}"
