"""Per-family chat settings, prompt rendering, reasoning split and tool-call parsing, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from . import harmony
from .toolcalls import ToolCallParse as ToolCallParse
from .toolcalls import call_id as call_id
from .toolcalls import check_arguments as check_arguments
from .toolcalls import parse_tool_calls as parse_tool_calls
from .toolcalls import prompt_seed as prompt_seed

Prompt = str | list[dict[str, Any]] | list[int]  # text, chat messages, or token ids

THINK_INSTRUCTION = (
    "You are a careful assistant that reasons before answering. First think step by step inside "
    "<think> ... </think>; then, after </think>, write only the final answer."
)

# One short exchange that shows the format; instruct models that are not trained to think need it to close </think>.
DEMONSTRATION = [
    {"role": "user", "content": "Write a Python function that returns the largest of three numbers."},
    {"role": "assistant", "content": (
        "<think>\nThe user wants the maximum of three values. Python's built-in max already handles this, "
        "so the function can simply return max(a, b, c). A short docstring helps.\n</think>\n\n"
        "```python\ndef largest(a, b, c):\n    \"\"\"Return the largest of a, b and c.\"\"\"\n"
        "    return max(a, b, c)\n```"
    )},
]

# When a tool call is required, a tool-call exchange instead: after the coding exchange a small model copies the
# tools' JSON schemas into its forced call; after this one it fills in arguments (measured on BFCL items with the
# default model). With tool_choice "auto" the coding exchange stays: there this one makes the 0.5B model call the
# demonstration's own tool.
TOOL_DEMONSTRATION = [
    {"role": "user", "content": "Convert 20 euros to US dollars. (Tool: convert(amount: number, to: string))"},
    {"role": "assistant", "content": (
        "<think>\nThe user wants 20 euros in US dollars. The convert tool takes the amount and the target currency, "
        "so I call it with amount 20 and to \"USD\".\n</think>\n\n"
        "<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"amount\": 20, \"to\": \"USD\"}}\n</tool_call>"
    )},
]

# After a tool result (tools bound, the tool's message last): two exchanges right after the template's own system
# block (no recipe system prompt: the prompt extends the decision turn's, whose cache the step reuses). The first
# answers from a result, with a tool unlike the bound ones: with it alone the 0.5B and 1.5B models answered from the
# result on weather, time, flight and stock questions. The second reads a file, thinks the change through with the
# whole new text written out, then writes it with a call in the fenced form the model itself uses for its first
# call, and answers when done: with the first alone, a coding agent's step after reading a file wrote it back
# unchanged or answered with the fix instead of calling (the 1.5B solved 3 of the agent suite's 12 tasks; 8 with
# both; docs/log.md, "An edit demonstration after tool results (2026-12-07, morning)").
_CART = 'def total(items):\n    """Return the sum of price times quantity over (price, quantity) pairs."""\n'
_CART_FIXED = _CART + "    return sum(price * qty for price, qty in items)\n"
TOOL_RESULT_DEMONSTRATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Convert 20 euros to US dollars."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_demo", "type": "function", "function": {
        "name": "convert", "arguments": {"amount": 20, "to": "USD"}}}]},
    {"role": "tool", "tool_call_id": "call_demo", "name": "convert", "content": "21.60 USD"},
    {"role": "assistant", "content": (
        "<think>\nThe convert tool returned 21.60 USD for 20 euros. That answers the question, so I reply in one "
        "sentence and call no more tools.\n</think>\n\n20 euros is 21.60 US dollars.")},
    {"role": "user", "content": "The function total in cart.py ignores the quantities, so the tests fail."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_demo_1", "type": "function", "function": {
        "name": "read_file", "arguments": {"path": "cart.py"}}}]},
    {"role": "tool", "tool_call_id": "call_demo_1", "name": "read_file",
     "content": _CART + "    return sum(price for price, qty in items)\n"},
    {"role": "assistant", "content": (
        "<think>\nThe docstring says price times quantity, but the line `return sum(price for price, qty in items)` "
        "adds the prices alone: it must read `return sum(price * qty for price, qty in items)`. The corrected file:\n"
        f"```python\n{_CART_FIXED}```\nThe task is not done yet: I call write_file with the whole corrected file.\n"
        "</think>\n\n```json\n"
        + json.dumps({"name": "write_file", "arguments": {"path": "cart.py", "content": _CART_FIXED}}) + "\n```")},
    {"role": "tool", "tool_call_id": "call_demo_2", "name": "write_file", "content": "saved cart.py"},
    {"role": "assistant", "content": (
        "<think>\nThe write_file tool saved cart.py. That finishes the task, so I reply in one sentence and call no "
        "more tools.\n</think>\n\ncart.py now multiplies each price by its quantity.")},
]


@dataclass(frozen=True)
class ChatFamily:
    """How one model family thinks, closes its thinking, and calls tools."""

    name: str
    think_open: str = "<think>"
    think_close: str = "</think>"
    close_text: str = "\n</think>\n\n"  # appended by drafts and by budget forcing
    continue_text: str = "\nWait,"  # replaces an early close when min_think_tokens is set (s1 budget forcing)
    think_prefill: str = "<think>\n"  # appended after the generation prompt so the model starts thinking
    system_prompt: str | None = None  # for instruct models that are not trained to think
    demonstration: tuple[dict[str, str], ...] = ()
    tool_demonstration: tuple[dict[str, str], ...] = ()  # used instead of ``demonstration`` when a call is required
    tool_result_demonstration: tuple[dict[str, Any], ...] = ()  # instead, when tools are bound and a result is last
    tool_call_open: str = "<tool_call>"
    tool_call_close: str = "</tool_call>"
    thinking_switch: str | None = None  # the template's own toggle (Qwen3's ``enable_thinking``), given ``thinking``
    answer_prefill: str = ""  # appended after the generation prompt without thinking (closes a block it opened)
    harmony: bool = False  # gpt-oss channels instead of think tags: rendered and parsed by ``ssr.harmony``


QWEN2_INSTRUCT = ChatFamily(name="qwen2-instruct", system_prompt=THINK_INSTRUCTION,
                            demonstration=tuple(DEMONSTRATION), tool_demonstration=tuple(TOOL_DEMONSTRATION),
                            tool_result_demonstration=tuple(TOOL_RESULT_DEMONSTRATION))
REASONING = ChatFamily(name="reasoning")  # other models trained to think in <think> ... </think>
# DeepSeek-R1 distills (and Qwen3 thinking-only models): the generation prompt already opens "<think>\n", so
# nothing is prefilled; without thinking an empty block is closed at once, and the model answers
DEEPSEEK_R1 = ChatFamily(name="deepseek-r1", think_prefill="", answer_prefill="</think>\n\n")
# Qwen3 hybrids: ``enable_thinking=False`` makes the template write an empty think block itself
QWEN3 = ChatFamily(name="qwen3", thinking_switch="enable_thinking")
# gpt-oss: reasoning in the analysis channel; the close switches to the final channel, whose message ends at
# <|return|> (a tool call: a commentary message, ended by <|call|>); without thinking the final channel opens at once
HARMONY = ChatFamily(name="harmony", think_open=harmony.ANALYSIS, think_close=harmony.END, close_text=harmony.CLOSE,
                     think_prefill=harmony.ANALYSIS, answer_prefill=harmony.FINAL, harmony=True)
FAMILIES = {f.name: f for f in (QWEN2_INSTRUCT, REASONING, DEEPSEEK_R1, QWEN3, HARMONY)}


def detect_family(tokenizer, model_type: str | None) -> ChatFamily:
    """The family from the chat template: harmony channels, Qwen3's ``enable_thinking`` switch, a generation
    prompt that already opens ``<think>`` (R1 distills), any other ``<think>`` template; else the instruct recipe."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if model_type == "gpt_oss" or ("<|channel|>" in template and "<|start|>" in template):
        return HARMONY
    if "enable_thinking" in template:
        return QWEN3
    if "<think>" in template:
        return DEEPSEEK_R1 if _prompt_opens_think(tokenizer) else REASONING
    return QWEN2_INSTRUCT


