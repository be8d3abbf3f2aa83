"""What "exact" means on a backend whose rows depend on the batch, checked output by output.

On float32 transformers (and llama.cpp's ``exact`` mode) a row's logits are the same bits whatever else is in the
step, so SSR's greedy tokens equal plain decoding's. llama.cpp's multi-row kernels round differently with the number
of rows (``ssr.backends.llama_cpp``), by at most the noise calibration measures (``ssr.calibrate.measure_noise``).
There the promise is: SSR's greedy output equals plain decoding's up to the first position where the two differ,
and that position is a near-tie in plain decoding: the other output's token there has a logit within twice that
noise of plain's chosen token (``GenerationResult.near_ties``), so either is the model's choice. After it the two
continue from different text and are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    """How one output compares with plain decoding's on the same backend and request."""

    identical: bool
    diverged_at: int | None = None  # first index where the token ids differ (or one output ends)
    margin: float | None = None  # how far below plain's token the other's token was in plain's logits there
    near_tie: bool = True  # False: the divergence breaks the promise (not a near-tie of plain's)

    def to_dict(self) -> dict:
        return {"identical": self.identical, "diverged_at": self.diverged_at, "margin": self.margin,
                "near_tie": self.near_tie}


def compare(plain_ids: list[int], plain_ties: dict[int, list[tuple[int, float]]], other_ids: list[int]) -> Agreement:
    """``other_ids`` against plain decoding's ``plain_ids`` and its ``near_ties`` (a result's fields)."""
    if other_ids == plain_ids:
        return Agreement(identical=True)
    at = next((i for i, (a, b) in enumerate(zip(plain_ids, other_ids)) if a != b), min(len(plain_ids),
                                                                                      len(other_ids)))
    if at >= len(plain_ids) or at >= len(other_ids):  # one stopped where the other went on: not a choice of tokens
        return Agreement(identical=False, diverged_at=at, near_tie=False)
    margin = next((m for token, m in plain_ties.get(at, ()) if token == other_ids[at]), None)
    if margin is None:
        return Agreement(identical=False, diverged_at=at, near_tie=False)
    return Agreement(identical=False, diverged_at=at, margin=margin, near_tie=True)
