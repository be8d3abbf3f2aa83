"""Reasoning-model families: DeepSeek-R1 distills, Qwen3's enable_thinking, and OpenAI's harmony (gpt-oss).

Each family is tested on chat templates written for the tests in its format and on tiny random models: the prompt
it renders, a conversation with reasoning and tool calls rendered and a model's output parsed back, and greedy
exactness of SSR against plain decoding with thinking on, off and force-closed at the budget.
"""

from __future__ import annotations

import collections
import json

import openai_harmony as oh
import pytest

from ssr import SSRConfig
from ssr.chat import (DEEPSEEK_R1, HARMONY, QWEN2_INSTRUCT, QWEN3, REASONING, THINK_INSTRUCTION,
                      TOOL_RESULT_DEMONSTRATION, detect_family, parse_tool_calls, render_prompt)
from ssr.transcript import FINISHED, Transcript
from tiny import (CHAT_TEMPLATE, FAMILY_VOCAB, QWEN3_TEMPLATE, R1_TEMPLATE, family_engine, harmony_tokenizer,
                  offline_harmony_vocab, tiny_tokenizer)

offline_harmony_vocab()  # before the first harmony encoding loads

TEMPLATES = {"deepseek-r1": R1_TEMPLATE, "qwen3": QWEN3_TEMPLATE, "harmony": None}
FAMILY = {"deepseek-r1": DEEPSEEK_R1, "qwen3": QWEN3, "harmony": HARMONY}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}
# a user asks, the assistant reasons and calls a tool, the tool answers: the next turn is the model's
AGENT_TURN = [{"role": "user", "content": "weather in paris"},
              {"role": "assistant", "content": "", "reasoning_content": "need weather.", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
USER = [{"role": "user", "content": "abc"}]


def tokenizer_for(name):
    if TEMPLATES[name] is None:
        return harmony_tokenizer()
    tokenizer = tiny_tokenizer(FAMILY_VOCAB)
    tokenizer.chat_template = TEMPLATES[name]
    return tokenizer


def harmony_reference(messages, next_role="assistant") -> str:
    """The conversation as openai-harmony itself renders it, for the prompts SSR must reproduce."""
    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    convo = oh.Conversation.from_messages(messages)
    return enc.decode(enc.render_conversation_for_completion(convo, oh.Role(next_role)))


# -- (a) detection and the rendered prompt ---------------------------------------------------------------------

def test_detect_family_from_the_template():
    assert {name: detect_family(tokenizer_for(name), None) for name in TEMPLATES} == FAMILY
    plain = tiny_tokenizer(FAMILY_VOCAB)
    plain.chat_template = CHAT_TEMPLATE  # names <think>, opens nothing: the generic reasoning family, as before
    assert detect_family(plain, None) is REASONING
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert detect_family(plain, None) is QWEN2_INSTRUCT
    assert detect_family(plain, "gpt_oss") is HARMONY


def test_r1_prompt_opens_thinking_once():
    tok = tokenizer_for("deepseek-r1")
    thinking = render_prompt(tok, DEEPSEEK_R1, USER, thinking=True)
    assert thinking == "u\nabc\na\n<think>\n" and thinking.count("<think>") == 1  # the template's, no second one
    direct = render_prompt(tok, DEEPSEEK_R1, USER, thinking=False)
    assert direct == "u\nabc\na\n<think>\n</think>\n\n"  # the opened block closed empty: the model answers


def test_qwen3_enable_thinking_both_ways():
    tok = tokenizer_for("qwen3")
    on = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on != off and off.endswith("a\n<think>\n\n</think>\n\n")
    assert render_prompt(tok, QWEN3, USER, thinking=True) == on + "<think>\n"
    assert render_prompt(tok, QWEN3, USER, thinking=False) == off


def test_harmony_prompt_is_openai_harmony_rendering():
    messages = [{"role": "system", "content": "be brief"}, *USER]
    reference = harmony_reference([
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new()),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions("be brief")),
        oh.Message.from_role_and_content(oh.Role.USER, "abc")])
    tok = tokenizer_for("harmony")
    assert reference.endswith("<|start|>assistant")
    assert render_prompt(tok, HARMONY, messages, thinking=True) == reference + "<|channel|>analysis<|message|>"
    assert render_prompt(tok, HARMONY, messages, thinking=False) == reference + "<|channel|>final<|message|>"