def _prompt_opens_think(tokenizer) -> bool:
    """Whether the template's generation prompt ends inside an open think block (rendered, not searched for)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that needs more than one user turn: treat it as not opening
        return False
    return text.rstrip().endswith("<think>")


def render_prompt(tokenizer, family: ChatFamily, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None, call_required: bool = False,
                  thinking: bool = True) -> str:
    """The chat template applied to the family's thinking setup, the conversation and the tools. Without thinking,
    the model's own template alone (its thinking switch off, a block it opens closed): the bare model, as it
    answers without SSR's recipe. Harmony models are rendered by openai-harmony, not by their template."""
    messages = [_normalise(m) for m in messages]
    if family.harmony:
        if call_required:
            raise ValueError("a required tool call is not supported for harmony (gpt-oss) models yet: "
                             "use tool_choice='auto'")
        return harmony.render(messages, tools) + (family.think_prefill if thinking else family.answer_prefill)
    switch = {family.thinking_switch: thinking} if family.thinking_switch else {}
    if not thinking:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True, **switch)
        return text + family.answer_prefill
    if family.system_prompt:
        after_result = bool(tools) and not call_required and messages[-1]["role"] == "tool"
        if after_result and family.tool_result_demonstration:
            # append-only: the system block stays the one the decision turns had (the template's own, with the
            # tools), so an agent's step after a tool call reuses that much of its cache; the demonstration alone
            # makes the model think and answer from the result
            demonstration = family.tool_result_demonstration
        else:
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{family.system_prompt}\n\n{messages[0]['content']}"}
            else:
                messages.insert(0, {"role": "system", "content": family.system_prompt})
            demonstration = family.tool_demonstration if tools and call_required else family.demonstration
        at = 1 if messages[0]["role"] == "system" else 0
        messages[at:at] = [dict(m) for m in demonstration]
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **switch)
    return text + family.think_prefill


