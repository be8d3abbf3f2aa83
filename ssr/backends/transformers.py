"""In-process PyTorch backend: every live lane is one row of one batched KV cache.

Rows grow in lock-step (one ``DynamicCache``), so a lane that is fed fewer tokens than another in the same pass gets
padding columns that its attention mask hides; rejected proposals are hidden the same way. Each lane keeps the cache
columns that hold its tokens, and position ids are explicit, so a row's holes never shift its positions. Trailing
columns that no row uses are cropped, which keeps the single-lane answer phase hole-free.

Between requests the last request's main lane stays parked: the next request whose prompt extends it (an agent's
next step: same conversation plus a tool result) starts from that cache and prefills only the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from .base import Backend, stop_token_ids

SKINNY_ROWS = 32  # up to this many rows, a CPU linear layer runs as one weight-stationary product (see below)


def _skinny_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` computed as ``(W @ x.T).T`` for a few rows.

    On CPU, ``F.linear`` with 2-32 rows costs about one pass over the weights per row, so a draft lane doubled the
    cost of a thinking step; ``W @ x.T`` reads the weights once for all rows (measured on the default model, 2 CPU
    cores: one MLP projection 3.5 ms -> 1.4 ms at 2 rows, 1.5 ms at 1 row either way). Plain decoding and SSR run
    the same layers, so the comparison between them stays fair.
    """
    rows = x.numel() // x.shape[-1]
    if rows > SKINNY_ROWS:
        return F.linear(x, layer.weight, layer.bias)
    y = torch.mm(layer.weight, x.reshape(rows, x.shape[-1]).T).T
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], layer.weight.shape[0])


@dataclass
class _Lane:
    row: int
    columns: list[int] = field(default_factory=list)  # cache column of each of the lane's tokens, in order
    tokens: list[int] = field(default_factory=list)


class TransformersBackend(Backend):
    def __init__(self, model, model_name: str, eos_token_ids, pad_token_id: int) -> None:
        self.model = model.eval()
        self.model_name = model_name
        self.config = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_window = int(getattr(model.config, "max_position_embeddings", 32768))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self._lanes: dict[int, _Lane] = {}
        self._next_id = 0
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [rows, columns]: 1 = visible
        self._softcap = getattr(model.config, "final_logit_softcapping", None)
        self._parked: int | None = None  # lane kept from the previous request for prefix reuse
        if self.device.type == "cpu":
            for layer in self.model.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.forward = partial(_skinny_linear, layer)

    @classmethod
    def load(cls, path: str, model_name: str, dtype: str | torch.dtype | None = None, device: str | None = None,
             **model_kwargs) -> "TransformersBackend":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        configs = (model.generation_config, model.config)
        eos = stop_token_ids(tokenizer, *(getattr(config, "eos_token_id", None) for config in configs))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        backend = cls(model, model_name, eos, pad)
        backend.tokenizer = tokenizer
        return backend

    # -- lanes -------------------------------------------------------------------------------------------------
    def new_lane(self, prefix: list[int] | None = None) -> int:
        """A lane for a new request; it already holds the longest cached prefix of ``prefix`` (see ``length``)."""
        parked, self._parked = self._parked, None
        if parked is not None and prefix:
            held = self._lanes[parked].tokens
            common = 0
            while common < min(len(held), len(prefix)) and held[common] == prefix[common]:
                common += 1
            if common:
                self.truncate(parked, common)
                return parked
        if self._lanes:
            self.release_all()
        return self._add(_Lane(row=0))

    def park(self, lane: int) -> None:
        """Free every lane but ``lane``, and keep it for the next request's prefix."""
        for other in [i for i in self._lanes if i != lane]:
            self.release(other)
        self._parked = lane

    def fork(self, parent: int) -> int:
        src = self._lanes[parent]
        row = len(self._lanes)
        if self._cache is not None:
            for layer in self._cache.layers:
                layer.keys = torch.cat([layer.keys, layer.keys[src.row: src.row + 1]])
                layer.values = torch.cat([layer.values, layer.values[src.row: src.row + 1]])
        self._mask = torch.cat([self._mask, self._mask[src.row: src.row + 1]])
        return self._add(_Lane(row=row, columns=list(src.columns), tokens=list(src.tokens)))

    def release(self, lane: int) -> None:
        gone = self._lanes.pop(lane)
        if not self._lanes:
            self._reset()
            return
        keep = [r for r in range(self._mask.shape[0]) if r != gone.row]
        index = torch.tensor(keep, device=self.device)
        if self._cache is not None:
            self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        for other in self._lanes.values():
            if other.row > gone.row:
                other.row -= 1
        self._crop_unused()

    def release_all(self) -> None:
        self._lanes.clear()
        self._parked = None
        self._reset()

    def length(self, lane: int) -> int:
        return len(self._lanes[lane].columns)

    def truncate(self, lane: int, length: int) -> None:
        state = self._lanes[lane]
        dropped = state.columns[length:]
        if dropped:
            self._mask[state.row, dropped] = 0
            del state.columns[length:]
            del state.tokens[length:]
            self._crop_unused()

    @property
    def live_lanes(self) -> int:
        return len(self._lanes)

    # -- the batched forward pass --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        want = want or {}
        rows = self._mask.shape[0]
        width = max(len(tokens) for tokens in feeds.values())
        past = self._mask.shape[1]
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long, device=self.device)
        new_mask = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for lane_id, state in self._lanes.items():
            start = len(state.columns)
            positions[state.row] = torch.arange(start, start + width)
            tokens = feeds.get(lane_id, [])
            if tokens:
                input_ids[state.row, : len(tokens)] = torch.tensor(tokens)
                new_mask[state.row, : len(tokens)] = 1
        if self._cache is None:
            from transformers import DynamicCache

            self._cache = DynamicCache(config=self.config)
        mask = torch.cat([self._mask, new_mask], dim=1)
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state
        self._mask = mask
        picked, sizes = [], []
        for lane_id, tokens in feeds.items():
            state = self._lanes[lane_id]
            state.columns.extend(range(past, past + len(tokens)))
            state.tokens.extend(tokens)
            keep = want.get(lane_id, len(tokens))
            picked.append(hidden[state.row, len(tokens) - keep: len(tokens)])
            sizes.append(keep)
        logits = self._logits(torch.cat(picked)).split(sizes)  # one output projection for every lane
        return dict(zip(feeds, logits))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    # -- housekeeping ----------------------------------------------------------------------------------------------
    def _add(self, lane: _Lane) -> int:
        lane_id = self._next_id
        self._next_id += 1
        self._lanes[lane_id] = lane
        if lane.row >= self._mask.shape[0]:
            self._mask = torch.cat([self._mask, torch.zeros(1, self._mask.shape[1], dtype=torch.long)])
        return lane_id

    def _reset(self) -> None:
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def _crop_unused(self) -> None:
        """Drop trailing cache columns that no lane can see."""
        used = self._mask.any(dim=0).nonzero()
        keep = int(used[-1]) + 1 if used.numel() else 0
        extra = self._mask.shape[1] - keep
        if extra > 0 and self._cache is not None:
            self._cache.crop(-extra)
            self._mask = self._mask[:, :keep]
