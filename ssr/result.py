"""What a generation returns: the text split into reasoning and answer, the exact token ids, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationResult:
    """One finished request.

    ``token_ids`` holds every token generated after the prompt (reasoning, forced text and answer), exactly as
    decoded; ``stats`` is a plain dict (see ``ssr.stats``) that adapters pass on unchanged.
    """

    reasoning: str
    answer: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_tokens) or "tool_calls"
    stats: dict[str, Any]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments": dict}
    # {"id", "name", "args": str, "error"}, and "arguments" where the call is well formed (``ssr.chat.ToolCallParse``)
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None  # the answer with tool-call markup removed (equals ``answer`` without tools)
    # on a backend whose rows depend on the batch (llama.cpp's multi-row kernels), greedy: the positions in
    # ``token_ids`` where other tokens' logits were within twice the measured kernel noise of the chosen one's ->
    # [(token, margin), ...]; where SSR and plain decoding differ, they differ first at such a position, SSR taking
    # one of those tokens (``ssr.agreement``)
    near_ties: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt as decoded (template and recipe applied)

    @property
    def reasoning_tokens(self) -> int:
        return self.stats["think_tokens"]

    @property
    def executable_tool_calls(self) -> list[dict[str, Any]]:
        """What an agent framework's tool executor gets: the valid calls, then the well-formed ones that name an
        unknown tool or miss its schema. As with any provider, the executor rejects those with an error the model
        reads on its next turn (LangChain's ToolNode, LlamaIndex's agents), so the loop goes on."""
        return self.tool_calls + [{k: c[k] for k in ("id", "name", "arguments")}
                                  for c in self.invalid_tool_calls if "arguments" in c]

    @property
    def unparsed_tool_calls(self) -> list[dict[str, Any]]:
        """The invalid calls that did not parse (malformed JSON, not an object): no executor can run them."""
        return [c for c in self.invalid_tool_calls if "arguments" not in c]

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamEvent:
    """A piece of a streamed generation.

    ``kind`` is "reasoning" or "answer" for text deltas that are final (verified); with tools bound, "answer" is
    the content outside tool calls and "tool_call" carries a ``ToolCallDelta`` (a call's id and name, then fragments
    of its arguments' JSON) as soon as it is final. "done" is the last event and carries the full ``result``, whose
    tool calls keep the streamed ids.
    """

    kind: str
    text: str = ""
    result: GenerationResult | None = None
    tool_call: Any = None  # ssr.toolstream.ToolCallDelta for kind "tool_call"
