"""Device-correct sampling: the Sampler draws with a generator on the device of the logits it samples from (made
at first use, seeded from the request's seed), so CUDA logits never meet a CPU generator; on CUDA a sampled request
with drafts runs end to end (skipped, with the reason, where there is no CUDA device)."""

from __future__ import annotations

import pytest
import torch

from ssr import SSRConfig
from ssr.accept import Compact, Sampler, verify

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False); the CUDA checks run on a GPU machine"


def devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def _exercise(sampler: Sampler, logits: torch.Tensor) -> list:
    """Every sampling path once: a plain draw, a compact draw, speculative sampling with compact and dense draft
    distributions, point masses, and a compact target (a draft lane's own verification)."""
    probs = sampler.probs(logits)
    compact = sampler.compact(probs)
    out = [sampler.draw(probs[0]), sampler.draw(compact[0]), sampler.next_token(logits[0])[0]]
    for rows in (2, 4):
        proposal = [sampler.draw(q) for q in compact[: rows - 1]]
        out.append(verify(sampler, proposal, logits[:rows], compact[: rows - 1]))
        out.append(verify(sampler, proposal, logits[:rows], list(probs[: rows - 1])))
        out.append(verify(sampler, proposal, logits[:rows], None))
        out.append(verify(sampler, proposal, logits[:rows], compact[: rows - 1], targets=compact[:rows]))
        out.append(verify(sampler, proposal, logits[:rows], None, targets=compact[:rows]))
    return out


@pytest.mark.parametrize("device", devices())
def test_sampler_draws_on_the_logits_device(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(device)
    sampler = Sampler(SSRConfig(temperature=0.8, seed=7), support=8)
    asked: list[torch.device] = []
    made = sampler.generator

    def generator(where=None):
        asked.append(torch.device("cpu" if where is None else where))
        return made(where)

    sampler.generator = generator
    assert not sampler._generators  # made at first use only
    out = _exercise(sampler, logits)
    assert {d.type for d in asked} == {logits.device.type}  # every draw and uniform on the logits' device
    assert [g.device.type for g in sampler._generators.values()] == [logits.device.type]
    compact = sampler.compact(sampler.probs(logits))[0]
    assert isinstance(compact, Compact) and compact.ids.device == logits.device == compact.values.device
    for token in out[:3]:
        assert 0 <= token < 50
    for accepted, token in out[3:]:
        assert 0 <= accepted <= 3 and 0 <= token < 50


@pytest.mark.parametrize("device", devices())
def test_one_seed_gives_one_stream_per_device(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(device)
    runs = [_exercise(Sampler(SSRConfig(temperature=1.0, seed=seed), support=8), logits) for seed in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_cpu_generator_is_the_request_seed_stream():
    """On CPU the stream is torch's CPU generator seeded with the request's seed, as before the device change."""
    sampler = Sampler(SSRConfig(temperature=1.0, seed=123))
    expected = torch.Generator().manual_seed(123)
    assert sampler.uniform() == float(torch.rand((), generator=expected))
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert sampler.draw(probs) == int(torch.multinomial(probs, 1, generator=expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_sampler_never_makes_a_cpu_generator():
    sampler = Sampler(SSRConfig(temperature=1.0, seed=0), support=8)
    _exercise(sampler, torch.randn(4, 50, device="cuda"))
    assert [g.device.type for g in sampler._generators.values()] == ["cuda"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_CUDA))])
def test_sampled_request_with_drafts_runs_end_to_end(device):
    """The transformers backend on each device: a sampled request with iterative drafts (compact q on the device,
    bootstraps, prefix acceptance) and a greedy one run to the end; the same seed gives the same output."""
    from tiny import TINY_FAMILY, prompt_ids, tiny_model, tiny_tokenizer

    from ssr.backends.transformers import TransformersBackend
    from ssr.costs import CostTable
    from ssr.engine import SSREngine

    tokenizer = tiny_tokenizer()
    backend = TransformersBackend(tiny_model(3, attention=0.3, scale=0.6).to(device), f"tiny-{device}", {0}, 0)
    backend.tokenizer = tokenizer
    engine = SSREngine(backend, tokenizer, config=SSRConfig(), family=TINY_FAMILY, model_name=f"tiny-{device}",
                       costs=CostTable.flat())
    # drafts from the first thinking token on (the first version forked at token 1 of a thinking this model closes
    # after two: it ran on an H200 on 2026-12-04 and forked nothing)
    cfg = dict(max_think_tokens=4, max_tokens=10, draft_start=0, draft_interval=1, max_drafts=2, max_draft_tokens=4,
               draft_support=3, suffix_min_match=1, suffix_min_prob=0.0,
               suffix_sources=("drafts", "prompt", "thinking", "answer"))  # not earlier outputs: a seed repeats
    runs = [engine.generate(prompt_ids("ab"), config=SSRConfig(temperature=1.0, seed=s, **cfg)) for s in range(8)]
    again = engine.generate(prompt_ids("ab"), config=SSRConfig(temperature=1.0, seed=3, **cfg))
    assert runs[3].token_ids and runs[3].token_ids == again.token_ids
    assert sum(bool(r.stats["drafts"]) for r in runs) >= 4 and runs[3].stats["draft_probs_support"] == 3
    greedy = engine.generate(prompt_ids("ab"), config=SSRConfig(**cfg))
    assert greedy.token_ids and greedy.stats["draft_probs_peak_bytes"] == 0
