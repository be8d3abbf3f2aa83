"""ssr/backends/kv_cache.py: ``BufferedCache`` against transformers' ``DynamicCache``, and its growth through the
transformers backend: O(log n) reallocations, a step's copying flat in the sequence length (counted, never timed)."""

from __future__ import annotations

import torch

from ssr.backends.transformers import TransformersBackend
from tiny import tiny_model

ATOL = 1e-4


def backend(seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), "tiny", {0}, 0)


def test_growth_is_logarithmic_and_step_copying_constant():
    b = backend()
    lane = b.new_lane()
    b.step({lane: [3, 4, 5]})
    growths, per_step = b.cache_growths, []
    for i in range(2000):
        before, grew = b.bytes_copied, b.cache_growths
        b.step({lane: [3 + i % 13]}, {lane: 1})
        if b.cache_growths == grew:
            per_step.append(b.bytes_copied - before)
    assert b.cache_growths - growths <= 11  # 3 -> 2003 columns: capacity doubles 4 -> 2048
    assert len(set(per_step)) == 1  # a step without growth writes the same bytes at 10 or 2000 tokens
    assert per_step[0] > 0
    assert b.bytes_copied < 4 * 2003 * per_step[0]  # growth copies amortise to O(1) per token


def test_speculative_pattern_growth_bounded():
    """Verify-and-reject steps (fork, feed several, truncate) keep growths logarithmic and per-token bytes flat."""
    b = backend()
    main = b.new_lane()
    b.step({main: [3, 4, 5]})
    draft = b.fork(main)
    start = b.cache_growths
    costs = []
    for i in range(300):
        before = b.bytes_copied
        grew = b.cache_growths
        b.step({main: [6, 7, 8], draft: [9]})
        b.truncate(main, b.length(main) - 2)
        if b.cache_growths == grew:
            costs.append(b.bytes_copied - before)
    assert b.cache_growths - start <= 10
    assert max(costs) == min(costs)


@torch.no_grad()
def test_buffered_cache_matches_dynamic_cache():
    """``BufferedCache`` as transformers' decoders use ``past_key_values``: same logits as ``DynamicCache`` through
    prefill, decoding, ``crop`` and ``batch_select_indices``, and the sizes the mask code asks for."""
    from transformers import DynamicCache

    from ssr.backends.transformers import BufferedCache

    model = tiny_model(4)
    ours, theirs = BufferedCache(model.config.num_hidden_layers), DynamicCache(config=model.config)

    def both(ids):
        ids = torch.tensor(ids)
        a = model(input_ids=ids, past_key_values=ours, use_cache=True).logits
        b = model(input_ids=ids, past_key_values=theirs, use_cache=True).logits
        assert torch.allclose(a, b, atol=ATOL, rtol=1e-4)

    both([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    both([[5], [6]])
    assert ours.get_seq_length() == theirs.get_seq_length() == 6
    assert ours.get_mask_sizes(2, 0) == theirs.get_mask_sizes(2, 0) == (8, 0)
    ours.crop(-2)
    theirs.crop(-2)
    assert ours.get_seq_length() == 4
    both([[7, 8], [9, 10]])
    ours.batch_select_indices(torch.tensor([1]))
    theirs.batch_select_indices(torch.tensor([1]))
    both([[11]])
    assert ours.layers[0].keys.shape == theirs.layers[0].keys.shape == (1, 1, 7, 32)
