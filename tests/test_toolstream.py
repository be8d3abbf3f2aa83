"""ssr.toolstream: streamed content and tool-call deltas agree with the final parse, for any split of the text."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssr.chat import parse_tool_calls
from ssr.toolstream import ToolCallDelta, ToolCallStream
from ssr.transcript import json_object_end

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def run(text, tools=TOOLS, pieces=None):
    """Feed ``pieces`` (default: one character at a time), finish with the final parse; (events, parse, stream)."""
    pieces = list(text) if pieces is None else pieces
    assert "".join(pieces) == text
    stream = ToolCallStream(tools)
    events = [e for piece in pieces for e in stream.feed(piece)]
    parsed = parse_tool_calls(text, tools)
    return events + stream.finish(parsed), parsed, stream


def summary(events):
    """(content, [[id, name, arguments], ...] by index), checking the delta protocol on the way."""
    content, calls = [], []
    for kind, value in events:
        if kind == "content":
            assert isinstance(value, str) and value
            content.append(value)
            continue
        assert kind == "tool_call" and isinstance(value, ToolCallDelta)
        if value.index == len(calls):  # a new call: announced with its id and whole name
            assert value.id and value.id.startswith("call_") and value.name is not None
            calls.append([value.id, value.name, value.arguments])
        else:
            assert value.index < len(calls) and value.id is None and value.name is None and value.arguments
            calls[value.index][2] += value.arguments
    return "".join(content), calls


def check(text, tools=TOOLS, pieces=None):
    """The stream's promises against the final parse; returns the split-independent part of the summary."""
    events, parsed, stream = run(text, tools, pieces)
    content, calls = summary(events)
    assert content == parsed.content
    assert stream.ids == [c[0] for c in calls]
    streamed = {c[0]: c for c in calls}
    for call in parsed.tool_calls:  # every valid call was streamed, under the id the final result now carries
        _, name, arguments = streamed[call["id"]]
        assert name == call["name"] and json.loads(arguments) == call["arguments"]
    parse_ids = {c["id"] for c in parsed.tool_calls} | {c["id"] for c in parsed.invalid_tool_calls}
    assert set(streamed) <= parse_ids
    return content, [c[1:] for c in calls]


def deltas(events):
    return [v for k, v in events if k == "tool_call"]


def test_content_only():
    text = "  Hello,\n\n world: 1 < 2 and <b>bold</b> and a stray </tool_call> too.  \n"
    for tools in (None, TOOLS):
        events, parsed, _ = run(text, tools)
        assert deltas(events) == []
        assert "".join(v for _, v in events) == parsed.content == text.strip()
    events, _, _ = run(text, None, [text])
    assert events == [("content", text.strip())]


def test_one_call():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events, parsed, stream = run(text)
    assert check(text) == ("Let me check.", [["get_weather", '{"city": "Paris"}']])
    first = deltas(events)[0]
    assert (first.index, first.name, first.id) == (0, "get_weather", stream.ids[0])
    assert parsed.tool_calls[0]["id"] == stream.ids[0]
    # the name is announced as soon as its closing quote is in, before any argument text exists
    stream = ToolCallStream(TOOLS)
    assert stream.feed('<tool_call>\n{"name": "get_wea') == []
    (kind, delta), = stream.feed('ther", "argu')
    assert kind == "tool_call" and delta.name == "get_weather" and delta.arguments == ""
    assert stream.feed('ments": {"ci') == [("tool_call", ToolCallDelta(0, None, None, '{"ci'))]


