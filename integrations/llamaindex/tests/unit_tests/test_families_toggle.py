"""``SSR(thinking=...)`` maps to each reasoning family's own thinking toggle (R1's open block, Qwen3's
``enable_thinking``, harmony's channels), on tiny engines whose family comes from their chat template."""

from __future__ import annotations

import pytest
from llama_index.core.llms import ChatMessage

from llama_index.llms.ssr import SSR
from tiny import QWEN3_TEMPLATE, R1_TEMPLATE, family_engine


@pytest.mark.parametrize("template", [R1_TEMPLATE, QWEN3_TEMPLATE, None], ids=["deepseek-r1", "qwen3", "harmony"])
def test_thinking_flag_is_the_family_toggle(template):
    engine = family_engine(template, max_think_tokens=4, max_tokens=10, draft_start=1)
    prompts = {flag: engine.encode([{"role": "user", "content": "abc"}], thinking=flag) for flag in (True, False)}
    assert prompts[True] != prompts[False]  # the family renders the two ways differently
    for flag in (True, False):
        llm = SSR(engine=engine, thinking=flag)
        response = llm.chat([ChatMessage(role="user", content="abc")])
        assert response.raw["usage"]["prompt_tokens"] == len(prompts[flag])
        assert (response.additional_kwargs["ssr"]["think_closed_by"] == "none") is (not flag)
