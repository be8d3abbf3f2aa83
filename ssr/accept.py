"""Token choice and acceptance rules: greedy longest prefix, speculative sampling, point-mass recovery.

Every rule returns how many proposed tokens were accepted and the verifier's own next token, so that the output
is exactly what the model alone would produce: greedy token for token, sampling in distribution.

Speculative sampling is exact for any proposal distribution q, as long as the proposed token was drawn from q and
acceptance uses that same q. So under sampling a draft lane does not draw from the model's full distribution p: it
draws from ``Compact(p)``, p restricted to its ``SSRConfig.draft_support`` most likely tokens and renormalised, and
keeps only that (ids int32 + probabilities float32: 512 bytes a token at K = 64, against 4 bytes per vocabulary entry,
0.6 MB a token on a 150k vocabulary). The answer accepts a draft token with probability min(1, p(x) / q(x)) and on
rejection draws from max(p - q, 0), q scattered into a dense temporary for that one row only.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from .config import SSRConfig

# float32 logits: a temperature under MIN_TEMPERATURE (or a top_p under MIN_TOP_P) picks the same single most likely
# token as these floors do, but overflows (logits / 1e-300 is inf, inf - inf is NaN) or rounds to 0 (a top_p of
# 1e-300 is 0.0 in float32, which keeps no token): the sampler uses the floors
MIN_TEMPERATURE = 1e-30
MIN_TOP_P = 1e-30


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token (the first of equal maxima, as ``torch.argmax``). Float32 rows on the CPU go
    through numpy, which reads them at memory speed: on 17 rows of a 150k-token vocabulary (a verify step) torch's
    argmax took 1.7 ms and numpy's 0.45 (2 threads, measured); near-tie notes with ``torch.topk`` 2.0 ms against
    ``near_maxima``'s 0.8 given the argmax (one row: 0.28 ms against 0.03)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.asarray(logits.numpy().argmax(axis=-1)).reshape(-1).tolist()
    return torch.argmax(logits, dim=-1).reshape(-1).tolist()


def near_maxima(rows: torch.Tensor, best: list[int], window: float, most: int) -> dict[int, list[tuple[int, float]]]:
    """Per row (of ``[n, V]``), the tokens other than its argmax ``best[i]`` (as ``argmax_rows`` gives it: a greedy
    step's chosen tokens) whose logits lie within ``window`` of the row's maximum: at most ``most`` of them, highest
    first, with their margins below it. Rows with none are left out."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32:  # every token within the window, from numpy
        pools = []
        for row, b in zip(rows.numpy(), best):
            ids = np.flatnonzero(row >= row[b] - window)
            pools.append((ids, row[ids]))
    else:  # on the device: only each row's top few come to the host
        top = torch.topk(rows.float(), most + 1, dim=-1)
        pools = list(zip(top.indices.cpu().numpy(), top.values.cpu().numpy()))
    found = {}
    for i, ((ids, values), b) in enumerate(zip(pools, best)):
        peak = values.max()
        ranked = sorted(zip(ids.tolist(), (peak - values).tolist()), key=lambda pair: pair[1])
        close = [(t, round(m, 6)) for t, m in ranked if t != b and m <= window][:most]
        if close:
            found[i] = close
    return found


class Compact:
    """A distribution over at most K token ids: ``ids`` (int32, ``[K]``) and their probabilities ``values`` (float32,
    ``[K]``, summing to 1); every other id of the ``vocab`` has probability 0. On the device of the logits it came
    from."""

    __slots__ = ("ids", "values", "vocab")

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, vocab: int) -> None:
        self.ids, self.values, self.vocab = ids, values, vocab

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.values.nbytes

    def prob(self, token: int) -> float:
        return float((self.values * (self.ids == token)).sum())

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """Probabilities of ``ids`` (a ``[n]`` tensor on the same device)."""
        match = ids.reshape(-1, 1) == self.ids.reshape(1, -1)
        return (match.to(self.values.dtype) * self.values).sum(-1)

    def dense(self) -> torch.Tensor:
        """The ``[vocab]`` distribution (a temporary: a draft never keeps one)."""
        return torch.zeros(self.vocab, dtype=self.values.dtype, device=self.device).scatter_(
            0, self.ids.long(), self.values)


def nbytes(dist) -> int:
    """Bytes a recorded distribution holds (0 for a greedy ``None``)."""
    if dist is None:
        return 0
    return dist.nbytes if isinstance(dist, Compact) else dist.element_size() * dist.numel()


def prob(dist, token: int) -> float:
    return dist.prob(token) if isinstance(dist, Compact) else float(dist[token])


