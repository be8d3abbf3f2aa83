"""Tool calls streamed out of the engine's answer text as it grows, in agreement with the final parse.

The answer is fed in final pieces (``ToolCallStream.feed``); each piece yields content events and tool-call deltas
(OpenAI-style: a call's first delta carries its id and name, later ones carry fragments of its arguments' JSON text).
At the end, ``ToolCallStream.finish`` reconciles the stream with ``ssr.chat.parse_tool_calls`` of the whole text,
which stays the authority on which calls are valid.

The stream mirrors that parse rather than improving on it, so that what a client saw streamed and the final result
agree: a call is ``<tool_call>`` up to the first ``</tool_call>`` (even one inside a JSON string) or the end of the
text; with bound tools and no tag anywhere, a fenced JSON call or a bare JSON answer is a call too (the fallback).
Work per piece is proportional to the piece: only small tails (a possible half tag, the last two characters of an
open code fence) are carried between pieces, and each character is scanned once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .toolcalls import _FENCED, ToolCallParse, _parse_one, call_id

__all__ = ["ToolCallDelta", "ToolCallStream"]

Event = tuple[str, "str | ToolCallDelta"]


@dataclass
class ToolCallDelta:
    """One piece of one tool call, as OpenAI's streaming ``tool_calls`` deltas carry it."""

    index: int  # 0, 1, ... per streamed call in this answer
    id: str | None  # set on the call's first delta only
    name: str | None  # set once, on the first delta: a call is announced only when its whole name is known
    arguments: str  # a fragment of the arguments' JSON text ("" allowed on the first delta)


