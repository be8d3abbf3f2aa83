"""What the bound tools fix inside a tool call: proposals for SSR to verify.

Inside ``<tool_call>`` the model writes ``{"name": "<tool>", "arguments": {...}}``. The wrapper, the rest of a tool
name once its prefix is unique, and a property name once its prefix is unique among that tool's properties are
fixed by the schemas; proposing them costs one verify pass, and the verifier still decides every token.

What the model may write there (the bound tools' names, arguments that follow their schemas) is the grammar's job
(``ssr.grammar``), part of the decoding rule for plain decoding and SSR alike.
"""

from __future__ import annotations

import re
from typing import Any

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