def test_instruct_step_after_a_tool_result_extends_the_decision_turns_prompt(tokenizer):
    """An instruct model's step after a tool call thinks, after the tool-result demonstration; the system block of
    the decision turn (the template's own, with the tools) stays first, so that step reuses the decision's cache."""
    decision = render_prompt(tokenizer, QWEN2_INSTRUCT, AGENT_TURN[:1], tools=WEATHER, thinking=False)
    after = render_prompt(tokenizer, QWEN2_INSTRUCT, AGENT_TURN, tools=WEATHER, thinking=True)
    system_block = decision[:decision.index("<|im_start|>user")]
    assert "get_weather" in system_block and after.startswith(system_block)
    assert after[len(system_block):].startswith(f"<|im_start|>user\n{TOOL_RESULT_DEMONSTRATION[0]['content']}")
    assert after.endswith("sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    # a turn on the user's message still thinks under the recipe's own system prompt and coding demonstration
    assert THINK_INSTRUCTION in render_prompt(tokenizer, QWEN2_INSTRUCT, USER, thinking=True)


def test_tool_result_demonstration_writes_its_edit_as_a_call_the_parser_reads():
    """The demonstration's edit exchange thinks the new file through, then calls with that file in the fenced form
    the model writes its own calls in; SSR's parser must read that answer as the call (else the model is taught a form
    that ends its loop), its content the file written out in the thought, and the exchange then answers."""
    write_file = {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}
    roles = [m["role"] for m in TOOL_RESULT_DEMONSTRATION]
    assert roles == ["user", "assistant", "tool", "assistant"] * 2 + ["tool", "assistant"]
    thought, _, answer = TOOL_RESULT_DEMONSTRATION[7]["content"].partition("</think>")
    parsed = parse_tool_calls(answer, [write_file])
    assert not parsed.invalid_tool_calls and [c["name"] for c in parsed.tool_calls] == ["write_file"]
    content = parsed.tool_calls[0]["arguments"]["content"]
    assert f"```python\n{content}```" in thought  # the call copies the file the thought wrote
    assert TOOL_RESULT_DEMONSTRATION[-1]["content"].partition("</think>")[2].strip()  # then answers in text


# -- (b) a conversation with reasoning and tool calls, rendered and parsed back --------------------------------------

def test_agent_turn_renders_in_each_format():
    call_json = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    r1 = render_prompt(tokenizer_for("deepseek-r1"), DEEPSEEK_R1, AGENT_TURN, tools=WEATHER)
    assert call_json in r1 and "<tool_response>\nsunny\n</tool_response>" in r1
    assert "need weather" not in r1 and r1.count("<think>") == 1  # R1 drops earlier reasoning; one open block
    qwen3 = render_prompt(tokenizer_for("qwen3"), QWEN3, AGENT_TURN, tools=WEATHER)
    assert f"a\n<think>\nneed weather.\n</think>\n\n{call_json}" in qwen3  # this loop's reasoning is kept
    assert qwen3.endswith("</tool_response>\na\n<think>\n")
    harmony = render_prompt(tokenizer_for("harmony"), HARMONY, AGENT_TURN, tools=WEATHER, thinking=True)
    tool = oh.ToolDescription.new("get_weather", "weather in a city", parameters=WEATHER[0]["function"]["parameters"])
    assert harmony == harmony_reference([
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new()),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_function_tools([tool])),
        oh.Message.from_role_and_content(oh.Role.USER, "weather in paris"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, "need weather.").with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"city": "paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), "sunny")
        .with_channel("commentary").with_recipient("assistant"),
    ]) + "<|channel|>analysis<|message|>"


# what a model writes after each family's prompt: reasoning, the close, then a tool call (or a final answer)
OUTPUTS = {
    "deepseek-r1": ('need weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}'
                    "\n</tool_call><eos>", "need weather.\n</think>\n\nit is sunny.<eos>"),
    "qwen3": ('need weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}'
              "\n</tool_call><eos>", "need weather.\n</think>\n\nit is sunny.<eos>"),
    "harmony": ('need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
                '<|constrain|>json<|message|>{"city": "paris"}<|call|>',
                "need weather.<|end|><|start|>assistant<|channel|>final<|message|>it is sunny.<|return|>"),
}


