"""LangChain's standard integration tests for ChatSSR, on the REAL embedded default model, in process, on the backend
a user of ChatSSR gets (``backend="auto"``: llama.cpp where llama-cpp-python is installed, as the README's install
does; transformers elsewhere).

The model is Qwen2.5-Coder-0.5B-Instruct on CPU, so every request runs with a short thinking budget and a short
answer budget, greedy. Tests that the 0.5B model cannot pass are marked xfail with the model's limit as the reason;
ChatSSR itself is exercised by every one of them.
"""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_ssr import ChatSSR
from langchain_tests.integration_tests import ChatModelIntegrationTests
from shared_fixtures import USERS_BACKEND

from ssr import SSRConfig

pytestmark = pytest.mark.real_model

CONFIG = SSRConfig(max_think_tokens=32, draft_start=8, max_tokens=112)


class TestChatSSRIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatSSR

    @property
    def chat_model_params(self) -> dict:
        return {"ssr_config": CONFIG, "temperature": 0, "backend": USERS_BACKEND}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["reasoning_output", "cache_read_input"], "stream": ["reasoning_output", "cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The second step of a conversation: its prompt's first turns are still in the KV cache."""
        llm = ChatSSR(**self.chat_model_params)
        question = HumanMessage("Is 17 a prime number? Answer yes or no.")
        messages = [question, llm.invoke([question]), HumanMessage("And 21?")]
        if not stream:
            return llm.invoke(messages)
        full = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full

    def invoke_with_reasoning_output(self, *, stream: bool = False) -> AIMessage:
        llm = ChatSSR(**self.chat_model_params)
        prompt = "Is 17 a prime number? Answer yes or no."
        if not stream:
            return llm.invoke(prompt)
        full = None
        for chunk in llm.stream(prompt):
            full = chunk if full is None else full + chunk
        return full

    # The base class's tool-calling tests (test_tool_calling[_async], test_bind_runnables_as_tools,
    # test_tool_calling_with_no_arguments) pass on the 0.5B model: with tool_choice "any" the call's opening is forced
    # and a tool-call demonstration replaces the coding one. (Overrides must carry an xfail: langchain-tests checks.)

    # The structured-output and tool_choice tests pass since the answer is grammar-constrained (ssr.grammar): a
    # forced call's arguments follow the tool's schema, so the 0.5B model can no longer answer a Joke call with {}.

    # -- what the 0.5B model cannot do (observed on CPU, greedy, 32-token thinking budget) ------------------------

    @pytest.mark.xfail(reason="the forced unicode_customer call does not close within the 112-token budget (48 go "
                              "to the thinking; the Japanese arguments take many tokens): finish_reason 'length'")
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @pytest.mark.xfail(reason="its TypedDict call (the last of three; the Pydantic and JSON-schema calls pass): the "
                              "0.5B model's greedy 'setup' string repeats itself ('Cats are often depicted as having "
                              "long, thick claws and ...') until the 112-token budget ends, finish_reason 'length' "
                              "(seen since exact mode's attention kernel changed its logits' last bits, 2026-12-06)")
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)


class AutoModeSuite(TestChatSSRIntegration):
    """The same suite with ``has_tool_choice`` off: its tool tests then bind tools without a tool_choice ("auto"),
    as agent frameworks do. Not collected as a class (no ``Test`` prefix); the tool tests run one by one below."""

    @property
    def has_tool_choice(self) -> bool:
        return False


AUTO_MODE_TESTS = ("test_tool_calling", "test_tool_calling_async", "test_tool_calling_with_no_arguments",
                   "test_bind_runnables_as_tools", "test_agent_loop")


@pytest.mark.parametrize("name", AUTO_MODE_TESTS)
async def test_standard_tool_test_in_auto_mode(name):
    suite = AutoModeSuite()
    model = suite.chat_model_class(**{**suite.standard_chat_model_params, **suite.chat_model_params})
    outcome = getattr(suite, name)(model)
    if hasattr(outcome, "__await__"):
        await outcome
