"""The one small protocol every backend implements.

A backend runs forward passes over *lanes*: independent token sequences that share one model (the thinking
stream, each draft, the answer). It knows nothing of drafts, acceptance or requests: it appends tokens to lanes in
one batched pass and reports the logits at the positions asked for. The engine's scheduler puts the lanes of every
live request into one ``step``, so lanes of several requests are live at once and each request frees its own.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    model_name: str
    vocab_size: int
    context_window: int
    eos_token_ids: frozenset[int]

    def new_lane(self, prefix: list[int] | None = None) -> int:
        """A lane for a new request (other requests' lanes may be live). It may already hold a cached prefix of
        ``prefix`` (``length`` says how many tokens: a parked lane whose tokens start it); a backend without prefix
        reuse returns an empty lane."""

    def park(self, lane: int) -> None:
        """End of a request whose other lanes are already released: ``lane`` may be kept for a later request's
        prefix (replacing a lane parked before) or released; no other live lane is touched."""

    def fork(self, parent: int) -> int:
        """A new lane holding a copy of ``parent``'s tokens (its cache rows, up to the fork point)."""

    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Append ``feeds[lane]`` to each lane in ONE batched forward pass.

        Returns, per fed lane, float32 logits of shape ``[k, vocab]`` for the last ``k = want.get(lane, len(feed))``
        fed positions (row ``i`` predicts the token after the ``i``-th of those positions).
        """

    def truncate(self, lane: int, length: int) -> None:
        """Forget every token of ``lane`` after its first ``length`` tokens (rejected proposals)."""

    def length(self, lane: int) -> int:
        """Number of tokens the lane holds."""

    def release(self, lane: int) -> None:
        """Free the lane and its memory now."""

    def release_all(self) -> None:
        """Free every lane of every request (calibration, shutdown)."""


# end-of-text / end-of-turn markers of the chat families: a model that emits one has ended its turn
END_OF_TEXT = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>")


def stop_token_ids(tokenizer, *eos_values) -> frozenset[int]:
    """Every token that ends generation: the ``eos_token_id`` values of the model's configs (an int, a list or
    None each), the tokenizer's EOS and its end-of-text tokens (``tokenizer`` None: the configs' ids only)."""
    ids: set[int] = set()
    for value in eos_values:
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= end_of_text_ids(tokenizer)
    return frozenset(ids)


def end_of_text_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's end-of-text special tokens. Hub generation configs list them as EOS (Qwen2.5:
    ``<|im_end|>`` and ``<|endoftext|>``), but a converted checkpoint's config may name only one, and a model that
    emits the other would go on writing a made-up next turn."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    special |= {t.content if hasattr(t, "content") else str(t)
                for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in END_OF_TEXT if t in special and t in vocab}


def rows_wanted(lane: int, feed: list[int], want: dict[int, int]) -> int:
    """How many logit rows ``step`` returns for ``lane`` (default: one per fed token), checked."""
    if not feed:
        raise ValueError(f"step(): lane {lane} was fed no tokens")
    rows = want.get(lane, len(feed))
    if not 1 <= rows <= len(feed):
        raise ValueError(f"step(): want[{lane}]={rows} must be in 1..{len(feed)}")
    return rows


def common_prefix(held: list[int], prefix: list[int]) -> int:
    """How many leading tokens ``held`` and ``prefix`` share (a parked lane's reusable part)."""
    limit = min(len(held), len(prefix))
    n = 0
    while n < limit and held[n] == prefix[n]:
        n += 1
    return n