def encode_prompt(tokenizer, family: ChatFamily, prompt: "Prompt", tools: list[dict[str, Any]] | None = None,
                  tool_choice: str | None = None, context_window: int | None = None,
                  thinking: bool | None = None) -> list[int]:
    """Prompt token ids, exactly as the engine decodes them, from the tokenizer alone (token counting needs no
    weights): text becomes one user message; messages go through the chat template; ids pass as they are.
    ``thinking=None`` lets ``resolve_thinking`` decide, as the engine does."""
    thinking = resolve_thinking(family, prompt, tools, tool_choice, thinking)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt is empty: give text, a non-empty list of chat messages, or token ids")
    if all(isinstance(t, int) for t in prompt):
        ids = list(cast("list[int]", prompt))  # token ids, as just checked
    elif all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in cast("list[dict[str, Any]]", prompt)]  # chat messages, as just checked
        extra = tool_instruction(tool_choice, tools)
        if extra:
            last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
            if last_user is not None:
                messages[last_user]["content"] = f"{messages[last_user].get('content') or ''}\n\n{extra}"
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"prompt[{i}]: unknown chat role {m.get('role')!r}: use system, user, assistant or "
                                 "tool")
        tools_for_template = None if tool_choice == "none" else tools
        text = render_prompt(tokenizer, family, messages, tools_for_template,
                             call_required=bool(tool_call_opening(family, tool_choice, tools)), thinking=thinking)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        raise ValueError("prompt must be text, a list of chat-message dicts, or a list of token ids")
    if context_window is not None and len(ids) >= context_window:
        raise ValueError(f"prompt is {len(ids)} tokens, over the model's context window of "
                         f"{context_window} tokens (leave room for the answer)")
    return ids


def _normalise(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as dicts (what HF templates expect); content never None."""
    out = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = call.get("function", call)
            args = fn.get("arguments", fn.get("args", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out


def tool_instruction(tool_choice: str | None, tools: list[dict[str, Any]] | None) -> str | None:
    """Text appended to the last user turn to enforce ``tool_choice`` (the model still decides the arguments)."""
    if not tools or tool_choice in (None, "auto"):
        return None
    if tool_choice == "none":
        return "Do not call any tool; answer directly."
    if tool_choice in ("any", "required"):  # even with one tool: naming it makes the 0.5B model copy its schema
        return "You must answer with a tool call."
    return f"You must answer with a call to the tool `{tool_choice}`."


def tool_call_opening(family: ChatFamily, tool_choice: str | None, tools: list[dict[str, Any]] | None) -> str:
    """The answer's forced start when ``tool_choice`` demands a call: the call wrapper, plus the tool's name when only
    one tool can be called. Plain decoding and SSR force the same text, so the model still writes everything after
    it. The forced text ends on a token boundary of the model's own spelling (``"arguments":``, then the model writes
    `` {"``), so that the model is not pushed off its usual tokens."""
    if not tools or tool_choice in (None, "auto", "none"):
        return ""
    opening = f'{family.tool_call_open}\n{{"name": "'
    if tool_choice in ("any", "required"):
        if len(tools) > 1:
            return opening  # the name is the model's, kept to the bound tools by the call grammar
        tool_choice = tools[0]["function"]["name"]
    return f'{opening}{tool_choice}", "arguments":'


def resolve_thinking(family: ChatFamily, prompt: "Prompt", tools: list[dict[str, Any]] | None,
                     tool_choice: str | None, thinking: bool | None) -> bool:
    """Whether this turn thinks. An explicit ``thinking`` wins. Models trained to think always do. An instruct model
    (a family that needs SSR's thinking recipe) skips thinking where the recipe costs it its tool use: with tools
    bound under "auto" and the user's message last, it decides to call or answer under its own chat template. Once a
    tool result is in, it thinks, then answers. Both halves are measured (docs/bench/auto-tools): thinking before
    the decision, the 0.5B default model called the right tool on 4 of 12 BFCL items at best against 9 of 12 without;
    without thinking after a tool result, it called the tools again and again and never answered."""
    if thinking is not None:
        return thinking
    if family.system_prompt is None or not tools or tool_choice not in (None, "auto"):
        return True
    if isinstance(prompt, str):
        return False
    last = prompt[-1] if isinstance(prompt, list) and prompt else None
    return not (isinstance(last, dict) and last.get("role") == "user")


# -- tool-call parsing --------------------------------------------------------------------------------------------

