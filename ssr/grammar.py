"""Grammar-constrained answers with llguidance: a JSON schema (or any JSON object) for structured output, and the
bound tools' call format with each tool's argument schema for tool calls.

The mask is part of the decoding rule, like the thinking budget: plain decoding, every draft lane and every verify
row of SSR apply it the same way, so SSR's output stays plain decoding's. A lane's ``Constraint`` follows the tokens
the lane has committed; to mask a verify pass it walks the proposal (mask the row, take the proposed token if the
grammar allows it) and rolls back, so nothing a rejected proposal wrote stays in the parser.

llguidance was chosen by measurement (``docs/grammar.md``): on the 151k-token vocabulary a mask costs tens of
microseconds (a forward pass here costs 70-140 ms), a schema compiles in about a millisecond, rollback is cheap,
and the wheel has no dependencies.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np
import torch

from .toolcalls import FENCE_OPEN


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an OpenAI-style ``response_format`` asks for (None: free text). ``json_object`` is any JSON
    object; ``json_schema`` takes ``{"json_schema": {"schema": ...}}`` or a bare ``{"schema": ...}``."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs a schema object: "
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        return schema
    raise ValueError(f"unknown response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'")


# The model's own JSON style, and no whitespace runs: under a mask a small model can loop on spaces forever.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def json_grammar(schema: dict[str, Any]) -> str:
    """An answer that is one JSON value of ``schema`` (whitespace may lead: a chain of thought closes with one)."""
    return ("%llguidance {}\n"
            "start: json_body | WS json_body\n"
            f"json_body: {_json(schema)}\n"
            "WS: /[ \\t\\n]+/\n")


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | None) -> None:
    """Once per request: every tool's parameters must be valid JSON schema (they shape the call grammar and
    validate the calls, so a broken schema is the caller's clear error at submission, not a call silently judged
    invalid later), and ``tool_choice`` must fit the tools (``check_tool_choice``)."""
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f'a tool must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}, '
                             f"got {tool!r}")
        parameters = fn.get("parameters") or {}
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.exceptions.SchemaError as exc:
            raise ValueError(f"tool {fn['name']!r}: its parameters are not valid JSON schema: {exc.message}") from None
    check_tool_choice(tools, tool_choice)


def check_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | None) -> None:
    """A ``tool_choice`` that names a tool must name a bound one (never a forced call to a tool that is not there)."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice not in (None, "auto", "none", "any", "required") and tool_choice not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound tools: {names}")


# Free text under bound tools (tool_choice "auto") may not open a call in the untagged forms the parser also reads
# as calls (``ssr.toolcalls``): a JSON object as the whole answer, or a JSON object in a code fence. There the grammar
# takes over with the call rule, so a fenced call is as constrained as a tagged one (its JSON escaped, the name a
# bound tool's, the arguments the tool's schema). Code fences of any other content stay free text.
_FENCE_OPEN = FENCE_OPEN + r"\s*"  # as the parser opens a fence, then the body's leading space


