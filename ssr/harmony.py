"""OpenAI's harmony format (gpt-oss), rendered and parsed with the maintained ``openai-harmony`` package.

In harmony the reasoning is the ``analysis`` channel, the answer the ``final`` channel, and a tool call a
``commentary`` message addressed ``to=functions.NAME`` that ends at ``<|call|>``. SSR keeps the format's text as the
model's tokenizer spells it: prompts are rendered by openai-harmony to its token ids and decoded to text (which the
model's tokenizer encodes), and answers are parsed by encoding their text back to harmony's ids. The encoding needs
the o200k_base vocabulary, which openai-harmony downloads once; offline, point ``TIKTOKEN_ENCODINGS_BASE`` at a
folder holding ``o200k_base.tiktoken`` (or ``TIKTOKEN_RS_CACHE_DIR`` at a tiktoken cache that has it).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from .toolcalls import _parse_one, call_id

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"  # what opens the reasoning after the generation prompt
FINAL = f"{CHANNEL}final{MESSAGE}"  # what opens the answer
CLOSE = f"{END}{START}assistant{FINAL}"  # the switch from the analysis channel to the final one


@functools.cache
def encoding():
    """The gpt-oss harmony encoding (loaded once per process)."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("harmony models need openai-harmony: pip install 'ssr[harmony]'") from exc
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # noqa: BLE001 - HarmonyError: no vocabulary file, usually no network
        raise RuntimeError(f"cannot load the harmony encoding ({exc}); offline, set TIKTOKEN_ENCODINGS_BASE to a "
                           "folder with o200k_base.tiktoken") from exc


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation as harmony text, up to the assistant's generation prompt (``<|start|>assistant``).

    OpenAI-style messages map as gpt-oss's own chat template maps them: system text becomes the developer
    instructions, tools the developer's ``functions`` namespace, an assistant turn's reasoning (``reasoning_content``,
    ``reasoning`` or ``thinking``) an analysis message, its ``tool_calls`` commentary messages to ``functions.NAME``,
    and a tool result a message from ``functions.NAME`` (named by ``name``, else by its call id)."""
    from openai_harmony import Author, Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription

    enc = encoding()
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        developer = developer.with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                parameters=t["function"].get("parameters")) for t in tools])
    out = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new())]
    if instructions or tools:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str | None, str] = {}  # call id (None: a call without one) -> tool name
    for m in messages:
        role = m["role"]
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning") or m.get("thinking")
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            if m["content"]:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                call_names[call.get("id")] = fn["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                           .with_recipient(f"functions.{fn['name']}").with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id"), "tool")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), m["content"])
                       .with_channel("commentary").with_recipient("assistant"))
    ids = enc.render_conversation_for_completion(Conversation.from_messages(out), Role.ASSISTANT)
    return enc.decode(ids)


@dataclass
class HarmonyParse:
    reasoning: str  # the analysis channel's text
    content: str  # the final channel's text (and any commentary preamble meant for the user)
    tool_calls: list[dict[str, Any]]  # {"id", "name", "arguments": dict}, as ``ssr.chat.parse_tool_calls`` gives
    invalid_tool_calls: list[dict[str, Any]]  # {"id", "name", "args": str, "error": str}


def parse(text: str, tools: list[dict[str, Any]] | None = None, id_seed: str | None = None) -> HarmonyParse:
    """Reasoning, content and tool calls of assistant harmony text that starts at a message header (``<|start|>``)
    or inside one (after ``<|start|>assistant``). An unfinished last message counts with what it has so far, and
    text the format cannot read (a random model's) ends the parse there: this never raises, so streams can show it."""
    from openai_harmony import HarmonyError, Role, StreamableParser


    enc = encoding()
    parser = StreamableParser(enc, None if text.startswith(START) else Role.ASSISTANT, strict=False)
    try:
        for token in enc.encode(text, allowed_special="all"):
            parser.process(token)
    except HarmonyError:
        pass
    pieces = [(m.channel, m.recipient, "".join(c.text for c in m.content if hasattr(c, "text")))
              for m in parser.messages if m.author.role == Role.ASSISTANT]
    try:
        if parser.current_content:
            pieces.append((parser.current_channel, parser.current_recipient, parser.current_content))
    except HarmonyError:
        pass
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    for i, (channel, recipient, body) in enumerate(pieces):
        if recipient and recipient.startswith("functions."):
            call, error = _call(recipient.removeprefix("functions."), body, schemas if tools else None,
                                call_id(id_seed, f"parse:{i}"))
            if error is not None:
                invalid.append(error)
            elif call is not None:  # one of the two is None
                calls.append(call)
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return HarmonyParse("\n".join(reasoning).strip(), "\n".join(content).strip(), calls, invalid)


def _call(name: str, arguments: str, schemas: dict[str, dict] | None, id: str) -> tuple[dict | None, dict | None]:
    """One commentary call, judged exactly as a Hermes call is (``ssr.chat``): its name and arguments as that
    format's JSON object, so malformed arguments, unknown tools and schema errors read the same in both."""

    return _parse_one(f'{{"name": {json.dumps(name)}, "arguments": {arguments.strip() or "{}"}}}', schemas, id)
