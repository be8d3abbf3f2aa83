"""ssr/chat.py: tool-call parsing (no model needed)."""

from __future__ import annotations

from ssr.chat import parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"type": "string",
                                                                               "enum": ["c", "f"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]


def test_hermes_calls_several_and_content_kept():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    parsed = parse_tool_calls(text, TOOLS)
    assert [c["name"] for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert parsed.tool_calls[0]["arguments"] == {"city": "Paris"}
    assert parsed.content == "Sure."
    assert len({c["id"] for c in parsed.tool_calls}) == 2 and not parsed.invalid_tool_calls


def test_fenced_and_bare_json_calls():
    fenced = 'Call:\n```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```'
    assert parse_tool_calls(fenced, TOOLS).tool_calls[0]["arguments"] == {"zone": "UTC"}
    bare = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert parse_tool_calls(bare, TOOLS).tool_calls[0]["name"] == "get_time"
    assert parse_tool_calls(bare, None).tool_calls == []  # without bound tools, JSON text is just text


def test_bad_calls_become_invalid_never_raise():
    truncated = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', TOOLS)
    assert not truncated.tool_calls and "malformed" in truncated.invalid_tool_calls[0]["error"]
    assert truncated.invalid_tool_calls[0]["name"] == "get_weather"
    unknown = parse_tool_calls('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', TOOLS)
    assert "unknown tool" in unknown.invalid_tool_calls[0]["error"]
    missing = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"unit": "c"}}</tool_call>', TOOLS)
    assert "'city' is a required property" in missing.invalid_tool_calls[0]["error"]
    wrong = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>', TOOLS)
    assert "3 is not of type 'string'" in wrong.invalid_tool_calls[0]["error"]
    enum = parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "X", "unit": "k"}}'
                            '</tool_call>', TOOLS)
    assert "one of" in enum.invalid_tool_calls[0]["error"]
    # a well-formed call keeps its parsed arguments (frameworks hand it to their tool executor); malformed JSON has none
    assert [c.invalid_tool_calls[0].get("arguments") for c in (truncated, unknown, missing, wrong)] == \
        [None, {}, {"unit": "c"}, {"city": 3}]


def test_echoed_tool_definition_is_not_a_call():
    echo = '{"name": "get_time", "description": "d", "parameters": {"type": "object", "properties": {}}}'
    parsed = parse_tool_calls(echo, TOOLS)
    assert not parsed.tool_calls and "definition" in parsed.invalid_tool_calls[0]["error"]


def test_call_ids_derive_from_the_seed():
    # the engine seeds with its prompt's digest: the same request gets the same ids (an agent's next prompt holds them)
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>\n'
            '<tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    ids = [[c["id"] for c in p.tool_calls + p.invalid_tool_calls]
           for p in (parse_tool_calls(text, TOOLS, id_seed=s) for s in ("a", "a", "b", None, None))]
    assert ids[0] == ids[1] and len(set(ids[0])) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids[0])
    assert not set(ids[0]) & set(ids[2]) and ids[3] != ids[4]  # another prompt, or no seed: other ids
