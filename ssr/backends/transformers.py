"""In-process PyTorch backend: every live lane is one row of one batched KV cache.

Rows grow in lock-step, so a lane that is fed fewer tokens than another in the same pass gets padding columns that
its attention mask hides; rejected proposals are hidden the same way. Each lane keeps the cache columns that hold its
tokens, and position ids are explicit, so a row's holes never shift its positions. Trailing columns that no row uses
are cropped, which keeps the single-lane answer phase hole-free.

The cache (``BufferedCache``) and the ``[rows, columns]`` attention mask live in buffers with spare capacity that
double when full, so a step writes only its new columns: its copying does not grow with the sequence length.

On CPU every ``nn.Linear`` dispatches per call, by its number of input rows, to the kernel measured fastest for that
row count on this machine (``select_kernels``): which product is fastest for 2-32 rows differs between CPUs
(docs/design.md: the cost model), so no choice is built in; until measured, ``F.linear`` runs everywhere.

Several requests share the cache, one row per lane; a new request's lane starts as a fork of the live lane that
shares the longest prefix with its prompt (a common system prompt is prefilled once). A step computes only the
rows from the first fed lane's to the last's (a new request's prefill is the last row alone), and when requests
leave, the columns no lane holds any more are compacted away once they are half of the cache.

A finished request's thinking lane stays parked while no other lane is live: the next request whose prompt extends
it (an agent's next step: same conversation plus a tool result) starts from that cache and prefills only the new
tokens.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from functools import partial

import torch

from . import lane_attention
from .base import Backend, Lane, rows_wanted, stop_token_ids
from .kernels import (
    DEFAULT_KERNELS,
    PACKED,
    SELECT_ROWS,
    KernelChoice,
    choose_kernels,
    kernel_ranges,
    pack,
    time_kernels,
)
from .kv_cache import BufferedCache

__all__ = ["TransformersBackend", "BufferedCache", "kernel_ranges"]

# -- the backend ------------------------------------------------------------------------------------------------------


@dataclass
class _Lane(Lane):
    row: int
    columns: list[int] = field(default_factory=list)  # cache column of each of the lane's tokens, in order


class TransformersBackend(Backend[_Lane]):
    cost_version = "onednn-kernels+noise"  # part of the cost table's cache key: tables measured before it are stale
    # A row's logits move with the rest of the step: on a CPU the linear kernels differ by row count (float32: up
    # to about 3e-5 of a logit on the embedded model), on CUDA at a real model's shapes too (float32 5e-6 to 2e-5,
    # bf16 0.04-0.1, measured on an H200). So, as on llama.cpp, calibration measures that noise on the running
    # machine and greedy decoding notes the near-ties where SSR may leave plain decoding's tokens.
    row_exact = False
    min_shared = 16  # a new request forks a live lane sharing this much of its prompt (its system prompt)

    def __init__(self, model, model_name: str, eos_token_ids, pad_token_id: int) -> None:
        super().__init__()
        self.model = model.eval()
        self.model_name = model_name
        self.config = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_window = int(getattr(model.config, "max_position_embeddings", 32768))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._cache = BufferedCache(layers, max_columns=self.context_window)
        self._mask_buf = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [rows, columns]: True = visible
        self._columns = 0  # used cache columns
        self._mask_bytes = 0
        self._softcap = getattr(model.config, "final_logit_softcapping", None)
        self._choice = KernelChoice()
        self.kernels: list[tuple[int | None, str]] = list(DEFAULT_KERNELS)
        if self.device.type == "cpu":
            self.model.set_attn_implementation(lane_attention.NAME)  # each row attends over its own columns
            for layer in self.model.modules():
                if isinstance(layer, torch.nn.Linear):
                    # per instance, on purpose: each layer's calls go through the kernel table
                    layer.forward = partial(self._choice, layer)  # type: ignore[method-assign]

    @classmethod
    def load(cls, path: str, model_name: str, dtype: str | torch.dtype | None = None, device: str | None = None,
             **model_kwargs) -> "TransformersBackend":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
        model = model.to(device)  # type: ignore[arg-type]  # transformers' wrapper of .to() hides that it is bound
        tokenizer = AutoTokenizer.from_pretrained(path)
        configs = (model.generation_config, model.config)
        eos = stop_token_ids(tokenizer, *(getattr(config, "eos_token_id", None) for config in configs))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        backend = cls(model, model_name, eos, pad)
        backend.tokenizer = tokenizer
        return backend

    # -- kernels ---------------------------------------------------------------------------------------------------
    @property
    def kernel_calls(self) -> collections.Counter:
        """Linear calls per kernel so far (CPU only)."""
        return self._choice.calls

    def set_kernels(self, table) -> None:
        """Use ``table`` (ascending ``(max_rows, kernel)`` ranges, the last ``(None, kernel)``) from now on. The
        packed kernel packs every linear weight, once and for good: a layer keeps only its packed copy (memory
        stays the same), except a weight shared with the embeddings (tied), which keeps both."""
        table = [(None if m is None else int(m), str(k)) for m, k in table]
        if self._packed and table != [(None, PACKED)]:
            raise ValueError(f"kernel table {table!r}: this model's linear weights are packed; only "
                             f"[(None, {PACKED!r})] can run them")
        self._choice.set(table)
        if table == [(None, PACKED)] and not self._packed:
            self._pack_linear_weights()
        self.kernels = table

    @property
    def _packed(self) -> bool:
        return self.kernels == [(None, PACKED)]

    @torch.no_grad()
    def _pack_linear_weights(self) -> None:
        embeddings = self.model.get_input_embeddings().weight
        for layer in self.model.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.packed_weight = pack(layer.weight)
                if layer.weight is not embeddings:
                    layer.weight = None  # type: ignore[assignment]  # freed: only the packed copy runs

    def select_kernels(self, timings: dict[str, dict[int, float]] | None = None, rows=SELECT_ROWS, reps: int = 3,
                       progress: bool = False, margin: float = 0.05) -> list[tuple[int | None, str]]:
        """Pick, per row count, the kernel that runs this model's linear layers fastest here, and use it.

        Noise on a shared machine must not flip choices: a kernel within ``margin`` of the fastest counts as fast,
        and among those ``F.linear`` (the library's default) is preferred, then the previous row count's choice.
        ``timings`` (``{kernel: {rows: seconds}}``) replaces the measurement (tests). Off CPU ``F.linear`` stays and
        nothing is measured.
        """
        if timings is None:
            if self.device.type != "cpu" or self._packed:  # packed weights cannot run the other kernels
                return list(self.kernels)
            timings = self.time_kernels(rows, reps, progress)
        self.set_kernels(choose_kernels(timings, margin))
        return list(self.kernels)

    def time_kernels(self, rows=SELECT_ROWS, reps: int = 3, progress: bool = False) -> dict[str, dict[int, float]]:
        """Seconds per forward pass spent in this model's linear layers, per kernel and row count."""
        if self._packed:
            raise ValueError("time_kernels: this model's linear weights are packed; the other kernels have no "
                             "weights to run on (time a freshly loaded model)")
        return time_kernels(self.model, self.dtype, rows, reps, progress)

    # -- counters for tests and benchmarks --------------------------------------------------------------------------
    @property
    def cache_growths(self) -> int:
        """How many times the cache and mask buffers were reallocated to a larger capacity."""
        return self._cache.growths

    @property
    def memory_bytes(self) -> int:
        """Bytes the KV cache and mask buffers hold now (their capacity, not just the used part)."""
        return self._cache.nbytes + self._mask_buf.nbytes

    @property
    def bytes_copied(self) -> int:
        """Bytes written into the cache and mask buffers (new columns, forked rows, reallocation copies)."""
        return self._cache.bytes_written + self._mask_bytes

    # -- lane hooks: a lane is a row of the cache ----------------------------------------------------------------
    def _open(self, parent: _Lane | None) -> _Lane:
        """A new last row: a copy of ``parent``'s (the same columns), or one that sees no column."""
        if parent is None:
            return _Lane(row=self._add_row(None))
        return _Lane(row=self._add_row(parent.row), columns=list(parent.columns))

    def _cut(self, state: _Lane, length: int) -> None:
        first = state.columns[length]
        self._mask_buf[state.row, first: self._columns] = False  # the row's tail holds no other visible column
        self._mask_bytes += self._columns - first
        del state.columns[length:]
        self._crop_unused()

    def _free(self, state: _Lane) -> None:
        if not self.lanes:
            self._reset()
            return
        last = self._cache.rows - 1
        if state.row != last:  # the last row moves into the freed one
            self._mask_buf[state.row, : self._columns] = self._mask_buf[last, : self._columns]
            self._mask_bytes += self._columns
            for other in self.lanes.values():
                if other.row == last:
                    other.row = state.row
        self._cache.remove_row(state.row)
        self._crop_unused()
        self._compact()

    def _free_all(self, states: list[_Lane]) -> None:
        self._reset()

    def _keep_parked(self) -> bool:
        """Only while no other lane is live: with other requests live every step would carry its row."""
        return len(self.lanes) == 1

    @property
    def _mask(self) -> torch.Tensor:
        return self._mask_buf[: self._cache.rows, : self._columns]

    # -- the batched forward pass --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        want = want or {}
        self.lanes.check(feeds)
        sizes = [rows_wanted(lane_id, tokens, want) for lane_id, tokens in feeds.items()]  # checked before any work
        fed_rows = [self.lanes[lane_id].row for lane_id in feeds]
        lo, hi = min(fed_rows), max(fed_rows) + 1  # only these rows are computed (other requests' lanes wait)
        width = max(len(tokens) for tokens in feeds.values())
        past = self._columns
        input_ids = torch.full((hi - lo, width), self.pad_token_id, dtype=torch.long, device=self.device)
        new_mask = torch.zeros(self._cache.rows, width, dtype=torch.bool, device=self.device)
        positions = torch.zeros(hi - lo, width, dtype=torch.long, device=self.device)
        for state in self.lanes.values():
            if lo <= state.row < hi:
                start = len(state.columns)
                positions[state.row - lo] = torch.arange(start, start + width, device=self.device)
        for lane_id, tokens in feeds.items():
            row = self.lanes[lane_id].row
            input_ids[row - lo, : len(tokens)] = torch.tensor(tokens, device=self.device)
            new_mask[row, : len(tokens)] = True
        self._reserve(self._cache.rows, past + width)
        self._mask_buf[: self._cache.rows, past: past + width] = new_mask
        self._mask_bytes += new_mask.nbytes
        self._cache.window = (lo, hi)
        try:
            with lane_attention.lane_columns(self._row_columns(lo, hi, past, feeds)):
                hidden = self.model.get_decoder()(
                    input_ids=input_ids, attention_mask=self._mask_buf[lo:hi, : past + width], position_ids=positions,
                    past_key_values=self._cache, use_cache=True,
                ).last_hidden_state
        except BaseException:
            self._cache.set_length(past)  # layers that ran before the failure keep nothing
            raise
        finally:
            self._cache.window = None
        self._columns = past + width
        picked = []
        for (lane_id, tokens), keep in zip(feeds.items(), sizes):
            state = self.lanes[lane_id]
            state.columns.extend(range(past, past + len(tokens)))
            state.tokens.extend(tokens)
            picked.append(hidden[state.row - lo, len(tokens) - keep: len(tokens)])
        logits = self._logits(torch.cat(picked)).split(sizes)  # one output projection for every lane
        return dict(zip(feeds, logits))

    def _row_columns(self, lo: int, hi: int, past: int, feeds: dict[int, list[int]]) -> list[torch.Tensor]:
        """Per computed row, the cache columns its lane holds after this pass (what its attention reads)."""
        columns: list[list[int]] = [[] for _ in range(lo, hi)]
        for lane_id, state in self.lanes.items():
            if lo <= state.row < hi:
                fed = len(feeds.get(lane_id, ()))
                columns[state.row - lo] = state.columns + list(range(past, past + fed))
        return [torch.tensor(c or [past], dtype=torch.long, device=self.device) for c in columns]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    # -- housekeeping ----------------------------------------------------------------------------------------------
    def _add_row(self, src: int | None) -> int:
        """A new last row of the cache and mask: a copy of row ``src``, or empty (every column hidden)."""
        self._reserve(self._cache.rows + 1, self._columns)
        row = self._cache.add_row(src)
        self._mask_buf[row, : self._columns] = False if src is None else self._mask_buf[src, : self._columns]
        self._mask_bytes += self._columns
        return row

    def _reserve(self, rows: int, columns: int) -> None:
        """Grow the cache's capacity if needed, and the mask buffer with it (copying its used part)."""
        self._cache.reserve(rows, columns)
        cap_rows, cap_cols = self._cache.capacity
        if self._mask_buf.shape[0] < cap_rows or self._mask_buf.shape[1] < cap_cols:
            mask = torch.zeros(cap_rows, cap_cols, dtype=torch.bool, device=self.device)
            used = self._mask
            mask[: used.shape[0], : used.shape[1]] = used
            self._mask_bytes += used.nbytes
            self._mask_buf = mask

    def _reset(self) -> None:
        self._cache.reset()
        self._columns = 0
        self._mask_buf = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def _compact(self, min_columns: int = 256) -> None:
        """Drop the cache columns no lane holds (left by requests that ended) once they are half of the cache, so
        that a long-running engine's steps attend over the live requests' tokens only."""
        used = sorted({c for state in self.lanes.values() for c in state.columns})
        if self._columns < min_columns or len(used) * 2 > self._columns:
            return
        index = torch.tensor(used, dtype=torch.long, device=self.device)
        rows = self._cache.rows
        self._cache.keep_columns(index)
        self._mask_buf[:rows, : len(used)] = self._mask_buf[:rows, index]
        self._mask_bytes += rows * len(used)
        new_column = {c: i for i, c in enumerate(used)}
        for state in self.lanes.values():
            state.columns = [new_column[c] for c in state.columns]
        self._columns = len(used)

    def _crop_unused(self) -> None:
        """Drop trailing cache columns that no lane can see (each lane's columns ascend: its last is its highest)."""
        keep = max((state.columns[-1] + 1 for state in self.lanes.values() if state.columns), default=0)
        if keep < self._columns:
            self._columns = keep
            self._cache.set_length(keep)
