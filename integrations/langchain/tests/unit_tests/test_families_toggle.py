"""``ChatSSR(reasoning=...)`` maps to each reasoning family's own thinking toggle (R1's open block, Qwen3's
``enable_thinking``, harmony's channels), on tiny engines whose family comes from their chat template."""

from __future__ import annotations

import pytest

from langchain_core.messages import HumanMessage

from langchain_ssr import ChatSSR
from tiny import QWEN3_TEMPLATE, R1_TEMPLATE, family_engine


@pytest.mark.parametrize("template", [R1_TEMPLATE, QWEN3_TEMPLATE, None], ids=["deepseek-r1", "qwen3", "harmony"])
def test_reasoning_flag_is_the_family_toggle(template):
    engine = family_engine(template, max_think_tokens=4, max_tokens=10, draft_start=1)
    user = [{"role": "user", "content": "abc"}]
    prompts = {flag: engine.encode(user, thinking=flag) for flag in (True, False)}
    assert prompts[True] != prompts[False]  # the family renders the two ways differently
    for flag in (True, False):
        llm = ChatSSR(engine=engine, reasoning=flag)
        message = llm.invoke("abc")
        assert message.usage_metadata["input_tokens"] == len(prompts[flag]) == llm.get_num_tokens_from_messages(
            [HumanMessage("abc")])
        stats = message.response_metadata["ssr"]
        assert (stats["think_closed_by"] == "none") is (not flag)
        assert (message.usage_metadata["output_token_details"]["reasoning"] > 0) is flag
