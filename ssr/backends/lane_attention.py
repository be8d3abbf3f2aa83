"""Attention over each lane's own cache columns, for the transformers backend.

Lanes of several requests share one cache, so most of a row's columns belong to other requests and its mask hides
them. transformers' SDPA path attends over every column of every row, after copying the keys and values once per
query head (``repeat_kv``): a step over 16 lanes of 16 requests cost 45x a one-lane step (measured, 0.5B model, one
CPU thread). Here each row gathers the columns its lane holds and attends over those alone, the query heads that
share a key/value head folded into one batch, so a step's attention costs what its lanes hold. Hidden columns are
never read, so they need no particular values.

The backend sets the rows' columns (``lane_columns``) around its forward pass; anything else falls back to SDPA.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "ssr_lanes"
_local = threading.local()


@contextmanager
def lane_columns(columns: list[torch.Tensor]):
    """Within the block, row ``i`` of every attention call attends over cache columns ``columns[i]`` only."""
    _local.columns = columns
    try:
        yield
    finally:
        _local.columns = None


def lane_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    columns = getattr(_local, "columns", None)
    if columns is None or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty(rows, heads, width, dim)
    for row, index in enumerate(columns):
        k, v = key[row][:, index], value[row][:, index]  # [kv_heads, n, dim]
        mask = attention_mask[row, 0][:, index]  # [width, n]: causality among the new columns, padding
        q = query[row].reshape(kv_heads, groups * width, dim)  # heads sharing a key/value head, side by side
        mask = mask.unsqueeze(0).expand(groups, width, -1).reshape(1, groups * width, -1)
        out[row] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling).reshape(heads, width, dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, lane_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