def transcript_of(name: str, text: str, thinking: bool = True) -> Transcript:
    """The engine's transcript after the model wrote ``text`` token by token (what plain decoding and SSR push)."""
    tok = tokenizer_for(name)
    eos = {tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")} if name == "harmony" else {0}
    t = Transcript(tok, FAMILY[name], SSRConfig(max_think_tokens=200, max_tokens=400), frozenset(eos), thinking)
    statuses = [t.push(token) for token in tok.encode(text, add_special_tokens=False)]
    assert statuses[-1] == FINISHED and t.finish.reason == "stop"
    return t


@pytest.mark.parametrize("name", TEMPLATES)
def test_model_output_parses_into_reasoning_content_and_calls(name):
    call, answer = OUTPUTS[name]
    t = transcript_of(name, call)
    assert t.closed_by == "model" and t.reasoning() == "need weather."
    parsed = t.tool_calls(WEATHER)
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == [("get_weather", {"city": "paris"})]
    assert parsed.content == "" and not parsed.invalid_tool_calls
    t = transcript_of(name, answer)
    assert t.reasoning() == "need weather." and t.answer() == "it is sunny."
    assert t.tool_calls(WEATHER).tool_calls == [] and t.tool_calls(WEATHER).content == "it is sunny."


def test_harmony_bad_call_is_invalid_and_answer_without_thinking():
    bad = transcript_of("harmony", 'hm<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
                                   '<|constrain|>json<|message|>{"town": "paris"}<|call|>')
    parsed = bad.tool_calls(WEATHER)
    assert not parsed.tool_calls and parsed.invalid_tool_calls[0]["name"] == "get_weather"
    direct = transcript_of("harmony", "it is sunny.<|return|>", thinking=False)  # after the final-channel prefill
    assert direct.reasoning() == "" and direct.answer() == "it is sunny."


def test_harmony_rejects_what_it_cannot_constrain_yet():
    engine = family_engine(None, max_tokens=8)
    with pytest.raises(ValueError, match="harmony"):
        engine.generate(USER, tools=WEATHER, tool_choice="required")
    with pytest.raises(ValueError, match="harmony"):
        engine.generate(USER, response_format={"type": "json_object"})


# -- (c) exactness on tiny random models with each family's template ---------------------------------------------

CASES = {
    "one-draft": dict(draft_start=2),
    "several-drafts": dict(draft_start=1, draft_interval=2, max_drafts=2),
    "forced-close": dict(draft_start=1, max_think_tokens=3),
    "min-think": dict(draft_start=1, min_think_tokens=6, max_think_tokens=12),
    "suffix-only": dict(max_drafts=0, suffix_sources=("prompt", "thinking", "answer")),
}
BASE = dict(max_think_tokens=10, max_tokens=40, max_draft_tokens=24)
MODELS = [(seed, attention) for seed in range(2) for attention in (0.0, 1.0)]


@pytest.mark.parametrize("name", TEMPLATES)
def test_ssr_is_plain_decoding_in_each_family(name):
    seen = collections.Counter()
    for seed, attention in MODELS:
        engine = family_engine(TEMPLATES[name], seed, attention=attention)
        assert engine.family is FAMILY[name]
        close = engine.tokenizer.encode(engine.family.close_text, add_special_tokens=False)
        for case, overrides in CASES.items():
            for thinking in (True, False):
                plain, ssr = (engine.generate(USER, thinking=thinking, config=SSRConfig(enabled=enabled,
                                                                                       **{**BASE, **overrides}))
                              for enabled in (False, True))
                where = (name, seed, attention, case, thinking)
                assert ssr.token_ids == plain.token_ids, where
                assert (ssr.reasoning, ssr.answer, ssr.finish_reason) == \
                       (plain.reasoning, plain.answer, plain.finish_reason), where
                s = ssr.stats
                seen["accepted"] += s["accepted_prefix_tokens"] + s["accepted_suffix_tokens"] + \
                    s["speculation"]["think"]["accepted"]
                seen["prefix"] += s["accepted_prefix_tokens"]  # a draft's answer was taken
                seen["drafts"] += len(s["drafts"])
                seen[f"closed_by_{s['think_closed_by']}"] += 1
                if s["think_closed_by"] == "budget":  # the family's own close text was forced at the budget
                    end = s["think_tokens"]
                    assert plain.token_ids[end - len(close):end] == close, where
                    seen["forced_close_text"] += 1
    assert seen["accepted"] > 0 and seen["prefix"] > 0 and seen["drafts"] > 0, seen
    assert seen["forced_close_text"] > 0 and seen["closed_by_none"] > 0, seen


def test_harmony_forced_close_writes_the_channel_switch():
    engine = family_engine(None, 1, max_think_tokens=3, max_tokens=12, draft_start=1)
    result = engine.generate(USER)
    text = engine.tokenizer.decode(result.token_ids)
    assert result.stats["think_closed_by"] == "budget" and result.stats["forced_tokens"] >= 4
    assert "<|end|><|start|>assistant<|channel|>final<|message|>" in text
    assert "<|" not in result.reasoning and "<|" not in result.answer  # the channel markup is not in the text


def test_prompt_ids_end_with_the_family_prefill():
    """What the engine prefills, not only what it renders: the tokens of each family's opening."""
    for name, (on, off) in {"deepseek-r1": ("a\n<think>\n", "<think>\n</think>\n\n"),
                            "qwen3": ("a\n<think>\n", "<think>\n\n</think>\n\n"),
                            "harmony": ("<|start|>assistant<|channel|>analysis<|message|>",
                                        "<|start|>assistant<|channel|>final<|message|>")}.items():
        engine = family_engine(TEMPLATES[name], max_tokens=8)
        decode = engine.tokenizer.decode
        assert decode(engine.encode(USER, thinking=True)).endswith(on), name
        assert decode(engine.encode(USER, thinking=False)).endswith(off), name
        assert decode(engine.encode(USER, thinking=True)).count("<think>") <= 1, name


@pytest.mark.parametrize("name", TEMPLATES)
def test_streamed_deltas_add_up_in_each_family(name):
    """Reasoning and answer stream as they become final; in harmony the answer is the final channel's text only."""
    engine = family_engine(TEMPLATES[name], 2, attention=1.0)
    for thinking in (True, False):
        events = list(engine.stream(USER, thinking=thinking, config=SSRConfig(**BASE, draft_start=1)))
        result = events[-1].result
        assert "".join(e.text for e in events if e.kind == "reasoning") == result.reasoning
        assert "".join(e.text for e in events if e.kind == "answer") == result.answer
        assert thinking or (result.reasoning == "" and result.stats["think_closed_by"] == "none")


@pytest.mark.parametrize("name", TEMPLATES)
def test_engine_round_trip_of_a_tool_call(name):
    """A scripted model writes the reasoning, its close and a tool call after the tool result; the engine returns
    them as reasoning and a parsed call, streamed and final alike, with SSR as with plain decoding."""
    from scripted import ScriptedBackend

    from ssr import SSREngine
    from ssr.costs import CostTable

    tok = tokenizer_for(name)
    reasoning, close, call = OUTPUTS[name][0].partition("</think>" if name != "harmony" else "<|end|>")
    backend = ScriptedBackend(tok, close)
    ends = ("<|call|>", "<|return|>") if name == "harmony" else ("<eos>",)
    backend.eos_token_ids = frozenset(tok.convert_tokens_to_ids(t) for t in ends)
    backend.eos = tok.convert_tokens_to_ids(ends[0])
    backend.set_script(reasoning, call.removesuffix(ends[0]))
    engine = SSREngine(backend, tok, config=SSRConfig(max_think_tokens=64, draft_start=2, max_tokens=200),
                       model_name="scripted", costs=CostTable.flat())
    assert engine.family is FAMILY[name]
    events = list(engine.stream(AGENT_TURN, tools=WEATHER))
    result = events[-1].result
    assert result.reasoning == "need weather." and result.content == "" and result.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in result.tool_calls] == [("get_weather", {"city": "paris"})]
    streamed = [e.tool_call for e in events if e.kind == "tool_call"]
    assert [(d.name, d.id) for d in streamed if d.name] == [("get_weather", result.tool_calls[0]["id"])]
    assert json.loads("".join(d.arguments for d in streamed)) == {"city": "paris"}
    plain = engine.generate(AGENT_TURN, tools=WEATHER, config=SSRConfig(enabled=False, max_think_tokens=64,
                                                                       max_tokens=200))
    assert plain.token_ids == result.token_ids and plain.tool_calls[0]["arguments"] == {"city": "paris"}