def test_two_calls_with_content_between():
    text = ('I will call two tools. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '\n\nand then \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n')
    assert check(text) == ("I will call two tools. \n\nand then",
                           [["get_weather", '{"city": "Oslo"}'], ["get_time", "{}"]])
    # whitespace alone between and around calls is no content, as in the stripped final parse
    calls_only = ('\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
                  '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')
    events, parsed, stream = run(calls_only)
    assert [k for k, _ in events] == ["tool_call"] * len(events) and parsed.content == ""
    assert [d.index for d in deltas(events) if d.id] == [0, 1] and len(set(stream.ids)) == 2


def test_nested_arguments_and_tricky_strings():
    args = {"city": 'Pa"r}i{s', "q": {"deep": [1, {"x": "a\\\"}]"}], "e": ""}, "path": "C:\\dir\\", "u": "é\u2028"}
    body = json.dumps({"name": "get_weather", "arguments": args}, indent=2)
    text = f"<tool_call>\n{body}\n</tool_call> after"
    content, calls = check(text)
    assert content == "after" and calls[0][0] == "get_weather" and json.loads(calls[0][1]) == args
    start = text.index("{", text.index('"arguments"'))  # the streamed text is the arguments' text, verbatim
    assert calls[0][1] == text[start:json_object_end(text, start)]
    bare = check(body, TOOLS, [body])  # the same call as a bare answer (the untagged fallback): re-serialised
    assert bare[0] == "" and bare[1][0][0] == "get_weather" and json.loads(bare[1][0][1]) == args


def test_close_tag_inside_a_string_ends_the_call_as_in_the_final_parse():
    # parse_tool_calls cuts a call at the first </tool_call>, even one inside a JSON string; the stream mirrors
    # it, so what was streamed agrees with the final result (an invalid call, and the rest as content)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>'
    events, parsed, stream = run(text)
    assert parsed.tool_calls == [] and len(parsed.invalid_tool_calls) == 1
    assert summary(events) == ('b"}}</tool_call>', [[stream.ids[0], "get_weather", '{"city": "a']])
    assert parsed.invalid_tool_calls[0]["id"] == stream.ids[0]


def test_partial_open_tag_at_a_chunk_boundary():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Checking <tool_") == [("content", "Checking")]  # " <tool_" may still open a call
    events = stream.feed('call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [k for k, _ in events] == ["tool_call"]
    stream = ToolCallStream(None)
    assert stream.feed("a <tool_") == [("content", "a")]
    assert stream.feed("box> b") == [("content", " <tool_box> b")]
    assert stream.feed("<") == []
    assert stream.finish(parse_tool_calls("a <tool_box> b<", None)) == [("content", "<")]
    for split in range(1, 12):  # the tag split anywhere
        text = 'x <tool_call>{"name": "get_time"}</tool_call>'
        assert check(text, TOOLS, [text[:split], text[split:]]) == ("x", [["get_time", "{}"]])


def test_malformed_calls_never_raise_and_invent_no_name():
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    events, parsed, stream = run(unclosed)
    assert summary(events)[1] == [[stream.ids[0], "get_weather", '{"city": "Pa']]
    assert parsed.invalid_tool_calls[0]["id"] == stream.ids[0] and "malformed" in parsed.invalid_tool_calls[0]["error"]
    for body in ("garbage", '{"arguments": {"city": "X"}}', '{"name": 3, "arguments": {}}', "", '["name", "x"]',
                 '{"name" "get_time"}', '{"nam\\q": "x"}', '{"name": "bad\\q"}'):
        text = f"A <tool_call>{body}</tool_call> B <tool_call>{body}"
        events, parsed, stream = run(text)
        assert deltas(events) == [] and stream.ids == []
        assert parsed.content == "A  B" == summary(events)[0] and len(parsed.invalid_tool_calls) == 2
    # a name seen before the JSON breaks is streamed; the final parse calls the call invalid and keeps its id
    text = '<tool_call>{"name": "get_time", "arguments": {}} trailing</tool_call>'
    events, parsed, stream = run(text)
    assert summary(events)[1] == [[stream.ids[0], "get_time", "{}"]]
    assert parsed.tool_calls == [] and parsed.invalid_tool_calls[0]["id"] == stream.ids[0]
    # unknown tools and bad arguments are streamed as seen and judged by the final parse
    text = '<tool_call>{"name": "launch", "arguments": {"x": 1}}</tool_call>'
    events, parsed, stream = run(text)
    assert summary(events)[1][0][1:] == ["launch", '{"x": 1}'] and parsed.invalid_tool_calls[0]["id"] == stream.ids[0]


def test_other_argument_spellings_match_the_final_parse():
    for body, arguments in [
        ('{"arguments": {"city": "Rome"}, "name": "get_weather"}', '{"city": "Rome"}'),  # name last: announced late
        ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', '{"city": "Rome"}'),  # a JSON string
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', '{"city": "Rome"}'),
        ('{"name": "get_time"}', "{}"),
        ('{"na\\u006de": "get_time", "arguments": {}}', "{}"),  # escaped key
    ]:
        text = f"<tool_call>{body}</tool_call>"
        content, calls = check(text)
        assert content == "" and json.loads(calls[0][1]) == json.loads(arguments)
        assert check(text, TOOLS, [text]) == (content, calls)


def test_untagged_fenced_call_is_emitted_at_finish():
    text = ('Here is the call:\n```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```\nDone.')
    stream = ToolCallStream(TOOLS)
    streamed = [e for ch in text for e in stream.feed(ch)]
    assert summary(streamed) == ("Here is the call:", [])  # the fence is held back, never content
    parsed = parse_tool_calls(text, TOOLS)
    last = stream.finish(parsed)
    assert last[0] == ("content", "\n\nDone.")
    (kind, delta), = last[1:]
    assert kind == "tool_call" and delta == ToolCallDelta(0, parsed.tool_calls[0]["id"], "get_weather",
                                                         '{"city": "Rome"}')
    assert stream.ids == [parsed.tool_calls[0]["id"]]
    assert check(text) == ("Here is the call:\n\nDone.", [["get_weather", '{"city": "Rome"}']])
    # a fence that is not a call is content as soon as it closes
    code = "See:\n```python\nprint({'a': 1})\n```\nok"
    stream = ToolCallStream(TOOLS)
    assert summary([e for ch in code for e in stream.feed(ch)])[0] == code  # all of it before finish
    # without tools there is no fallback: JSON is just text, and nothing is held
    events, parsed, _ = run(text, None)
    assert deltas(events) == [] and summary(events)[0] == parsed.content == text
    # a tag anywhere makes the parse ignore fences: what was held is content after all
    mixed = text + ' <tool_call>{"name": "get_time"}</tool_call>'
    assert check(mixed) == (text, [["get_time", "{}"]])
    # a bare JSON answer is held from its start
    bare = '  {"name": "get_time", "arguments": {}}  '
    stream = ToolCallStream(TOOLS)
    assert [e for ch in bare for e in stream.feed(ch)] == []
    assert check(bare) == ("", [["get_time", "{}"]])
    assert check('{"not": "a call"}') == ('{"not": "a call"}', [])
    # invalid fallback calls are not emitted, and their text is not content either
    assert check('x\n```\n{"name": "nope", "arguments": {}}\n```') == ("x", [])
    assert check("````\n``` \n```json\n{\"name\": \"get_time\"}```") == ("````\n```", [["get_time", "{}"]])


def test_ids_by_index_are_stable():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'  # invalid: city is required
            '<tool_call>nonsense</tool_call>'  # never announced
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    stream = ToolCallStream(TOOLS)
    events, seen = [], []
    for ch in text:
        events += stream.feed(ch)
        seen.append(stream.ids)
    parsed = parse_tool_calls(text, TOOLS)
    events += stream.finish(parsed)
    assert all(ids == stream.ids[:len(ids)] for ids in seen)  # ids only ever grow, by index
    firsts = [d for d in deltas(events) if d.id]
    assert [d.index for d in firsts] == [0, 1, 2] and [d.id for d in firsts] == stream.ids
    assert len(set(stream.ids)) == 3
    # finish put the streamed ids on the final parse's calls, valid and invalid alike
    assert [c["id"] for c in parsed.tool_calls] == [stream.ids[0], stream.ids[2]]
    assert parsed.invalid_tool_calls[0]["id"] == stream.ids[1]
    assert parsed.invalid_tool_calls[1]["id"] not in stream.ids  # the parse's own id for the unannounced call


def test_long_answer_one_character_at_a_time_keeps_small_buffers():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    text = "".join(f"word {i} <b>{'`' * (i % 3)}\n" + call % ("x" * 500) for i in range(100))
    stream = ToolCallStream(TOOLS)
    events = []
    for ch in text:
        events += stream.feed(ch)
        assert len(stream._pending) < len("</tool_call>")  # only a possible half tag is carried over
    events += stream.finish(parse_tool_calls(text, TOOLS))
    content, calls = summary(events)
    assert len(calls) == 100 and content == parse_tool_calls(text, TOOLS).content


def test_feed_after_finish_is_an_error():
    stream = ToolCallStream(None)
    stream.finish(parse_tool_calls("", None))
    with pytest.raises(RuntimeError):
        stream.feed("x")


# -- split invariance ------------------------------------------------------------------------------------------

_TRICKY = st.lists(st.sampled_from(['a', ' ', '"', '\\', '{', '}', '[', ']', ':', ',', '<', '>', '\n', 'é',
                                    '</tool_call>', '<tool_call>', '```', '`', 'name', '"name"']),
                   max_size=6).map("".join)
_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | _TRICKY,
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
                       max_leaves=6)
_ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "name", "arguments"]) | _TRICKY, _VALUES, max_size=3)


