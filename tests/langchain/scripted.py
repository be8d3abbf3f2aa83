"""A real ``SSREngine`` over a scripted backend, for testing the LangChain adapter without loading a model.

The backend implements the engine's lane protocol (``ssr.backends.base.Backend``) with the real tokenizer of the
default model, but its "model" always predicts a fixed continuation: the given chain of thought, the family's
close text, the given answer, then end-of-sequence. Draft lanes (forked mid-thought, close text appended) predict
the same answer, so drafting, verification, suffix proposals, streaming and tool-call parsing all run for real and
the text that comes out is known in advance.
"""

from __future__ import annotations

import torch

from ssr import SSREngine


class ScriptedBackend:
    def __init__(self, tokenizer, close_ids: list[int], model_name: str = "scripted") -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = len(tokenizer)
        self.context_window = 32768
        self.eos_token_ids = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")})
        self.eos = min(self.eos_token_ids)
        self.close_ids = list(close_ids)
        self.script: list[int] = []
        self.answer: list[int] = []
        self.prompt_len: int | None = None
        self.prompts: list[list[int]] = []  # every prompt prefilled (for assertions on what the adapter sent)
        self._lanes: dict[int, list[int]] = {}
        self._next = 0

    def set_script(self, reasoning: str, answer: str) -> None:
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        self.answer = encode(answer)
        self.script = encode(reasoning) + self.close_ids + self.answer

    # -- the "model" -----------------------------------------------------------------------------------------------
    def _next_token(self, seq: list[int]) -> int:
        generated = seq[self.prompt_len:]
        if generated == self.script[: len(generated)]:
            return self.script[len(generated)] if len(generated) < len(self.script) else self.eos
        n = len(self.close_ids)
        at = max((i for i in range(len(generated) - n + 1) if generated[i: i + n] == self.close_ids), default=None)
        if at is None:
            return self.eos
        after = generated[at + n:]
        if after == self.answer[: len(after)] and len(after) < len(self.answer):
            return self.answer[len(after)]
        return self.eos

    # -- the lane protocol -----------------------------------------------------------------------------------------
    def new_lane(self, prefix: list[int] | None = None) -> int:
        """A new request's lane; this backend reuses no cached prefix, so the lane starts empty."""
        self._next += 1
        self._lanes[self._next] = []
        self.prompt_len = None  # learnt from the first feed: the prompt
        return self._next

    def park(self, lane: int) -> None:
        self.release_all()

    def fork(self, parent: int) -> int:
        self._next += 1
        self._lanes[self._next] = list(self._lanes[parent])
        return self._next

    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        out = {}
        for lane, feed in feeds.items():
            seq = self._lanes[lane]
            if self.prompt_len is None:
                self.prompt_len = len(feed)
                self.prompts.append(list(feed))
            seq.extend(feed)
            k = (want or {}).get(lane, len(feed))
            logits = torch.full((k, self.vocab_size), -30.0)
            for row, end in enumerate(range(len(seq) - k + 1, len(seq) + 1)):
                logits[row, self._next_token(seq[:end])] = 30.0
            out[lane] = logits
        return out

    def truncate(self, lane: int, length: int) -> None:
        del self._lanes[lane][length:]

    def length(self, lane: int) -> int:
        return len(self._lanes[lane])

    def release(self, lane: int) -> None:
        self._lanes.pop(lane, None)

    def release_all(self) -> None:
        self._lanes.clear()


def scripted_engine(tokenizer, config=None) -> SSREngine:
    """An SSREngine whose backend replays ``engine.backend.set_script(reasoning, answer)``."""
    from ssr.chat import detect_family

    family = detect_family(tokenizer, None)
    backend = ScriptedBackend(tokenizer, tokenizer.encode(family.close_text, add_special_tokens=False))
    return SSREngine(backend, tokenizer, config=config, family=family, model_name="scripted")