def _free_text(repeat: str) -> str:
    """Free text (``repeat`` "+": one character or more, "*": possibly none) that opens no untagged call."""
    return (f"/(.|\\n){repeat}/ & ~/[ \\t\\n]*\\{{(.|\\n)*/"  # not a bare JSON object
            f" & ~/(.|\\n)*{_FENCE_OPEN}\\{{(.|\\n)*/")  # nor a fence opening on a JSON object


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with no keys beyond the declared ones, unless the schema says otherwise (as OpenAI's strict
    mode): a function takes no arguments it does not name, and a small model otherwise copies the schema itself into
    the arguments of a tool that takes none ({"properties": {}, "type": "object"})."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def tool_call_grammar(tools: list[dict[str, Any]], tool_choice: str | None, call_open: str = "<tool_call>",
                      call_close: str = "</tool_call>", special_markers: bool = True) -> str:
    """Tool calls whose names are the bound tools' and whose arguments follow each tool's schema, in every form
    ``ssr.toolcalls.parse_tool_calls`` reads as a call.

    ``"auto"``: free text, and a call wherever the model opens one: tagged (Hermes/Qwen ``<tool_call>``), a JSON
    object in a code fence, or a JSON object as the whole answer (a JSON object can only be a call there). The
    arguments take only the keys the tool declares (``_closed``).
    ``"required"``/``"any"``: one tagged call or more and nothing else. A tool's name: calls to that tool only. With
    ``special_markers`` the call markers are the tokenizer's special tokens; otherwise they are text, and free text
    ends lazily where a call opens.
    """
    check_tool_choice(tools, tool_choice)
    free = tool_choice in (None, "auto")
    chosen = [t for t in tools if free or tool_choice in ("any", "required") or t["function"]["name"] == tool_choice]
    rules = []
    for i, tool in enumerate(chosen):
        fn = tool["function"]
        head = json.dumps(fn["name"] + '", "arguments": ')
        rules.append(f"call_{i}: {head} {_json(_closed(fn.get('parameters') or {'type': 'object', 'properties': {}}))}")
    body = " | ".join(f"call_{i}" for i in range(len(chosen)))
    opening, closing = (call_open, call_close) if special_markers else (json.dumps(call_open), json.dumps(call_close))
    call = f'call: {opening} "\\n" call_json "\\n" {closing}'
    call_json = f'call_json: "{{\\"name\\": \\"" ({body}) "}}"'
    if not free:
        start = "start: (WS? call)+ WS?"
    else:  # a fenced call: free text that ends with a fence's opening (FENCE_OPEN), then the call's JSON
        tagged, lazy = "TEXT? call", ""
        if not special_markers:  # a text marker: the text before it is a lazy lexeme that ends at the marker
            call, tagged = call.replace(f"call: {opening}", "call: open_call", 1), "call"
            lazy = f"\nopen_call[lazy]: TEXT_BEFORE_CALL {opening}\nTEXT_BEFORE_CALL: {_free_text('*')}"
        start = f"start: WS? call_json WS? | ({tagged} | FENCE_OPEN call_json FENCE_END)* TEXT?{lazy}"
    lexemes = [f"TEXT: {_free_text('+')}", f"FENCE_OPEN: {_free_text('+')} & /(.|\\n)*{_FENCE_OPEN}/",
               "FENCE_END: /\\s*```/"] if free else []
    return "%llguidance {}\n" + "\n".join([start, call, call_json, *rules, *lexemes, "WS: /[ \\t\\n]+/"]) + "\n"


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int]):
    """llguidance's view of the vocabulary. Filler entries (Qwen's ``[PAD151665]``...) are marked special, so no
    grammar allows them: as ordinary tokens they would decode to text inside a JSON string."""
    import llguidance

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    have = {a["id"] for a in spec["added_tokens"]}
    spec["added_tokens"] += [{"id": i, "content": t, "special": True, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False}
                             for t, i in tokenizer.get_vocab().items()
                             if i not in have and re.fullmatch(r"\[PAD\d+\]", t)]
    try:
        return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos_ids)
    except ValueError:  # a decoder llguidance cannot read (e.g. the tests' word-level one): give it token bytes
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size, eos_ids)),
                                      n_vocab=vocab_size, eos_token=eos_ids)


