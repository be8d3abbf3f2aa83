"""The engine's Python API under hostile arguments (issue 32): property tests (hypothesis) over ``generate``'s
arguments on a tiny model. Every call either returns a result or raises a ``ValueError``/``TypeError`` whose message
names an argument it was given wrong (never an error from deep inside the template, the grammar, torch or the
scheduler); the engine serves a normal request afterwards, with no request or lane left behind.

A call is a well-formed one (``BASE``) with one or two arguments replaced by generated values: prompts (text, token
ids, chat messages, other types), tools and tool_choice, budgets and sampling settings (huge, negative, non-finite,
wrong types), stop strings, seeds, ``thinking``, ``response_format``, ``config``, ``timeout``, unknown keywords. A
timeout short enough to pass is not an argument error (``RequestTimeout``), so the timeouts drawn are invalid or
long. Reproducible: ``derandomize=True``, no example database."""

from __future__ import annotations

import math
import time

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny import CHAT_TEMPLATE, GUIDED_TOOLS, TOOL_VOCAB, tiny_engine  # noqa: E402

from ssr import GenerationResult, SSRConfig  # noqa: E402

EXAMPLES = 160
BASE = {"prompt": "abc", "max_tokens": 4}
OUTCOMES: dict[str, int] = {"result": 0, "ValueError": 0, "TypeError": 0}


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(0, vocab=TOOL_VOCAB, max_think_tokens=6)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    yield engine
    engine.close()


NUMBERS = st.one_of(st.sampled_from([0, 1, -1, 2, 3, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.5, 1e-300,
                                     5e-324, 1e308, math.inf, -math.inf, math.nan, True]),
                    st.integers(-10, 10), st.floats())
OTHER = st.sampled_from([None, "abc", "", b"abc", 3, 2.5, [], {}, ("a",), {"a": 1}, object()])
TEXT = st.text(alphabet="abcdehxyz \n", max_size=16)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", "", 5, None])
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={"content": TEXT | OTHER | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                                  max_size=2),
              "tool_calls": st.lists(st.sampled_from([
                  {"function": {"name": "ab", "arguments": "{}"}}, {"function": {"name": "ab", "arguments": "{"}},
                  {"name": "ab", "arguments": {}}, {"function": {"name": 5}}, {"function": "ab"}, "ab", None]),
                  max_size=2) | OTHER,
              "tool_call_id": st.just("call_1") | OTHER, "name": st.just("ab") | OTHER})
PROMPTS = st.one_of(
    TEXT, st.just("   "), st.just("a" * 600),  # blank; over the tiny model's 512-token window
    st.lists(st.integers(-2, len(TOOL_VOCAB) + 2), max_size=6), st.lists(st.booleans(), min_size=1, max_size=3),
    st.lists(MESSAGE, max_size=3), st.lists(st.just(1) | MESSAGE, min_size=2, max_size=3), OTHER)
SCHEMAS = st.sampled_from([{"type": "object", "properties": {}}, {"type": "object", "properties": {"a": {"type":
                           "string", "pattern": "["}}}, {"type": "string"}, {"type": 5}, {"anyOf": []},
                           {"type": "object", "properties": {"a": {"$ref": "#/nope"}}, "required": ["a"]}, "x", [],
                           None])
TOOL = st.one_of(st.sampled_from(GUIDED_TOOLS),
                 st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                           st.sampled_from(["ab", "abc", "", "a b", 5]), SCHEMAS),
                 st.sampled_from([{"type": "function"}, {"function": "ab"}, {}, "ab"]))
CONFIGS = st.one_of(st.builds(SSRConfig, max_tokens=st.integers(1, 6), max_think_tokens=st.integers(0, 6),
                              enabled=st.booleans(), temperature=st.sampled_from([0.0, 0.7])),
                    st.sampled_from([{"max_tokens": 4}, "greedy"]))
RESPONSE_FORMATS = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "bogus"}, {"type": "json_schema"},
                     {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a":
                      {"type": "integer"}}, "required": ["a"]}}}, {"type": "json_schema", "json_schema": {"schema":
                      {"type": "bogus"}}}, {"type": "json_schema", "json_schema": {"schema": 5}}, {}]), OTHER)

