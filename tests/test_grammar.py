"""Grammar-constrained answers: the grammars themselves (on the real tokenizer, no weights), and exactness of plain
decoding vs SSR when every lane and verify row applies the mask (tiny random models)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
import torch
from jsonschema import validate
from transformers import AutoTokenizer

from ssr import SSRConfig
from ssr.grammar import Grammars, json_grammar, response_schema, tool_call_grammar
from ssr.models import resolve_model
from ssr.toolcalls import parse_tool_calls
from tiny import TOOL_VOCAB, prompt_ids, tiny_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer"}},
          "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}}}]


@pytest.fixture(scope="module")
def qwen():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    return tokenizer, Grammars(tokenizer, 151936, {151643, 151645})


def _follows(qwen, grammar: str, text: str, before: str = "") -> bool:
    tokenizer, grammars = qwen
    constraint = grammars.compile(grammar).constraint(before)
    constraint.sync(tokenizer.encode(text, add_special_tokens=False))
    return constraint.broken is None


def test_json_answers_follow_the_schema(qwen):
    grammar = json_grammar(SCHEMA)
    assert _follows(qwen, grammar, '{"city": "Paris", "unit": "celsius", "days": 3}')
    assert _follows(qwen, grammar, '{"city": "Paris", "unit": "celsius"}', before="\n\n")  # after a close
    assert not _follows(qwen, grammar, '{"city": "Paris", "unit": "kelvin"}')
    assert not _follows(qwen, grammar, '{"city": "Paris", "unit": "celsius", "days": "3"}')
    assert not _follows(qwen, grammar, '{"city":"Paris"}')  # one JSON style: the model's own, no whitespace runs


def test_call_grammar_by_tool_choice(qwen):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    bad_name = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "convert", "arguments": {"amount": "ten"}}\n</tool_call>'
    auto, required = tool_call_grammar(TOOLS, "auto"), tool_call_grammar(TOOLS, "required")
    assert _follows(qwen, auto, "No tool fits; the answer is 4.")
    assert _follows(qwen, auto, "Let me check.\n" + call + "\n" + call)
    assert not _follows(qwen, auto, bad_name) and not _follows(qwen, auto, bad_args)
    assert _follows(qwen, required, call) and not _follows(qwen, required, "The answer is 4.")
    assert not _follows(qwen, tool_call_grammar(TOOLS, "convert"), call)
    with pytest.raises(ValueError, match="names no bound tool"):
        tool_call_grammar(TOOLS, "get_time")


WRITE_TOOL = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}]
ESCAPED = json.dumps({"name": "write_file", "arguments": {"path": "calc.py", "content": (
    'def add(a, b):\n    """Return "a" plus b."""\n    return a + b\n')}})


@pytest.mark.parametrize("special_markers", [True, False])
def test_auto_grammar_constrains_fenced_and_bare_calls(qwen, special_markers):
    """Under "auto" the untagged call forms the parser reads (a JSON object in a code fence, or as the whole answer)
    are constrained like tagged calls: valid JSON, a bound tool, schema-valid arguments. The docstring of a file
    written back must be escaped; other code fences stay free text."""
    auto = tool_call_grammar(WRITE_TOOL, "auto", special_markers=special_markers)
    raw = ESCAPED.replace("\\n", "\n").replace('\\"', '"')  # the broken form: newlines and quotes unescaped
    assert _follows(qwen, auto, f"I write the fix.\n```json\n{ESCAPED}\n```")
    assert _follows(qwen, auto, f"```\n\n  {ESCAPED}```")
    assert _follows(qwen, auto, f"  {ESCAPED}\n")  # the whole answer
    assert _follows(qwen, auto, "Here:\n```python\ndef f():\n    return {1: 2}\n```\nDone. {not json}")
    assert not _follows(qwen, auto, f"```json\n{raw}\n```")
    assert not _follows(qwen, auto, '```json\n{"path": "calc.py"}\n```')  # a fenced JSON object is a call
    assert not _follows(qwen, auto, '```json\n{"name": "run_tests", "arguments": {}}\n```')  # not a bound tool
    assert not _follows(qwen, auto, '{"name": "write_file", "arguments": {"path": "a.py"}}')  # content missing
    assert not _follows(qwen, auto, f"\n\n{ESCAPED}\n```\nmore")  # a fence's close with no opening: no call
    no_args = [{"type": "function", "function": {"name": "tick", "parameters": {"type": "object", "properties": {}}}}]
    closed = tool_call_grammar(no_args, "auto", special_markers=special_markers)  # only declared keys
    assert _follows(qwen, closed, '```json\n{"name": "tick", "arguments": {}}\n```')
    assert not _follows(qwen, closed, '```json\n{"name": "tick", "arguments": {"type": "object"}}\n```')
    parsed = parse_tool_calls(f"I write the fix.\n```json\n{ESCAPED}\n```", WRITE_TOOL)
    assert [c["arguments"] for c in parsed.tool_calls] == [json.loads(ESCAPED)["arguments"]]


def test_a_fenced_call_whose_strings_hold_a_fence_parses():
    """The fence of a call closes after its JSON, not at a fence inside one of its strings (a Markdown file)."""
    call = json.dumps({"name": "write_file", "arguments": {"path": "README.md", "content": "```sh\nmake\n```\n"}})
    parsed = parse_tool_calls(f"Writing it.\n```json\n{call}\n```\nThen the tests.", WRITE_TOOL)
    assert [c["arguments"]["content"] for c in parsed.tool_calls] == ["```sh\nmake\n```\n"]
    assert parsed.content == "Writing it.\n\nThen the tests." and not parsed.invalid_tool_calls


def test_response_formats():
    assert response_schema(None) is None and response_schema({"type": "text"}) is None
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}) == SCHEMA
    with pytest.raises(ValueError, match="needs a schema"):
        response_schema({"type": "json_schema", "json_schema": {"name": "w"}})
    with pytest.raises(ValueError, match="unknown response_format"):
        response_schema({"type": "yaml"})


def test_padding_ids_are_never_allowed_and_a_verify_walk_leaves_no_trace(qwen):
    tokenizer, grammars = qwen
    constraint = grammars.compile(json_grammar(SCHEMA)).constraint()
    answer = tokenizer.encode('{"city": "Pa', add_special_tokens=False)
    proposal = tokenizer.encode('ris", "unit": "c', add_special_tokens=False)
    rows = constraint.rows(torch.zeros(len(proposal) + 1, 151936), answer, proposal)
    allowed = torch.isfinite(rows)
    assert not allowed[:, 151665:].any()  # Qwen's [PAD...] fillers: text inside a string otherwise
    assert all(allowed[i, t] for i, t in enumerate(proposal))
    again = constraint.rows(torch.zeros(1, 151936), answer, [])  # the walk left no trace
    assert torch.equal(torch.isfinite(again[0]), allowed[0])
    after_city = constraint.rows(torch.zeros(2, 151936), answer, proposal[:1])[1]
    assert torch.equal(torch.isfinite(after_city), allowed[1])


def test_a_walked_proposal_leaves_the_lane_matcher_as_plain_decoding_has_it(qwen):
    """A proposal walked through the rows (a read_file call) and refused must not bend what the lane's matcher
    allows after the call written instead (a write_file call): llguidance 1.9's rollback of such a walk left a
    matcher that refused the `",` closing "path" there (found replaying an agent step), so walks run on a copy."""
    tokenizer, grammars = qwen
    text = {"type": "string"}
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
                 "type": "object", "properties": {"path": text}, "required": ["path"]}}},
             {"type": "function", "function": {"name": "write_file", "parameters": {
                 "type": "object", "properties": {"path": text, "content": text}, "required": ["path", "content"]}}}]
    grammar = grammars.compile(tool_call_grammar(tools, "auto"))
    head = tokenizer.encode("I fix it.\n```json", add_special_tokens=False)
    proposal = tokenizer.encode('\n{"name": "read_file", "arguments": {"path": "', add_special_tokens=False)
    call = '\n{"name": "write_file", "arguments": {"path": "a'
    written = tokenizer.encode("I fix it.\n```json" + call, add_special_tokens=False)
    lane, plain = grammar.constraint(), grammar.constraint()
    walked = lane.rows(torch.zeros(len(proposal) + 1, 151936), head, proposal)
    assert all(torch.isfinite(walked[i, t]) for i, t in enumerate(proposal))  # the whole call was walked
    after = lane.rows(torch.zeros(1, 151936), written, [])[0]
    plain.sync(written)
    assert torch.equal(torch.isfinite(after), torch.isfinite(plain.rows(torch.zeros(1, 151936), written, [])[0]))
    assert torch.isfinite(after[tokenizer.encode('",', add_special_tokens=False)[0]])


# -- exactness on tiny models -----------------------------------------------------------------------------------------

TINY_SCHEMA = {"type": "object", "properties": {"ab": {"enum": ["ab", "hz"]}, "name": {"type": "string"}},
               "required": ["ab"], "additionalProperties": False}  # spelled with the tiny vocabulary
TINY_TOOLS = [{"type": "function", "function": {"name": name, "parameters": TINY_SCHEMA}} for name in ("ab", "h_z")]
CASES = {"one-draft": dict(draft_start=2), "several-drafts": dict(draft_start=1, draft_interval=2, max_drafts=2),
         "forced-close": dict(draft_start=1, max_think_tokens=3), "suffix-only-peer": dict(max_drafts=0),
         "small-verify-chunks": dict(draft_start=1, max_verify_tokens=2, max_suffix_tokens=2)}
BASE = dict(max_think_tokens=10, max_tokens=120, max_draft_tokens=80, suffix_min_match=1, suffix_min_prob=0.0)


def _pairs(**request):
    for seed in range(4):
        engine = tiny_engine(seed, attention=0.4, scale=0.5, vocab=TOOL_VOCAB)
        for name, overrides in CASES.items():
            for thinking in (True, False):
                plain, ssr = (engine.generate(prompt_ids("abc"), thinking=thinking,
                                              config=SSRConfig(enabled=enabled, **{**BASE, **overrides}), **request)
                              for enabled in (False, True))
                yield (seed, name, thinking), plain, ssr


def test_structured_output_is_exact_and_valid():
    """A JSON-schema answer: every lane and verify row masks, and SSR stays token-identical to plain decoding;
    every complete JSON answer follows the schema. (This 29-token vocabulary cannot spell every string the grammar
    allows; where the mask admits a token the parser then refuses, the answer ends there, in both.)"""
    endings = collections.Counter()
    for case, plain, ssr in _pairs(response_format={"type": "json_schema", "json_schema": {"schema": TINY_SCHEMA}}):
        assert ssr.token_ids == plain.token_ids and ssr.answer == plain.answer, case
        assert plain.answer.lstrip().startswith("{"), (case, plain.answer)
        try:
            value = json.loads(plain.answer)
        except json.JSONDecodeError:
            endings["incomplete"] += 1
            continue
        validate(value, TINY_SCHEMA)
        endings["valid"] += 1
    assert endings["valid"], endings


def test_auto_tool_calls_are_exact_and_name_bound_tools():
    """tool_choice="auto": free text, and wherever the model opens a call, the grammar keeps the call to a bound
    tool with schema-valid arguments; plain and SSR identical."""
    calls = collections.Counter()
    for case, plain, ssr in _pairs(tools=TINY_TOOLS, tool_choice="auto"):
        assert ssr.token_ids == plain.token_ids and ssr.answer == plain.answer, case
        assert not plain.invalid_tool_calls or plain.finish_reason == "length", (case, plain.invalid_tool_calls)
        for call in plain.tool_calls:
            assert call["name"] in ("ab", "h_z")
            validate(call["arguments"], TINY_SCHEMA)
        calls[bool(plain.tool_calls)] += 1
    assert calls[True] and calls[False], calls  # some answers call, some do not


@pytest.mark.real_model
def test_real_model_json_answer_is_exact_and_valid(default_engine):
    """The default model asked for a JSON answer: plain decoding and SSR (every speculation path priced to pay)
    write the same tokens, and the answer is JSON that follows the schema."""
    from ssr import SSREngine
    from ssr.costs import CostTable

    flat = SSREngine(default_engine.backend, default_engine.tokenizer, family=default_engine.family,
                     costs=CostTable.flat())
    question = [{"role": "user", "content": "Give the weather request for Oslo, in celsius, for 3 days, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    cfg = dict(max_think_tokens=48, max_tokens=160, draft_start=8)
    plain = default_engine.generate(question, response_format=fmt, config=SSRConfig(enabled=False, **cfg))
    ssr = flat.generate(question, response_format=fmt, config=SSRConfig(**cfg))
    assert ssr.token_ids == plain.token_ids
    assert plain.finish_reason == "stop", plain.answer
    validate(json.loads(plain.answer), SCHEMA)
    assert ssr.stats["forward_passes"] < plain.stats["forward_passes"]


def test_masking_a_row_loads_no_torch_compiler():
    """The first constrained request used to import ``llguidance.torch``, whose ``torch.compile`` decorator pulls in
    the compiler's backend (543 more modules after transformers, about a second of that request's latency); the numpy
    helpers compute the same masks."""
    code = ("import sys, torch\n"
            "from transformers import AutoTokenizer\n"
            "from ssr.grammar import Grammars, json_grammar\n"
            "from ssr.models import resolve_model\n"
            "tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))\n"
            "constraint = Grammars(tokenizer, 151936, {151645}).compile(json_grammar({'type': 'integer'})).constraint()\n"
            "rows = constraint.rows(torch.zeros(1, 151936), [], [])\n"
            "allowed = {tokenizer.decode([int(i)]) for i in torch.isfinite(rows[0]).nonzero()[:, 0]}\n"
            "print(int('llguidance.torch' in sys.modules), int('7' in allowed), int('x' in allowed))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["0", "1", "0"]
