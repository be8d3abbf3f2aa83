"""LangChain's standard unit tests for ChatSSR (no model is loaded: constructing ChatSSR is cheap)."""

from __future__ import annotations

from langchain_core.language_models import BaseChatModel
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_ssr import ChatSSR
from ssr import SSRConfig


class TestChatSSRUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatSSR

    @property
    def chat_model_params(self) -> dict:
        return {"ssr_config": SSRConfig(max_think_tokens=32, draft_start=8)}