@st.composite
def _body(draw):
    name = draw(st.sampled_from(["get_weather", "get_time", "other", 'we"ird']))
    args = draw(_ARGS)
    shape = draw(st.sampled_from(["plain", "plain", "reversed", "string", "parameters", "none", "city"]))
    data = {"plain": {"name": name, "arguments": args}, "reversed": {"arguments": args, "name": name},
            "string": {"name": name, "arguments": json.dumps(args)}, "parameters": {"name": name, "parameters": args},
            "none": {"name": name}, "city": {"name": "get_weather", "arguments": {"city": draw(_TRICKY)}}}[shape]
    text = json.dumps(data, indent=draw(st.sampled_from([None, 0, 2])), ensure_ascii=draw(st.booleans()))
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "garbage", "trailing"]))
    if damage == "cut":
        text = text[:draw(st.integers(0, len(text)))]
    elif damage == "garbage":
        text = draw(_TRICKY)
    elif damage == "trailing":
        text += draw(_TRICKY)
    return text


_SPACE = st.sampled_from(["", " ", "\n", "\n\n", " \t"])
_CONTENT = st.lists(st.sampled_from(["Hi", " ", "\n", "<", "<tool_", "call>", "`", "```", "```json\n", "{", "}",
                                     '"name"', "</tool_call>", "é", "ok."]), max_size=6).map("".join)


