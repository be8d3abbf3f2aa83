"""The transformers backend's KV cache: keys, values and the lanes' mask in buffers with spare capacity.

transformers' ``DynamicCache`` concatenates every step's keys and values onto the cache (at 3000 tokens ``torch.cat``
was 27% of a step): the work per token grew with the chain of thought. Here buffers double when full, a step writes
only its new columns in place, and attention reads views, so n tokens reallocate O(log n) times.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


def _capacity(needed: int, have: int, limit: int) -> int:
    """Next buffer size: the power of two that holds ``needed`` (so n tokens reallocate O(log n) times), cut to
    ``limit`` (the context window) while that suffices."""
    if needed <= have:
        return have
    size = 1 << (needed - 1).bit_length()
    return min(size, limit) if needed <= limit else size


class _BufferedLayer(DynamicLayer):
    """One decoder layer's keys and values in ``[rows, heads, columns, head_dim]`` buffers; ``keys`` and ``values``
    are views of the live rows and used columns, which is what attention reads."""

    def __init__(self, cache: "BufferedCache") -> None:
        super().__init__()
        self.cache = cache
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def fit(self, like: torch.Tensor | None = None) -> None:
        """Reallocate the buffers to the cache's capacity (copying the used part) if they are smaller."""
        rows_cap, cols_cap = self.cache.capacity
        if self._k is not None and self._k.shape[0] >= rows_cap and self._k.shape[2] >= cols_cap:
            return
        ref = self._k if self._k is not None else like
        if ref is None:
            return  # nothing stored yet: allocated at the first update
        shape = (rows_cap, ref.shape[1], cols_cap, ref.shape[3])
        k, v = ref.new_empty(shape), ref.new_empty(shape)
        if self._k is not None and self._v is not None and self.length:
            rows = self.cache.rows
            k[:rows, :, : self.length] = self._k[:rows, :, : self.length]
            v[:rows, :, : self.length] = self._v[:rows, :, : self.length]
            self.cache.bytes_written += 2 * self._k[:rows, :, : self.length].nbytes
        self._k, self._v = k, v
        self.view()

    def view(self) -> None:
        if self._k is not None and self._v is not None:
            lo, hi = self.cache.window or (0, self.cache.rows)
            self.keys = self._k[lo:hi, :, : self.length]
            self.values = self._v[lo:hi, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, width = key_states.shape[0], key_states.shape[-2]
        if self.cache.rows == 0 and self.cache.length == 0:  # a fresh cache takes the batch it is given
            self.cache.rows = rows
        lo, hi = self.cache.window or (0, self.cache.rows)
        if rows != hi - lo:
            raise ValueError(f"BufferedCache computes {hi - lo} rows, the step has {rows}")
        end = self.length + width
        self.cache.reserve(self.cache.rows, end)  # a no-op when the backend reserved before the pass
        self.fit(key_states)
        k, v = self._buffers()
        k[lo:hi, :, self.length: end] = key_states
        v[lo:hi, :, self.length: end] = value_states
        for a, b in ((0, lo), (hi, self.cache.rows)):  # rows not computed: zeros their masks hide (never NaN)
            if a < b:
                k[a:b, :, self.length: end] = 0
                v[a:b, :, self.length: end] = 0
        self.cache.bytes_written += key_states.nbytes + value_states.nbytes
        self.length = end
        self.view()
        return self.keys, self.values

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, once allocated (``fit`` allocates them given a tensor to copy the shape of)."""
        if self._k is None or self._v is None:
            raise RuntimeError("the layer's key and value buffers are not allocated")
        return self._k, self._v

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count removes that many columns, a positive one keeps that many."""
        if tokens_to_remove:
            keep = self.length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self.length)
            self.length = max(keep, 0)
            self.view()

    def copy_row(self, src: int, dst: int) -> None:
        if self._k is not None and self._v is not None and self.length:
            self.fit()
            self._k[dst, :, : self.length] = self._k[src, :, : self.length]
            self._v[dst, :, : self.length] = self._v[src, :, : self.length]
            self.cache.bytes_written += 2 * self._k[src, :, : self.length].nbytes

    def clear_row(self, row: int) -> None:
        """Zeros in ``row``'s used columns: a new lane's mask hides them, and hidden entries must not be NaN (an
        attention weight of 0 times NaN is NaN)."""
        if self._k is not None and self._v is not None and self.length:
            self.fit()
            self._k[row, :, : self.length] = 0
            self._v[row, :, : self.length] = 0

    def keep_columns(self, index: torch.Tensor) -> None:
        """Keep columns ``index`` (ascending) as columns 0..len-1 of every row."""
        if self._k is not None and self._v is not None and self.length:
            rows, n = self.cache.rows, len(index)
            self._k[:rows, :, :n] = self._k[:rows, :, index]
            self._v[:rows, :, :n] = self._v[:rows, :, index]
            self.cache.bytes_written += 2 * self._k[:rows, :, :n].nbytes
        self.length = min(self.length, len(index))
        self.view()

    def select_rows(self, indices: torch.Tensor) -> None:
        if self._k is not None and self._v is not None and self.length:
            n = len(indices)
            self._k[:n, :, : self.length] = self._k[indices, :, : self.length]
            self._v[:n, :, : self.length] = self._v[indices, :, : self.length]
            self.cache.bytes_written += 2 * self._k[:n, :, : self.length].nbytes

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("rows are shared by every layer: use BufferedCache.batch_select_indices")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("BufferedCache rows are added with add_row (a fork)")

    def reset(self) -> None:
        self._k = self._v = self.keys = self.values = None
        self.length = 0
        self.is_initialized = False


