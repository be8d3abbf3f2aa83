"""A real ``SSREngine`` over a scripted backend, for testing the LangChain adapter without loading a model.

The backend implements the engine's lane protocol (``ssr.backends.base.Backend``) with the real tokenizer of the
default model, but its "model" always predicts a fixed continuation: the given chain of thought, the family's
close text, the given answer, then end-of-sequence. Draft lanes (forked mid-thought, close text appended) predict
the same answer, so drafting, verification, suffix proposals, streaming and tool-call parsing all run for real and
the text that comes out is known in advance.

With ``reuse_prefix=True`` the backend keeps the last request's lane, as the transformers backend does, so the next
request of a conversation starts from the longest common prefix (``stats["reused_prompt_tokens"]``).
"""

from __future__ import annotations

import torch

from ssr import SSREngine
from ssr.costs import CostTable


class ScriptedBackend:
    def __init__(self, tokenizer, close_text: str, model_name: str = "scripted", reuse_prefix: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = len(tokenizer)
        self.context_window = 32768
        self.eos_token_ids = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
        self.eos = min(self.eos_token_ids)
        self.close_text = close_text
        self.script = ""  # reasoning + close text + answer
        self.answer = ""
        self._prompt_len: dict[int, int | None] = {}  # per lane; None: learnt from its first feed, the prompt
        self.prompts: list[list[int]] = []  # every prompt prefilled (for assertions on what the adapter sent)
        self._lanes: dict[int, list[int]] = {}
        self._next = 0
        self.reuse_prefix = reuse_prefix
        self._parked: int | None = None

    def set_script(self, reasoning: str, answer: str, thinking: bool = True) -> None:
        """``thinking=False``: the script is the answer alone (a request made with ``thinking=False``)."""
        self.answer = answer
        self.script = reasoning + self.close_text + answer if thinking else answer

    # -- the "model" -----------------------------------------------------------------------------------------------
    def _next_token(self, seq: list[int], prompt_len: int) -> int:
        """The first token of the script's text after what this lane holds (by text, so that text the engine forces,
        such as a required tool call's opening, is followed like any other); a draft lane, whose text left the script
        at its close, continues with the answer after the close text."""
        text = self.tokenizer.decode(seq[prompt_len:])
        rest = None
        at = text.rfind(self.close_text)
        after = text[at + len(self.close_text):]
        if self.script.startswith(text):
            rest = self.script[len(text):]
        elif at >= 0 and self.answer.startswith(after):
            rest = self.answer[len(after):]
        if not rest:
            return self.eos
        return self.tokenizer.encode(rest, add_special_tokens=False)[0]

    # -- the lane protocol -----------------------------------------------------------------------------------------
    def new_lane(self, prefix: list[int] | None = None) -> int:
        """A new request's lane: empty, or (``reuse_prefix``) the parked lane of the last request cut to the
        longest prefix it shares with ``prefix``, the new prompt."""
        prompt_len = None
        if prefix is not None and self.reuse_prefix:
            prompt_len = len(prefix)
            self.prompts.append(list(prefix))
        parked, self._parked = self._parked, None
        if parked is not None:
            held = self._lanes[parked]
            common = 0
            while common < min(len(held), len(prefix or [])) and held[common] == prefix[common]:
                common += 1
            if common:
                del held[common:]
                self._prompt_len[parked] = prompt_len
                return parked
            self.release(parked)
        return self._add([], prompt_len)

    def park(self, lane: int) -> None:
        if self._parked is not None and self._parked != lane:
            self.release(self._parked)
        if self.reuse_prefix:
            self._parked = lane
        else:
            self.release(lane)

    def fork(self, parent: int) -> int:
        return self._add(list(self._lanes[parent]), self._prompt_len[parent])

    def _add(self, tokens: list[int], prompt_len: int | None) -> int:
        self._next += 1
        self._lanes[self._next], self._prompt_len[self._next] = tokens, prompt_len
        return self._next

    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        out = {}
        for lane, feed in feeds.items():
            seq = self._lanes[lane]
            if self._prompt_len[lane] is None:
                self._prompt_len[lane] = len(feed)
                self.prompts.append(list(feed))
            seq.extend(feed)
            k = (want or {}).get(lane, len(feed))
            logits = torch.full((k, self.vocab_size), -30.0)
            for row, end in enumerate(range(len(seq) - k + 1, len(seq) + 1)):
                logits[row, self._next_token(seq[:end], self._prompt_len[lane])] = 30.0
            out[lane] = logits
        return out

    def truncate(self, lane: int, length: int) -> None:
        del self._lanes[lane][length:]

    def length(self, lane: int) -> int:
        return len(self._lanes[lane])

    def release(self, lane: int) -> None:
        self._lanes.pop(lane, None)
        self._prompt_len.pop(lane, None)
        if lane == self._parked:
            self._parked = None

    def release_all(self) -> None:
        self._lanes.clear()
        self._prompt_len.clear()
        self._parked = None

    @property
    def live_lanes(self) -> int:
        return len(self._lanes)


def scripted_engine(tokenizer, config=None, reuse_prefix: bool = False) -> SSREngine:
    """An SSREngine whose backend replays ``engine.backend.set_script(reasoning, answer)``."""
    from ssr.chat import detect_family

    family = detect_family(tokenizer, None)
    backend = ScriptedBackend(tokenizer, family.close_text, reuse_prefix=reuse_prefix)
    # a scripted backend has no costs to measure: price every step alike, so every proposal and draft is taken
    return SSREngine(backend, tokenizer, config=config, family=family, model_name="scripted", costs=CostTable.flat())
