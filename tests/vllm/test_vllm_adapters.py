"""Both framework adapters over the in-process vLLM backend, unchanged: the same tokens as the engine itself."""

from __future__ import annotations

import pytest
from tiny_model import vllm_installed

if not vllm_installed():  # tests/vllm itself would import as a namespace package "vllm": look for the real one
    pytest.skip("vllm is not installed (install it into a separate venv: .ci/install_vllm.sh)", allow_module_level=True)
langchain_ssr = pytest.importorskip("langchain_ssr")
llama_ssr = pytest.importorskip("llama_index.llms.ssr")

from ssr import SSRConfig  # noqa: E402

pytestmark = pytest.mark.vllm

CFG = SSRConfig(max_think_tokens=24, draft_start=4, max_tokens=64)
QUESTION = "Write a function that adds two numbers."


@pytest.fixture(scope="module")
def direct(vllm_engine):
    return vllm_engine.generate(QUESTION, config=CFG)


def test_langchain_chat_model_on_vllm(vllm_engine, direct):
    llm = langchain_ssr.ChatSSR(engine=vllm_engine, ssr_config=CFG)
    message = llm.invoke(QUESTION)
    assert message.response_metadata["token_ids"] == direct.token_ids
    assert message.content == direct.answer
    assert message.additional_kwargs.get("reasoning_content", "") == direct.reasoning
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == direct.answer


async def test_llamaindex_llm_on_vllm(vllm_engine, direct):
    from llama_index.core.llms import ChatMessage

    llm = llama_ssr.SSR(engine=vllm_engine, ssr_config=CFG)
    response = await llm.achat([ChatMessage(role="user", content=QUESTION)])
    assert response.message.content == direct.answer
    assert response.additional_kwargs["ssr"]["answer_tokens"] == direct.stats["answer_tokens"]