class BufferedCache(Cache):
    """``past_key_values`` for transformers' decoders that keeps keys and values in preallocated buffers.

    ``DynamicCache`` concatenates every step, so a step copies the whole cache (27% of the time at 3000 tokens).
    Here a step writes its new columns in place and attention reads views; capacity (rows and columns) doubles when
    full. Rows are changed only between passes (``copy_row``, ``select_rows``), columns by passes and ``crop``.
    Every layer stores every column (a sliding-window model's window is applied by its attention mask).
    """

    layers: list[_BufferedLayer]  # type: ignore[assignment]  # every layer is one of ours (``__init__``)

    def __init__(self, num_layers: int, max_columns: int = 1 << 30) -> None:
        super().__init__(layers=[_BufferedLayer(self) for _ in range(num_layers)])
        self.rows = 0
        self.window: tuple[int, int] | None = None  # rows [lo, hi) the running pass computes (None: every row)
        self.capacity = (0, 0)  # (rows, columns) every layer's buffers are grown to
        self.max_columns = max_columns
        self.growths = 0  # capacity increases (each reallocates every stored layer once)
        self.bytes_written = 0  # bytes written into the buffers: new columns, row copies, reallocation copies

    def reserve(self, rows: int, columns: int) -> bool:
        """Make room for ``rows`` x ``columns``; True when the capacity grew."""
        have_rows, have_cols = self.capacity
        new = (_capacity(rows, have_rows, 1 << 16), _capacity(columns, have_cols, self.max_columns))
        if new == self.capacity:
            return False
        self.capacity = new
        self.growths += 1
        return True

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in (layer._k, layer._v) if t is not None)

    def set_length(self, columns: int) -> None:
        for layer in self.layers:
            layer.length = min(layer.length, columns)
            layer.view()

    def add_row(self, src: int | None) -> int:
        """A new last row: a copy of row ``src`` (None: an empty row, for a lane whose mask hides every column)."""
        self.reserve(self.rows + 1, self.length)
        for layer in self.layers:
            layer.fit()
        dst = self.rows
        self.rows += 1
        for layer in self.layers:
            if src is not None:
                layer.copy_row(src, dst)
            else:
                layer.clear_row(dst)
            layer.view()
        return dst

    def remove_row(self, row: int) -> None:
        """Drop ``row``: the last row moves into its place (one row copied, not every row after it)."""
        last = self.rows - 1
        for layer in self.layers:
            if row != last:
                layer.copy_row(last, row)
        self.rows = last
        for layer in self.layers:
            layer.view()

    def keep_columns(self, index: torch.Tensor) -> None:
        """Keep columns ``index`` (ascending) of every row as its first columns (the rest are dropped)."""
        for layer in self.layers:
            layer.keep_columns(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order) as rows 0..len-1."""
        for layer in self.layers:
            layer.select_rows(indices)
        self.rows = len(indices)
        for layer in self.layers:
            layer.view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.rows = 0
        self.capacity = (0, 0)