ARGUMENTS = {
    "prompt": PROMPTS,
    "tools": st.lists(TOOL, max_size=3) | OTHER,
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", "ab", "abc", "h_z", "nope", ""]) | OTHER,
    "max_tokens": NUMBERS | OTHER, "temperature": NUMBERS | OTHER, "top_p": NUMBERS | OTHER,
    "top_k": NUMBERS | OTHER, "seed": NUMBERS | OTHER,
    "stop": TEXT | st.lists(TEXT, max_size=3) | st.lists(TEXT | OTHER, min_size=1, max_size=2) | OTHER,
    "thinking": st.booleans() | OTHER,
    "response_format": RESPONSE_FORMATS,
    "config": CONFIGS | OTHER,
    "timeout": st.sampled_from([None, 60, 60.5, math.inf, 0, -1, math.nan, "10", True, [1]]),
    "cache_salt": st.sampled_from(["a", "b"]) | OTHER,
    "max_new_tokens": st.just(4),  # not an argument of generate (a common slip for max_tokens)
}
# the words an error about each argument may name it by
NAMES = {"prompt": ("prompt",), "tools": ("tool",), "tool_choice": ("tool_choice",), "config": ("config", "SSRConfig")}


@st.composite
def calls(draw) -> dict:
    call = dict(BASE)
    for name in draw(st.lists(st.sampled_from(sorted(ARGUMENTS)), min_size=1, max_size=2, unique=True)):
        call[name] = draw(ARGUMENTS[name])
    return call


def named(message: str, call: dict) -> bool:
    """Whether ``message`` names one of the arguments that differ from ``BASE``."""
    changed = [name for name in call if name not in BASE or call[name] != BASE[name]]
    return any(word in message for name in changed for word in NAMES.get(name, (name,)))


@given(call=calls())
@example(call={**BASE, "seed": 2**64, "temperature": 1.0})  # torch's generators take [-2**63, 2**64 - 1]
@example(call={**BASE, "temperature": 1e-300})  # overflowed to NaN probabilities (now: the floor, one-hot)
@example(call={**BASE, "top_p": 1e-300, "temperature": 1.0})  # rounded to 0.0 in float32 (now: the floor)
@example(call={**BASE, "prompt": [-1, 3]})  # an id outside the vocabulary reached the embedding
@example(call={**BASE, "response_format": "json"})  # .get on a string
@example(call={**BASE, "prompt": [{"role": "assistant", "tool_calls": [{"function": "ab"}]}]})
@example(call={**BASE, "max_tokens": 2.0})
@example(call={**BASE, "prompt": [{"role": "wizard", "content": "abc"}]})
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_generate_returns_a_result_or_names_the_bad_argument(engine, call):
    args = dict(call)
    prompt = args.pop("prompt")
    try:
        result = engine.generate(prompt, **args)
    except (ValueError, TypeError) as exc:
        OUTCOMES[type(exc).__name__] += 1
        assert named(str(exc), call), f"{type(exc).__name__}: {exc} does not name an argument of {call!r}"
        return
    OUTCOMES["result"] += 1
    assert isinstance(result, GenerationResult) and result.finish_reason in ("stop", "length", "tool_calls")


def test_the_engine_still_serves_after_the_run(engine):
    """After the property run (module order): both kinds of outcome were seen, nothing is left queued or running
    and no lane is held but the parked one, and a normal request is answered."""
    assert sum(OUTCOMES.values()) >= EXAMPLES, OUTCOMES
    assert OUTCOMES["result"] > 0 and OUTCOMES["ValueError"] + OUTCOMES["TypeError"] > 0, OUTCOMES
    deadline = time.monotonic() + 30  # the scheduler drops a finished request after its pass, as its caller reads
    while (load := engine.load_stats())["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert load["queued"] == 0 and load["running"] == 0 and load["live_lanes"] <= 1, load
    assert engine.generate("abc de", max_tokens=6).token_ids