class _TokenBytes:
    """The token-bytes view ``llguidance.TokenizerWrapper`` reads, for tokenizers without a byte-level decoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self.eos_token_id, self.bos_token_id = eos_ids[0], None
        self.tokens = [tokenizer.convert_tokens_to_string([t]).encode() if t is not None else b""
                       for t in tokenizer.convert_ids_to_tokens(list(range(vocab_size)))]
        self.special_token_ids = list(eos_ids)  # other tokens are their text here, whatever the tokenizer flags
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


class Grammars:
    """One engine's grammar support: the tokenizer converted once (a few seconds for 151k tokens), then grammars
    compiled from their text, once per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids) -> None:
        import llguidance

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, sorted(eos_ids))

    def is_special(self, text: str) -> bool:
        """Whether ``text`` (a call marker) is one special token of the vocabulary, as ``<tool_call>`` is in Qwen."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0])

    def compile(self, grammar: str) -> "Grammar":
        """``grammar`` compiled for this vocabulary; a clear error for one (a schema) llguidance cannot use, before
        any lane is taken."""
        matcher = self._llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"cannot constrain the answer to this schema: {matcher.get_error()}")
        return Grammar(self, matcher)


@dataclass
class Grammar:
    """One request's compiled grammar: a pristine matcher that every lane copies (a copy costs microseconds, a
    compile up to a millisecond)."""

    grammars: Grammars
    template: Any

    def constraint(self, before: str = "") -> "Constraint":
        """A matcher for one lane whose constrained text starts with ``before`` (what the end of thinking left)."""
        constraint = Constraint(self.grammars, self.template.deep_copy())
        constraint.take(self.grammars.tokenizer.encode(before, add_special_tokens=False) if before else [])
        return constraint


@dataclass
class Constraint:
    """One lane's parser state over its committed answer tokens."""

    grammars: Grammars
    matcher: Any
    taken: int = 0  # tokens of the lane's answer the matcher has consumed (the ``before`` text not counted)
    broken: str | None = None  # why the committed text left the grammar; from then on the answer can only end

    def take(self, tokens: list[int]) -> None:
        """Consume committed tokens. A committed token the grammar rejects (a dead end that a tiny vocabulary's
        mask let through) leaves only EOS from then on: never decode unconstrained."""
        if tokens and self.broken is None and not self.matcher.consume_tokens(tokens):
            self.broken = self.matcher.get_error()

    def sync(self, answer: list[int]) -> None:
        self.take(answer[self.taken:])
        self.taken = len(answer)

    def rows(self, rows: torch.Tensor, answer: list[int], proposal: list[int]) -> torch.Tensor:
        """``rows`` (the scores after ``answer`` and after each prefix of ``proposal``) with the tokens the grammar
        forbids at -inf. Where no allowed token has a score (a backend that returns only its top-k scores), the
        allowed tokens score alike (one token forced by the grammar is then taken; none allowed: EOS). The walk stops
        at the first proposed token the grammar rejects: verification rejects it there, so later rows are never
        read. The proposal is walked on a copy of the matcher: the lane's own matcher consumes committed tokens
        only, as plain decoding's does (llguidance 1.9's ``rollback`` after a walk left a matcher that later refused
        what a fresh one accepts: a replayed agent step lost a `",` plain decoding wrote)."""
        import llguidance.numpy as lln  # llguidance.torch's import pulls in torch.compile's backend: about 1 s

        self.sync(answer)
        out = rows.clone()
        bitmask = lln.allocate_token_bitmask(1, self.grammars.vocab_size)
        walker = self.matcher.deep_copy() if proposal and self.broken is None else self.matcher
        broken = self.broken is not None
        for i in range(out.shape[0]):
            allowed = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
            if broken or walker.is_stopped():  # left the grammar, or complete: only EOS
                allowed[self.grammars.eos_ids] = True
            else:
                lln.fill_next_token_bitmask(walker, bitmask, 0)
                bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:out.shape[1]]
                allowed = torch.from_numpy(bits.view(np.bool_)).to(out.device)
            out[i].masked_fill_(~allowed, float("-inf"))
            if not torch.isfinite(out[i]).any():  # no allowed token has a score (a top-k backend): all alike
                out[i, allowed if allowed.any() else self.grammars.eos_ids] = 0.0
            if i == len(proposal) or broken or not torch.isfinite(out[i, proposal[i]]):
                break  # verification stops here: the token is rejected (or the walk is over)
            if walker.try_consume_tokens(proposal[i: i + 1]) != 1:
                broken = True  # allowed by the mask, refused by the parser: what ``take`` finds when it is committed
        return out