class Sampler:
    """Turns logits into the model's next-token distribution under the request's sampling settings.

    Its random generators live on the device of the tensors they draw for, made at first use and seeded from the
    request's seed: one seed gives one stream per device (CPU logits draw from the CPU generator, CUDA logits from
    that GPU's)."""

    def __init__(self, config: SSRConfig, support: int | None = None) -> None:
        self.greedy = config.greedy
        self.temperature = max(config.temperature, MIN_TEMPERATURE)
        self.top_k = config.top_k
        self.top_p = max(config.top_p, MIN_TOP_P)
        self.seed = config.seed if config.seed is not None else secrets.randbits(63)
        self.support = support or config.draft_support  # K of the drafts' compact proposal distributions
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device | str | None = None) -> torch.Generator:
        """The request's generator on ``device`` (CPU by default), made and seeded at first use."""
        device = torch.device("cpu" if device is None else device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        found = self._generators.get(device)
        if found is None:
            found = torch.Generator(device=device)
            found.manual_seed(self.seed)
            self._generators[device] = found
        return found

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

    def compact(self, probs: torch.Tensor) -> list[Compact]:
        """Each row of ``probs`` (``[n, V]``) restricted to its ``support`` most likely tokens, renormalised: the
        proposal distribution a draft lane draws from and keeps. Each row owns its storage (nothing of the step's
        batch stays alive with it)."""
        probs = probs.reshape(-1, probs.shape[-1])
        vocab = probs.shape[-1]
        k = min(self.support, vocab, self.top_k or vocab)  # with top-k on, p has (ties aside) <= top_k tokens
        values, ids = torch.topk(probs, k, dim=-1)
        values = values / values.sum(-1, keepdim=True)
        ids = ids.to(torch.int32)
        return [Compact(ids[i].clone(), values[i].clone(), vocab) for i in range(probs.shape[0])]

    def draw(self, probs) -> int:
        """A token from a dense distribution (or unnormalised weights) or a ``Compact`` one."""
        if isinstance(probs, Compact):
            at = torch.multinomial(probs.values, 1, generator=self.generator(probs.device))
            return int(probs.ids[at])
        return int(torch.multinomial(probs, 1, generator=self.generator(probs.device)))

    def uniform(self, device: torch.device | str | None = None) -> float:
        g = self.generator(device)
        return float(torch.rand((), generator=g, device=g.device))

    def next_token(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The model's next token and (when sampling) the distribution it was drawn from."""
        if self.greedy:
            return argmax_rows(logits)[0], None
        probs = self.probs(logits)
        return self.draw(probs), probs


def _without(p, token: int):
    """``p`` with ``token`` removed (unnormalised), or None when nothing is left."""
    if isinstance(p, Compact):
        rest = Compact(p.ids, p.values.masked_fill(p.ids == token, 0.0), p.vocab)
        return rest if float(rest.values.sum()) > 0 else None
    rest = p.clone()
    rest[token] = 0.0
    return rest if float(rest.sum()) > 0 else None


def _residual(p, q):
    """max(p - q, 0) (unnormalised), or None when it has no mass. A compact ``p`` keeps its support (the residual
    lies inside it); a dense ``p`` with a compact ``q`` scatters q into this one row's dense temporary."""
    if isinstance(p, Compact):
        q_at = q.at(p.ids) if isinstance(q, Compact) else q[p.ids.long()]
        rest = Compact(p.ids, torch.clamp(p.values - q_at, min=0.0), p.vocab)
        return rest if float(rest.values.sum()) > 0 else None
    if isinstance(q, Compact):
        rest = p.clone().scatter_add_(0, q.ids.long(), -q.values).clamp_(min=0.0)
    else:
        rest = torch.clamp(p - q, min=0.0)
    return rest if float(rest.sum()) > 0 else None


def verify(sampler: Sampler, proposal: list[int], logits: torch.Tensor, draft_probs: list | None = None,
           targets: list | None = None) -> tuple[int, int]:
    """Check ``proposal`` against the verifier's ``logits`` (``[len(proposal) + 1, V]``).

    Returns ``(accepted, next_token)``: the longest accepted prefix length and the verifier's token after it.
    Greedy: accept while the proposal is the argmax. Sampling: speculative sampling against the draft's recorded
    distribution (dense or ``Compact``) where there is one, otherwise the proposal is a point mass (accept with the
    verifier's probability; on rejection draw from the verifier's distribution with that token removed).

    ``targets`` replaces the verifier's distributions ``sampler.probs(logits)`` row by row (a draft lane verifies
    and draws under its compact distributions, which its tokens then record).
    """
    if sampler.greedy:
        choices = argmax_rows(logits)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choices[accepted]:
            accepted += 1
        return accepted, choices[accepted]
    target = targets if targets is not None else sampler.probs(logits)
    for i, token in enumerate(proposal):
        p = target[i]
        q = draft_probs[i] if draft_probs is not None else None
        p_token, device = prob(p, token), p.device
        if q is None:  # point-mass proposal
            if sampler.uniform(device) < p_token:
                continue
            residual = _without(p, token)
        else:
            if sampler.uniform(device) * prob(q, token) < p_token:  # u < p/q without dividing by zero
                continue
            residual = _residual(p, q)
        return i, sampler.draw(residual if residual is not None else p)
    return len(proposal), sampler.draw(target[len(proposal)])
