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

from dataclasses import dataclass

import torch

from ssr import SSREngine
from ssr.backends.base import Backend, Lane
from ssr.costs import CostTable


@dataclass
class _Lane(Lane):
    prompt_len: int | None = None  # None: learnt from its first feed, the prompt


class ScriptedBackend(Backend):
    def __init__(self, tokenizer, close_text: str, model_name: str = "scripted", reuse_prefix: bool = False) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = len(tokenizer)
        self.context_window = 32768
        self.eos_token_ids = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
        self.eos = min(self.eos_token_ids)
        self.close_text = close_text
        self.script = ""  # reasoning + close text + answer
        self.answer = ""
        self.prompts: list[list[int]] = []  # every prompt prefilled (for assertions on what the adapter sent)
        self.reuse_prefix = reuse_prefix
        # an agent loop's script, (reasoning, answer) per turn: each request takes the entry of its turn, the number
        # of assistant turns its prompt holds after the user's last message (tool results aside; a demonstration's
        # turns come before it), and thinks where the prompt opened a think block (a step after a tool result);
        # None: ``set_script``'s one script for every request
        self.turns: list[tuple[str, str]] | None = None

    def set_script(self, reasoning: str, answer: str, thinking: bool = True) -> None:
        """``thinking=False``: the script is the answer alone (a request made with ``thinking=False``)."""
        self.answer = answer
        self.script = reasoning + self.close_text + answer if thinking else answer

    def _take_turn(self, prompt: list[int]) -> None:
        if self.turns is None:
            return
        text = self.tokenizer.decode(prompt)
        user = max(i for i in range(len(text)) if text.startswith("<|im_start|>user\n", i)
                   and not text.startswith("<tool_response>", i + len("<|im_start|>user\n")))
        turn = text.count("<|im_start|>assistant", user) - 1
        reasoning, answer = self.turns[min(turn, len(self.turns) - 1)]
        self.set_script(reasoning, answer, thinking=text.endswith("<think>\n"))

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

    # -- the lane protocol (the bookkeeping is ``Backend``'s) --------------------------------------------------------
    def new_lane(self, prefix: list[int] | None = None, salt: str | None = None) -> int:
        """A new request's lane: empty, or (``reuse_prefix``) the parked lane of the last request cut to the
        longest prefix it shares with ``prefix``, the new prompt."""
        prompt_len = None
        if prefix is not None and self.reuse_prefix:
            prompt_len = len(prefix)
            self.prompts.append(list(prefix))
            self._take_turn(prefix)
        lane = super().new_lane(prefix, salt)
        self.lanes[lane].prompt_len = prompt_len
        return lane

    def _open(self, parent: _Lane | None) -> _Lane:
        return _Lane(prompt_len=None if parent is None else parent.prompt_len)

    def _keep_parked(self) -> bool:
        return self.reuse_prefix

    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        self.lanes.check(feeds)
        out = {}
        for lane, feed in feeds.items():
            state = self.lanes[lane]
            if state.prompt_len is None:
                state.prompt_len = len(feed)
                self.prompts.append(list(feed))
                self._take_turn(feed)
            state.tokens.extend(feed)
            seq = state.tokens
            k = (want or {}).get(lane, len(feed))
            logits = torch.full((k, self.vocab_size), -30.0)
            for row, end in enumerate(range(len(seq) - k + 1, len(seq) + 1)):
                logits[row, self._next_token(seq[:end], state.prompt_len)] = 30.0
            out[lane] = logits
        return out


def scripted_engine(tokenizer, config=None, reuse_prefix: bool = False) -> SSREngine:
    """An SSREngine whose backend replays ``engine.backend.set_script(reasoning, answer)``. It keeps no history of
    earlier outputs (``ssr.history``): the same request twice gives the same stats, as the adapters' tests compare."""
    from ssr.chat import detect_family

    family = detect_family(tokenizer, None)
    backend = ScriptedBackend(tokenizer, family.close_text, reuse_prefix=reuse_prefix)
    # a scripted backend has no costs to measure: price every step alike, so every proposal and draft is taken
    return SSREngine(backend, tokenizer, config=config, family=family, model_name="scripted", costs=CostTable.flat(),
                     history_tokens=0)