class ToolCallStream:
    """Streams content and tool calls out of answer text that arrives in final pieces.

    Guarantees, for any split of the same text into pieces (``finish`` included):

    * the content events concatenate to exactly ``parse_tool_calls(text, tools).content`` (the parse strips its
      content, so leading whitespace is dropped and whitespace is held back until non-space content follows it);
    * each streamed call's ``arguments`` fragments concatenate to one JSON text; for every call the final parse
      accepts, it ``json.loads`` to that call's arguments and the streamed name is that call's name;
    * the events differ between splits only in granularity.

    ``open_tag``/``close_tag`` must be the tags the final parse reads (``parse_tool_calls`` reads the defaults).
    """

    def __init__(self, tools: list[dict] | None, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>",
                 id_seed: str | None = None):
        self._tools = tools
        self._id_seed = id_seed  # the streamed calls' ids: ``ssr.chat.call_id``
        self._open, self._close = open_tag, close_tag
        self._pending = ""  # the text's undecided tail: a possible start of the tag looked for next
        self._call: _Call | None = None  # the call being read, None outside calls
        self._calls: list[_Call] = []  # every tagged call so far, in order
        self._ids: list[str] = []
        self._tagged = False  # an open tag was seen: the final parse cannot fall back to untagged calls
        self._fence = _FallbackHold() if tools else None  # without tools the parse has no fallback
        self._started = False  # some content was emitted (leading whitespace is dropped)
        self._spaces: list[str] = []  # trailing whitespace held until non-space content follows it
        self._emitted: list[str] = []  # content emitted so far, for finish's reconciliation
        self._finished = False

    @property
    def ids(self) -> list[str]:
        """The streamed calls' ids by index, so that the final result can carry the ids the client already saw."""
        return list(self._ids)

    def feed(self, text: str) -> list[Event]:
        """Take the next final piece of answer text (never taken back); return the events it makes final, in order:
        ``("content", str)`` for text outside calls, ``("tool_call", ToolCallDelta)`` for call pieces.

        Content is emitted up to (not including) anything that could still become ``open_tag``; a call is announced
        once its name's closing quote is seen, and its arguments' JSON text follows as it grows, never including
        text after the arguments value ends (nor anything that could still become ``close_tag``)."""
        if self._finished:
            raise RuntimeError("feed after finish")
        out: list[Event] = []
        s, self._pending = self._pending + text, ""
        i = 0
        while True:
            tag = self._open if self._call is None else self._close
            j = s.find(tag, i)
            end = j if j >= 0 else len(s) - _tag_start(s, i, tag)
            if self._call is None:
                self._content(s[i:end], out)
            else:
                self._body(s[i:end], out)
            if j < 0:
                self._pending = s[end:]
                break
            if self._call is None:
                self._open_call(out)
            else:
                self._call = None
            i = j + len(tag)
        return _coalesce(out)

    def finish(self, parsed: ToolCallParse) -> list[Event]:
        """The last events, given ``parsed = parse_tool_calls(full_text, tools)`` of the same text.

        * An unclosed call takes the rest of the text as its body (as the final parse does); a held half tag
          outside calls is content after all.
        * Tagged answers: held content is flushed (trailing whitespace dropped), and the ids in ``parsed`` (its
          ``tool_calls`` and ``invalid_tool_calls``, changed in place) are set to the ids streamed for the same
          calls, so the final result and the stream agree. Calls never announced (no name was seen: garbage inside
          the tags, no "name") keep the parse's ids and are not emitted: they are only the parse's invalid calls.
        * Untagged answers with bound tools, where the parse fell back to a fenced or bare JSON call: that text was
          held back (from the fence's opening, or from the start when the answer opens with "{"), so it was never
          emitted as content. The rest of ``parsed.content`` beyond what was emitted is emitted now, and each of
          ``parsed.tool_calls`` is emitted whole as one delta (its parse id, its name, ``json.dumps`` of its
          arguments); invalid fallback calls are not emitted (they are only the parse's invalid calls).
          Harmony answers take this path too: their text is the final channel's alone, and ``parsed`` is
          ``ssr.harmony``'s parse, whose calls (commentary messages) thus arrive whole here.
        """
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        out: list[Event] = []
        rest, self._pending = self._pending, ""
        if self._call is not None:
            self._body(rest, out)
            self._call = None
        else:
            self._content(rest, out)
        fallback = self._fence is not None and (parsed.tool_calls or parsed.invalid_tool_calls)
        emitted = "".join(self._emitted)
        if fallback and parsed.content.startswith(emitted):
            if parsed.content[len(emitted):]:
                out.append(("content", parsed.content[len(emitted):]))
            for call in parsed.tool_calls:
                self._ids.append(call["id"])
                arguments = json.dumps(call["arguments"], ensure_ascii=False)
                out.append(("tool_call", ToolCallDelta(len(self._ids) - 1, call["id"], call["name"], arguments)))
        else:
            if self._fence is not None:
                self._say(self._fence.flush(), out)
            self._reuse_ids(parsed)
        return _coalesce(out)

    # -- content ----------------------------------------------------------------------------------------------

    def _content(self, piece: str, out: list[Event]) -> None:
        if self._fence is not None:
            piece = self._fence.feed(piece)
        self._say(piece, out)

    def _say(self, piece: str, out: list[Event]) -> None:
        """Emit content as the stripped final content will have it: no leading whitespace, and whitespace only
        once non-space content follows it (whitespace around calls, e.g. between two calls, is thus never sent)."""
        if not self._started:
            piece = piece.lstrip()
            self._started = bool(piece)
        core = piece.rstrip()
        if not core:
            if piece:
                self._spaces.append(piece)
            return
        text = "".join(self._spaces) + core
        self._spaces = [piece[len(core):]] if len(core) < len(piece) else []
        self._emitted.append(text)
        out.append(("content", text))

    # -- calls ------------------------------------------------------------------------------------------------

    def _open_call(self, out: list[Event]) -> None:
        self._tagged = True
        if self._fence is not None:  # a tag anywhere rules out the untagged fallback: what it held is content
            self._say(self._fence.flush(), out)
            self._fence = None
        self._call = _Call()
        self._calls.append(self._call)

    def _body(self, piece: str, out: list[Event]) -> None:
        call = self._call
        if not piece or call is None:
            return
        call.body.append(piece)
        call.scan.feed(piece)
        if call.index is None:
            if call.scan.name is None:
                return  # nothing is announced before the name: the arguments wait in the scanner
            call.index, call.id = len(self._ids), call_id(self._id_seed, f"stream:{len(self._ids)}")
            self._ids.append(call.id)
            out.append(("tool_call", ToolCallDelta(call.index, call.id, call.scan.name, call.scan.take())))
        else:
            fragment = call.scan.take()
            if fragment:
                out.append(("tool_call", ToolCallDelta(call.index, None, None, fragment)))

    def _reuse_ids(self, parsed: ToolCallParse) -> None:
        """Put the streamed ids on the final parse's calls. The parse keeps valid and invalid calls in two lists,
        so each tagged body is judged again with the parse's own ``_parse_one`` to know which list it went to; if
        the counts disagree (``parsed`` is not of this text), nothing is changed."""
        tools = self._tools
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
        verdicts = [_parse_one("".join(c.body).strip(), schemas if tools else None, "")[1] is None for c in self._calls]
        if sum(verdicts) != len(parsed.tool_calls) or verdicts.count(False) != len(parsed.invalid_tool_calls):
            return
        valid, invalid = iter(parsed.tool_calls), iter(parsed.invalid_tool_calls)
        for call, ok in zip(self._calls, verdicts):
            target = next(valid) if ok else next(invalid)
            if call.id is not None:
                target["id"] = call.id


