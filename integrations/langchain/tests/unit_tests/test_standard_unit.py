"""LangChain's standard unit tests for ChatSSR (no model is loaded: constructing ChatSSR is cheap)."""

from __future__ import annotations

from typing import Any

import pytest
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

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {"SSR_API_KEY": "sk-from-env"}, {}, {"api_key": "sk-from-env"}

    @pytest.mark.xfail(reason="the standard test compares with a syrupy snapshot (none is kept: it would pin the "
                              "langchain-core version that the serialised metadata carries) and then loads with "
                              "allowed_objects='all', which in langchain-core 1.8 admits only the classes in core's "
                              "own mapping; ChatSSR's dumpd/load round trip (allowed_objects=[ChatSSR]) is tested "
                              "in test_tokens_profile_settings.py")
    def test_serdes(self, model: BaseChatModel, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)
