"""What the bound tools fix inside a tool call: proposals (SSR only) and the name guide (every decoding).

Inside ``<tool_call>`` the model writes ``{"name": "<tool>", "arguments": {...}}``. The wrapper, the rest of a tool
name once its prefix is unique, and a property name once its prefix is unique among that tool's properties are
fixed by the schemas; proposing them costs one verify pass, and the verifier still decides every token.

When a call is required, ``ToolNameGuide`` restricts the function name to the bound tools' names, as vLLM's
structured outputs do for ``tool_choice="required"``. It is part of the decoding rule, not a proposal: plain decoding
and SSR mask the same positions, so their outputs stay identical.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_NAME_SO_FAR = re.compile(r'<tool_call>\s*\{"name":\s*"([^"]*)$')
_AFTER_NAME = '", "arguments":'  # where a forced or guided name ends; the model's own ' {"' token follows
_KEY_SO_FAR = re.compile(r'<tool_call>\s*\{"name":\s*"([^"]+)",\s*"arguments":\s*\{(?:.*,\s*)?"([^"]*)$', re.DOTALL)


class SchemaProposer:
    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.properties = {t["function"]["name"]: list(((t["function"].get("parameters") or {})
                                                        .get("properties") or {}))
                           for t in tools}

    def propose(self, answer: str) -> str:
        """The text the schemas fix after ``answer`` (empty when nothing is fixed)."""
        open_at = answer.rfind("<tool_call>")
        if open_at < 0 or "</tool_call>" in answer[open_at:]:
            return ""
        call = answer[open_at:]
        if call.rstrip() == "<tool_call>":
            return ("\n" if call == "<tool_call>" else "") + '{"name": "'
        if m := _NAME_SO_FAR.search(call):
            return self._complete(m.group(1), list(self.properties), _AFTER_NAME)
        if (m := _KEY_SO_FAR.search(call)) and m.group(1) in self.properties:
            return self._complete(m.group(2), self.properties[m.group(1)], '": ')
        return ""

    @staticmethod
    def _complete(prefix: str, options: list[str], after: str) -> str:
        matches = [o for o in options if o.startswith(prefix)]
        return matches[0][len(prefix):] + after if len(matches) == 1 else ""


class ToolNameGuide:
    """Masks every token that cannot continue a bound tool's name (and the ``", "arguments":`` after it)."""

    def __init__(self, opening: str, names: list[str], token_ids_by_text: dict[str, list[int]]) -> None:
        self.opening = opening  # the forced start of a required call, up to the name's opening quote
        self.targets = [name + _AFTER_NAME for name in names]
        self.ids_by_text = token_ids_by_text

    def allowed(self, answer: str) -> list[int] | None:
        """Token ids that may come next after ``answer``; None where the guide does not apply."""
        at = answer.rfind(self.opening)
        if at < 0:
            return None
        written = answer[at + len(self.opening):]
        rests = {t[len(written):] for t in self.targets if t.startswith(written) and len(t) > len(written)}
        ids = {i for rest in rests for k in range(1, len(rest) + 1) for i in self.ids_by_text.get(rest[:k], ())}
        return sorted(ids) or None

    def mask(self, logits: torch.Tensor, answer: str) -> torch.Tensor:
        """``logits`` (one row) with the disallowed tokens at -inf; unchanged where the guide does not apply or where
        no allowed token has a score (a backend that returns only its top-k scores)."""
        ids = self.allowed(answer)
        if ids is None:
            return logits
        keep = torch.full_like(logits, float("-inf"))
        keep[ids] = logits[ids]
        return keep if torch.isfinite(keep).any() else logits


def token_ids_by_text(tokenizer) -> dict[str, list[int]]:
    """Every token's text -> the ids that decode to it (built once per engine; ~2 s for a 150k vocabulary)."""
    out: dict[str, list[int]] = {}
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
        if text:
            out.setdefault(text, []).append(i)
    return out
