"""LangChain's standard integration tests for ChatSSR, on the REAL embedded default model, in process.

The model is Qwen2.5-Coder-0.5B-Instruct on CPU (about 10 tokens/s on 2 cores), so every request runs with a short
thinking budget and a short answer budget, greedy. Tests that the 0.5B model cannot pass are marked xfail with the
model's limit as the reason; ChatSSR itself is exercised by every one of them.
"""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_ssr import ChatSSR
from ssr import SSRConfig

pytestmark = pytest.mark.real_model

CONFIG = SSRConfig(max_think_tokens=32, draft_start=8, max_tokens=112)


class TestChatSSRIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatSSR

    @property
    def chat_model_params(self) -> dict:
        return {"ssr_config": CONFIG, "temperature": 0}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["reasoning_output"], "stream": ["reasoning_output"]}

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

    # -- what the 0.5B model cannot do (observed on CPU, greedy, 32-token thinking budget) ------------------------
    # The call's opening is forced, so these fail on the arguments the model writes, not on the format.

    @pytest.mark.xfail(reason="for a bare 'Hello!' with a call required, Qwen2.5-Coder-0.5B writes no valid call to a "
                              "bound tool")
    def test_tool_choice(self, model: BaseChatModel) -> None:
        super().test_tool_choice(model)

    @pytest.mark.xfail(reason="in the forced Joke call (function-calling structured output) Qwen2.5-Coder-0.5B "
                              "reasons that the tool takes no parameters and writes {}: an invalid call (the "
                              "typeddict variant passes since the one tool's name is forced)")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason="in the forced Joke call (function-calling structured output) Qwen2.5-Coder-0.5B "
                              "reasons that the tool takes no parameters and writes {}: an invalid call (the "
                              "typeddict variant passes since the one tool's name is forced)")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason="in the forced Joke call (function-calling structured output) Qwen2.5-Coder-0.5B "
                              "reasons that the tool takes no parameters and writes {}: an invalid call")
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason="in the forced Joke call (function-calling structured output) Qwen2.5-Coder-0.5B "
                              "reasons that the tool takes no parameters and writes {}: an invalid call")
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B's arguments for the forced unicode_customer call are not a "
                              "valid call")
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
