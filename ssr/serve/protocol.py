"""The OpenAI-compatible request bodies as pydantic models, and the error every bad request gets.

Unknown top-level parameters are an error (400 naming them), never silently dropped. The fields OpenAI clients send
by default (``user``, ``logprobs: false``, ``parallel_tool_calls``, ``stream_options``, zero penalties, ...) are
accepted; a value asking for a feature this server lacks (``logprobs: true``, ``n: 2``, a non-zero penalty, ...)
is a 400 that says so (``unsupported``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Mapping, Sequence, Union, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ApiError(Exception):
    """An error answered in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             499: "client_closed_request", 503: "service_unavailable", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param, "unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- content -----------------------------------------------------------------------------------------------------

_TEXT_PARTS = ("text", "input_text", "output_text")


def content_text(content: str | list | None, where: str) -> str:
    """The text of message content: a string, or a list of text parts (joined). Media parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind in _TEXT_PARTS:
            raise bad_request(f"{where}[{i}]: a text part needs a string 'text'", f"{where}[{i}].text")
        elif kind is None:
            raise bad_request(f"{where}[{i}]: a content part must be an object with a 'type'", f"{where}[{i}]")
        else:
            raise bad_request(f"{where}[{i}]: this model reads text only; a {kind!r} content part cannot be sent",
                              f"{where}[{i}].type", "unsupported_content")
    return "".join(parts)


Content = Union[str, list[Union[str, dict[str, Any]]]]


# -- messages ----------------------------------------------------------------------------------------------------

class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI); an object is taken too


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # a reply sent back as it came: the chain of thought is not re-read
    reasoning: str | None = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _known(self) -> "AssistantMessage":
        if self.function_call is not None:
            raise ValueError("function_call (the deprecated functions API) is not supported: use tool_calls")
        if self.audio is not None:
            raise ValueError("audio is not supported: this model reads text only")
        return self


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


# -- tools -------------------------------------------------------------------------------------------------------

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.match(name):
            raise ValueError(f"tool name {name!r} must be 1-64 letters, digits, '_', '-', '.' or ':'")
        return name

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        if schema.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON schema of type 'object', got type {schema.get('type')!r}")
        if "properties" in schema and not isinstance(schema["properties"], dict):
            raise ValueError("parameters.properties must be an object mapping names to schemas")
        required = schema.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise ValueError("parameters.required must be a list of property names")
        return schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# -- response format ---------------------------------------------------------------------------------------------

class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: nothing to hide here


# -- requests ----------------------------------------------------------------------------------------------------

class _Sampling(_Strict):
    """What both endpoints take: the model, sampling, limits, streaming, and OpenAI's default-valued extras."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # an extension (vLLM's); 0 disables it
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generators take
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = None  # an extension (vLLM's name): the generated token ids under "ssr"
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: cached prompts shared only within a salt

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stop = [stop] if isinstance(stop, str) else stop
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop or None

    def check_common(self) -> None:
        """400 for a value of a feature this server does not implement."""
        if self.n not in (None, 1):
            raise unsupported("n", f"n={self.n} (one choice per request)")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise unsupported(name, f"a non-zero {name}")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; only {"enable_thinking": bool}
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI features this server lacks: accepted by name only to say so
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self.check_common()
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} (the deprecated functions API; use tools and tool_choice)")
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name, name)
        if self.logprobs:
            raise unsupported("logprobs", "logprobs: true")
        if self.top_logprobs not in (None, 0):
            raise unsupported("top_logprobs", "top_logprobs")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", f"modalities {self.modalities} (text only)")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens name one setting (the most tokens to generate); "
                              "give only one", "max_completion_tokens")
        kwargs = self.chat_template_kwargs or {}
        extra = sorted(set(kwargs) - {"enable_thinking"})
        if extra:
            raise unsupported("chat_template_kwargs", f"chat_template_kwargs {extra} (only enable_thinking)")
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise bad_request("chat_template_kwargs.enable_thinking must be true or false",
                              "chat_template_kwargs.enable_thinking")
        if self.tools:
            names = [t.function.name for t in self.tools]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise bad_request(f"tools: the tool name(s) {twice} are given more than once", "tools",
                                  "invalid_tool_schema")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice requires tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools \
                and self.tool_choice.function.name not in [t.function.name for t in self.tools]:
            raise bad_request(f"tool_choice names the tool {self.tool_choice.function.name!r}, which is not among "
                              f"the tools {[t.function.name for t in self.tools]}", "tool_choice")
        if self.response_format is not None and not isinstance(self.response_format, TextFormat) and self.tools \
                and self.tool_choice != "none":
            raise bad_request("response_format and tools cannot both shape one answer: give the schema as a tool "
                              "(tool_choice naming it), or leave the tools out", "response_format")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs")
        if self.echo:
            raise unsupported("echo", "echo: true")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text or token ids (a batch of several prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise unsupported("prompt", f"a batch of {len(p)} prompts (one prompt per request)")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt is empty", "prompt")
            return p
        if not p:
            raise bad_request("prompt is empty", "prompt")
        return list(cast("list[int]", p))  # token ids: a list of strings or of lists was unwrapped above


# -- validation errors -------------------------------------------------------------------------------------------

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_FORMATS = {"text", "json_object", "json_schema"}


def _location(loc: tuple) -> str:
    """A pydantic error location as a parameter path: ``messages[0].content``."""
    out = ""
    for i, part in enumerate(loc):
        if part == "body" and i == 0:
            continue
        prev = loc[i - 1] if i else None
        if isinstance(part, str) and ((prev == "messages" or isinstance(prev, int)) and part in _ROLES
                                      or prev == "response_format" and part in _FORMATS):
            continue  # the discriminator's tag (pydantic puts the chosen union member into the path)
        if isinstance(part, str) and (part.startswith(("function-", "list[", "str", "dict[", "json-or"))
                                      or part in ("NamedToolChoice", "literal['none','auto','required']")):
            continue  # a union member's name
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Pydantic's errors as one 400: unknown parameters by name, else the first problems with their paths."""
    unknown = [_location(tuple(e["loc"])) for e in errors if e["type"] == "extra_forbidden"]
    top = [u for u in unknown if "." not in u and "[" not in u]
    if top:
        return ApiError(400, f"unknown parameter(s) {top}: not part of this API", top[0], "unknown_parameter")
    if unknown:
        return ApiError(400, f"unknown field(s) {unknown}", unknown[0], "unknown_parameter")
    parts, param = [], None
    for e in errors[:3]:
        where = _location(tuple(e["loc"]))
        param = param or where or None
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            message = "required"
        elif e["type"] == "json_invalid":
            message = f"the body is not valid JSON ({e.get('ctx', {}).get('error', message)})"
        parts.append(f"{where}: {message}" if where else message)
    return ApiError(400, "; ".join(parts) or "invalid request", param, "invalid_value")


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` as ``model``, or the ApiError describing what is wrong with it."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
