"""ssr/schema.py: schema proposals inside a tool call (no model needed)."""

from __future__ import annotations

from ssr.schema import SchemaProposer
from test_chat import TOOLS


def test_schema_proposals():
    schema = SchemaProposer(TOOLS)
    assert schema.propose("<tool_call>") == '\n{"name": "'
    assert schema.propose('<tool_call>\n{"name": "get_w') == 'eather", "arguments":'
    assert schema.propose('<tool_call>\n{"name": "get_') == ""  # two tools share the prefix: nothing is fixed
    assert schema.propose('<tool_call>\n{"name": "get_weather", "arguments": {"ci') == 'ty": '
    assert schema.propose('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "u') == 'nit": '
    assert schema.propose('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == ""
    assert schema.propose("no call here") == ""
    assert schema.propose('<tool_call>{"name": "get_time"}</tool_call>') == ""
