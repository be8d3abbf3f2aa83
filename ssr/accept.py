"""Token choice and acceptance rules: greedy longest prefix, speculative sampling, point-mass recovery.

Every rule returns how many proposed tokens were accepted and the verifier's own next token, so that the output
is exactly what the model alone would produce: greedy token for token, sampling in distribution.
"""

from __future__ import annotations

import secrets

import torch

from .config import SSRConfig


class Sampler:
    """Turns logits into the model's next-token distribution under the request's sampling settings."""

    def __init__(self, config: SSRConfig) -> None:
        self.greedy = config.greedy
        self.temperature = config.temperature
        self.top_k = config.top_k
        self.top_p = config.top_p
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Distribution(s) after temperature, top-k and top-p; works on ``[V]`` or ``[n, V]``."""
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def next_token(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The model's next token and (when sampling) the distribution it was drawn from."""
        if self.greedy:
            return int(torch.argmax(logits)), None
        probs = self.probs(logits)
        return self.draw(probs), probs


def verify(sampler: Sampler, proposal: list[int], logits: torch.Tensor,
           draft_probs: list[torch.Tensor | None] | None = None) -> tuple[int, int]:
    """Check ``proposal`` against the verifier's ``logits`` (``[len(proposal) + 1, V]``).

    Returns ``(accepted, next_token)``: the longest accepted prefix length and the verifier's token after it.
    Greedy: accept while the proposal is the argmax. Sampling: speculative sampling against the draft's recorded
    distribution where there is one, otherwise the proposal is a point mass (accept with the verifier's probability;
    on rejection draw from the verifier's distribution with that token removed).
    """
    if sampler.greedy:
        choices = torch.argmax(logits, dim=-1).tolist()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choices[accepted]:
            accepted += 1
        return accepted, choices[accepted]
    target = sampler.probs(logits)
    for i, token in enumerate(proposal):
        p = target[i]
        q = draft_probs[i] if draft_probs is not None else None
        if q is None:  # point-mass proposal
            if sampler.uniform() < float(p[token]):
                continue
            residual = p.clone()
            residual[token] = 0.0
        else:
            if sampler.uniform() * float(q[token]) < float(p[token]):  # u < p/q without dividing by zero
                continue
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        return i, sampler.draw(residual / total) if total > 0 else sampler.draw(p)
    return len(proposal), sampler.draw(target[len(proposal)])