def _tag_start(s: str, start: int, tag: str) -> int:
    """Length of the longest tail of ``s[start:]`` that could still grow into ``tag``."""
    for k in range(min(len(tag) - 1, len(s) - start), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


def _coalesce(events: list[Event]) -> list[Event]:
    """Merge neighbouring content events, and argument fragments of the same call, made by one feed."""
    out: list[Event] = []
    for kind, value in events:  # "content" events carry a str, "tool_call" events a ToolCallDelta
        last = out[-1][1] if out else None
        if isinstance(value, str) and isinstance(last, str):
            out[-1] = ("content", last + value)
        elif (isinstance(value, ToolCallDelta) and isinstance(last, ToolCallDelta) and value.index == last.index
              and value.id is None and value.name is None):
            last.arguments += value.arguments
        else:
            out.append((kind, value))
    return out


class _Call:
    """One tagged call: its body so far (for finish's verdict), its scanner, and its index and id once announced."""

    def __init__(self) -> None:
        self.body: list[str] = []
        self.scan = _CallScanner()
        self.index: int | None = None
        self.id: str | None = None


# -- the call body's JSON, incrementally ------------------------------------------------------------------------

_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')
_SCALAR_STOP = re.compile(r"[\s,}\]]")
_JSON_SPACE = " \t\n\r"
_KEPT_KEYS = ("name", "arguments", "parameters")


class _CallScanner:
    """Follows the top-level JSON object of one call body as it arrives: the "name" string once it closes, and the
    arguments' text as it grows. ``json_object_end`` (ssr.transcript) rescans from the start, which would make
    streaming quadratic; this keeps its string/escape/depth rules as state instead, so each character is read once.

    What the final parse (``_parse_one``) reads as the arguments, the scanner streams: the "arguments" value's text
    verbatim (a string value is JSON-decoded and sent whole once it closes, since the parse decodes it); without an
    "arguments" key, the "parameters" value (sent when the object closes); with neither, "{}". The first of duplicate
    keys wins here, the last in ``json.loads``. Anything that is not such an object stops the scan (a malformed
    call: what was sent stays sent, and the final parse reports the call invalid)."""

    def __init__(self) -> None:
        # pre, key_or_end, key_start, key, colon, value_start, value, after, done, dead
        self.state = "pre"
        self.name: str | None = None
        self._args: list[str] = []  # arguments text not yet taken
        self._key: list[str] = []  # the raw text of the key being read
        self._key_name = ""
        self._target: str | None = None  # the kept key whose value is being read
        self._kind = ""  # that value's kind: string, nested or scalar
        self._raw: list[str] = []  # raw text of a value kept whole (the name, a string argument, "parameters")
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._seen: set[str] = set()
        self._parameters: tuple[str, str] | None = None

    def take(self) -> str:
        """The arguments text that became final since the last take."""
        text, self._args = "".join(self._args), []
        return text

    def feed(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n and self.state not in ("done", "dead"):
            state = self.state
            if state == "key":
                i = self._read_key(s, i)
                continue
            if state == "value":
                i = self._read_value(s, i)
                continue
            c = s[i]
            if c in _JSON_SPACE or (state == "pre" and c.isspace()):  # the parse strips the body first
                i += 1
                continue
            if state == "value_start":
                self._start_value(c)
                if self._kind == "string":
                    i += 1  # the quotes are not part of a string's kept text
                continue
            if state == "pre":
                self.state = "key_or_end" if c == "{" else "dead"
            elif state in ("key_or_end", "key_start"):
                if c == '"':
                    self.state, self._key, self._escaped = "key", [], False
                elif c == "}" and state == "key_or_end":
                    self._close()
                else:
                    self.state = "dead"
            elif state == "colon":
                self.state = "value_start" if c == ":" else "dead"
            elif state == "after":
                if c == ",":
                    self.state = "key_start"
                elif c == "}":
                    self._close()
                else:
                    self.state = "dead"
            i += 1

    def _read_string(self, s: str, i: int) -> tuple[int, bool]:
        """Read string characters from ``s[i]``: (the closing quote's offset, True), or (len(s), False)."""
        n = len(s)
        while i < n:
            if self._escaped:
                self._escaped = False
                i += 1
                continue
            m = _STRING_STOP.search(s, i)
            if m is None:
                return n, False
            i = m.start()
            if s[i] == '"':
                return i, True
            self._escaped = True
            i += 1
        return n, False

    def _read_key(self, s: str, i: int) -> int:
        j, closed = self._read_string(s, i)
        self._key.append(s[i:j])
        if not closed:
            return j
        key = _decode("".join(self._key))
        if key is None:
            self.state = "dead"
        else:
            self._key_name, self.state = key, "colon"
        return j + 1

    def _start_value(self, c: str) -> None:
        if c in ",:}]":
            self.state = "dead"
            return
        key = self._key_name
        self._target = key if key in _KEPT_KEYS and key not in self._seen else None
        self._seen.add(key)
        self._kind = "string" if c == '"' else "nested" if c in "{[" else "scalar"
        self._depth, self._in_string, self._escaped = 0, False, False
        self.state = "value"

    def _read_value(self, s: str, i: int) -> int:
        n = len(s)
        if self._kind == "string":
            j, closed = self._read_string(s, i)
            self._keep(s[i:j])
            if closed:
                self._end_value()
                return j + 1
            return j
        if self._kind == "scalar":
            m = _SCALAR_STOP.search(s, i)
            j = n if m is None else m.start()
            self._keep(s[i:j])
            if m is not None:
                self._end_value()
            return j
        j = i
        while j < n:
            if self._in_string:
                j, closed = self._read_string(s, j)
                if not closed:
                    break
                self._in_string = False
                j += 1
                continue
            m = _NESTED_STOP.search(s, j)
            if m is None:
                j = n
                break
            j = m.start()
            c = s[j]
            j += 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._keep(s[i:j])
                    self._end_value()
                    return j
        self._keep(s[i:j])
        return j

    def _keep(self, text: str) -> None:
        if not text or self._target is None:
            return
        if self._target == "arguments" and self._kind != "string":
            self._args.append(text)  # streamed as it grows
        else:
            self._raw.append(text)

    def _end_value(self) -> None:
        target, raw = self._target, "".join(self._raw)
        self._raw, self.state = [], "after"
        if target == "name" and self._kind == "string":
            self.name = _decode(raw)
            if self.name is None:
                self.state = "dead"
        elif target == "arguments" and self._kind == "string":
            decoded = _decode(raw)
            if decoded is None:
                self.state = "dead"
            else:
                self._args.append(decoded)
        elif target == "parameters":
            self._parameters = (self._kind, raw)

    def _close(self) -> None:
        """The top-level object closed: arguments the parse takes from elsewhere than "arguments" are known now."""
        self.state = "done"
        if "arguments" in self._seen:
            return
        if self._parameters is None:
            self._args.append("{}")
            return
        kind, raw = self._parameters
        text = _decode(raw) if kind == "string" else raw
        if text is not None:
            self._args.append(text)


def _decode(raw: str) -> str | None:
    """A JSON string's text from its raw (still escaped) inside; None if it is not valid JSON."""
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None


# -- the untagged fallback --------------------------------------------------------------------------------------

_WORD = re.compile(r"[\w-]")
_SPACE = re.compile(r"\s")


class _FallbackHold:
    """Content held back while it may still be an untagged call that the final parse would take (tools bound, no
    tag yet): everything, once the answer's first non-space character is "{" (a bare JSON answer); otherwise each
    code fence from its opening, until it closes (released if its body does not open on a JSON object; else held
    with everything after it: the object may be a call whose strings hold a "```", which the final parse reads past,
    ``toolcalls._fenced_spans``). The fence is found as ``_FENCED.finditer`` finds it: the leftmost
    "```" followed by ``[\\w-]*\\s*\\n``, closed by the next "```"; a closed fence is confirmed with ``_FENCED``
    itself. Held text is kept as pieces; only the last two characters of an open fence are looked at again."""

    def __init__(self) -> None:
        self.state = "start"  # start, free, header, body, all
        self.held: list[str] = []
        self._word = True  # still in the fence's [\w-]* language word
        self._newline = False  # the header's whitespace has a newline
        self._tail = ""  # the open fence's last two characters, for a "```" split between pieces

    def flush(self) -> str:
        text, self.held = "".join(self.held), []
        return text

    def feed(self, s: str) -> str:
        """Take the next piece of content; return the content released (final as content)."""
        out: list[str] = []
        if self.state == "free" and self.held:  # up to two backticks that may open a fence
            s = self.flush() + s
        i, n = 0, len(s)
        while i < n:
            if self.state == "all":
                self.held.append(s[i:])
                break
            if self.state == "start":
                j = n - len(s[i:].lstrip())
                out.append(s[i:j])
                i = j
                if j < n:
                    self.state = "all" if s[j] == "{" else "free"
                continue
            if self.state == "free":
                j = s.find("```", i)
                if j < 0:
                    k = min(2 if s.endswith("``") else 1 if s.endswith("`") else 0, n - i)
                    out.append(s[i:n - k])
                    if k:
                        self.held = [s[n - k:]]
                    break
                out.append(s[i:j])
                self._open_fence()
                i = j + 3
                continue
            if self.state == "header":
                j = i
                while j < n:
                    c = s[j]
                    if self._word and _WORD.match(c):
                        j += 1
                        continue
                    self._word = False
                    if _SPACE.match(c):
                        self._newline = self._newline or c == "\n"
                        j += 1
                        continue
                    break
                self.held.append(s[i:j])
                i = j
                if j == n:
                    break
                if self._newline:
                    self.state, self._tail = "body", ""
                    continue
                fence = self.flush()  # no newline before the body: "```" here opens no fence
                if fence == "```" and s[j] == "`":  # "````": the regex tries one character later
                    out.append("`")
                    self._open_fence()
                    i = j + 1
                    continue
                out.append(fence)
                self.state = "free"
                continue
            look = self._tail + s[i:]  # body: the fence closes at the next "```"
            j = look.find("```")
            if j < 0:
                self.held.append(s[i:])
                self._tail = look[-2:]
                break
            end = i + j + 3 - len(self._tail)
            self.held.append(s[i:end])
            i = end
            fence = self.flush()
            m = _FENCED.match(fence)
            if m is not None and m.end() == len(fence) and m.group(1).lstrip().startswith("{"):
                self.held, self.state = [fence], "all"
            else:
                out.append(fence)
                self.state = "free"
        return "".join(out)

    def _open_fence(self) -> None:
        self.held, self.state = ["```"], "header"
        self._word, self._newline = True, False