@st.composite
def _answer(draw, kinds=("content", "tagged", "tagged", "fenced")):
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(kinds))
        if kind == "content":
            parts.append(draw(_CONTENT))
        elif kind == "tagged":
            parts.append(f"<tool_call>{draw(_SPACE)}{draw(_body())}{draw(_SPACE)}</tool_call>")
        else:
            parts.append(f"```{draw(st.sampled_from(['', 'json', 'python']))}\n{draw(_body())}\n```")
        parts.append(draw(_SPACE))
    ending = draw(st.sampled_from(["", "", "unclosed" if "tagged" in kinds else "", "bare"]))
    if ending == "unclosed":
        parts.append(f"<tool_call>{draw(_SPACE)}{draw(_body())}")
    elif ending == "bare" and not parts:
        parts.append(draw(_body()))
    return "".join(parts)


def _pieces(text, cuts):
    cuts = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])] or [""]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_answer(), tools=st.sampled_from([None, TOOLS]), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_gives_the_same_stream(text, tools, cuts):
    whole = check(text, tools, [text])
    assert check(text, tools, None) == whole  # one character at a time
    assert check(text, tools, _pieces(text, cuts)) == whole


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_answer(kinds=("content", "content", "fenced")), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_gives_the_same_stream_for_untagged_answers(text, cuts):
    whole = check(text, TOOLS, [text])  # bound tools, no tag: fenced and bare JSON calls are the parse's fallback
    assert check(text, TOOLS, None) == whole
    assert check(text, TOOLS, _pieces(text, cuts)) == whole
