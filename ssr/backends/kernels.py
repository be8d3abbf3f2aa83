"""CPU linear-layer kernels, and the measurement that picks one per row count on the machine it runs on.

Which product is fastest for a few rows differs between CPUs and BLAS builds by 2x (docs/design.md, the cost model: a
2-row step cost 2.25x a 1-row step with the weight-stationary product on an Intel Xeon and 1.04x with ``F.linear``; on
an AMD EPYC the other way round), so nothing is built in: ``time_kernels`` times each kernel on the model's own
weights and ``choose_kernels`` turns the timings into a ``(max_rows, kernel)`` table that ``KernelChoice`` dispatches
on.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch
import torch.nn.functional as F


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The library's product: about one pass over the weights per row on some CPUs for 2-32 rows."""
    return F.linear(x, weight, bias)


def _stationary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(W @ x.T).T``: the weights are read once for all rows (faster for a few rows on some CPUs, slower on
    others). A single row is padded to two: some BLAS builds run a one-column product as a matrix-vector kernel
    that is slower than their two-column matrix product (MKL on an AMD EPYC, 2 cores: a 4864x896 projection
    1.25 ms for one row, 0.55 ms for two). The result is made contiguous: SDPA rejects its flash kernel for a query
    whose last dimension is strided, and its math fallback copies the cache for every head."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        y = torch.mm(weight, F.pad(x2, (0, 0, 0, 1)).T)[:, 0].contiguous()
    else:
        y = torch.mm(weight, x2.T).T.contiguous()
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product, on the weights as stored or on ``pack``'s blocked copy (kernel "packed"). MKL's few-row
    products are slow on some CPUs that oneDNN dispatches well (an AMD EPYC, one thread, a 8960x1536 projection:
    1/2/16 rows 4.0/8.6/14.4 ms with ``F.linear``, 3.7/5.1/9.0 ms here, 3.4/4.2/5.3 ms packed)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _has_onednn() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):  # a build without oneDNN's CPU ops
        return False


PACK_ROWS = 4  # the row count oneDNN blocks a packed weight for; fewer rows are padded to it
PACKED = "packed"  # the kernel on packed weights: a whole-model choice, since a packed layer keeps no plain weight


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_onednn`` on a packed weight, fewer than ``PACK_ROWS`` rows padded to it: oneDNN's one- and two-row
    paths are slower than its four-row one (AMD EPYC, one thread, the 0.5B's linear layers: 1/2/4 rows 127/176/98
    ms a pass)."""
    rows = x.numel() // x.shape[-1]
    if rows >= PACK_ROWS:
        return _onednn(x, weight, bias)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, PACK_ROWS - rows))
    return _onednn(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout (same size; only ``_onednn`` can use it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


KERNELS: dict[str, Callable] = {"linear": _linear, "stationary": _stationary}
if _has_onednn():
    KERNELS.update(onednn=_onednn, packed=_packed)
DEFAULT_KERNELS: list[tuple[int | None, str]] = [(None, "linear")]  # (max rows or None for no limit, kernel)
SELECT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 256)  # 256: a prefill's products
MEASURE_BYTES = 32 << 20  # weights timed per shape and pass: more than a cache holds, so they stream as in a forward


class KernelChoice:
    """The per-row-count kernel table, shared by every patched layer of one model; counts calls (for tests)."""

    def __init__(self) -> None:
        self.by_rows: list[tuple[str, Callable]] = []  # index: row count
        self.beyond: tuple[str, Callable] = ("linear", _linear)
        self.calls: collections.Counter[str] = collections.Counter()

    def set(self, table: list[tuple[int | None, str]]) -> None:
        if any(k == PACKED for _, k in table) and len(table) != 1:
            raise ValueError(f"kernel table {table!r}: {PACKED!r} is for every row count or none")
        limits = [0 if m is None else m for m, _ in table[:-1]]  # None before the end is as wrong as 0
        if not table or table[-1][0] is not None or any(m < 1 for m in limits) \
                or limits != sorted(set(limits)) or any(k not in KERNELS for _, k in table):
            raise ValueError(f"kernel table {table!r}: want ascending (max_rows, kernel) ranges ending in "
                             f"(None, kernel), kernels from {sorted(KERNELS)}")
        by_rows, n = [("linear", _linear)], 1  # row 0 never occurs
        for limit, (_, name) in zip(limits, table[:-1]):
            by_rows += [(name, KERNELS[name])] * (limit - n + 1)
            n = limit + 1
        self.by_rows, self.beyond = by_rows, (table[-1][1], KERNELS[table[-1][1]])

    def __call__(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        name, kernel = self.by_rows[rows] if rows < len(self.by_rows) else self.beyond
        self.calls[name] += 1
        return kernel(x, layer.packed_weight if name == PACKED else layer.weight, layer.bias)


def kernel_ranges(table: list[tuple[int | None, str]]) -> list[tuple[str, str]]:
    """``[("1", "linear"), ("2-4", "stationary"), ("5+", "linear")]``: a kernel table as row ranges, for reports."""
    out, low = [], 1
    for limit, name in table:
        out.append((f"{low}+" if limit is None else str(low) if limit == low else f"{low}-{limit}", name))
        low = (limit or 0) + 1
    return out


def _ranges(best: dict[int, str]) -> list[tuple[int | None, str]]:
    """Per measured row count the fastest kernel -> ascending ranges; a row count between two measured ones takes
    the next measured one's choice; beyond the largest, the largest's (``SELECT_ROWS`` ends at a prefill's size)."""
    table: list[tuple[int | None, str]] = []
    for n in sorted(best):
        if table and table[-1][1] == best[n]:
            table[-1] = (n, best[n])
        else:
            table.append((n, best[n]))
    if table:
        table[-1] = (None, table[-1][1])
    return table or [(None, "linear")]


def choose_kernels(timings: dict[str, dict[int, float]], margin: float = 0.05) -> list[tuple[int | None, str]]:
    """Per row count the fastest kernel of ``timings`` (``{kernel: {rows: seconds}}``), as a ranges table. Noise on
    a shared machine must not flip choices: a kernel within ``margin`` of the fastest counts as fast, and among those
    ``F.linear`` (the library's default) is preferred, then the previous row count's choice. Packed weights serve
    every row count or none: they are chosen where they are fast for one row (plain decoding) and, over all
    measured row counts together, no slower than the best kernel per row count (a noisy point does not decide)."""
    timings = dict(timings)
    packed = timings.pop(PACKED, None)
    if packed and timings:
        fastest = {n: min(per[n] for per in timings.values() if n in per) for n in packed}
        if packed[min(packed)] <= fastest[min(packed)] * (1 + margin) \
                and sum(packed.values()) <= sum(fastest.values()) * (1 + margin):
            return [(None, PACKED)]
    best, previous = {}, "linear"
    for n in sorted({n for per_rows in timings.values() for n in per_rows}):
        times = {name: t[n] for name, t in timings.items() if n in t}
        fast = [name for name, t in times.items() if t <= min(times.values()) * (1 + margin)]
        best[int(n)] = previous = next((k for k in ("linear", previous) if k in fast), min(fast, key=times.__getitem__))
    return _ranges(best)


@torch.no_grad()
def time_kernels(model, dtype, rows=SELECT_ROWS, reps: int = 3, progress: bool = False) -> dict[str, dict[int, float]]:
    """Seconds per forward pass spent in linear layers, per kernel and row count: each distinct weight shape is
    timed on enough of its own weights (``MEASURE_BYTES``) to stream from memory as in a real pass, and scaled
    by how many weights of that shape a pass uses. Kernels and row counts interleave; of ``reps`` runs the
    fastest counts (the least disturbed by other load)."""
    groups: dict[tuple, list[torch.nn.Linear]] = collections.defaultdict(list)
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            groups[(*layer.weight.shape, layer.bias is not None)].append(layer)
    samples = []  # (scale, [(weight, bias)])
    for layers in groups.values():
        w = layers[0].weight
        per_weight = w.nbytes
        take = min(len(layers), max(1, -(-MEASURE_BYTES // per_weight)))
        if take == 1 and per_weight > MEASURE_BYTES:  # one huge matrix (the output projection): a row slice
            cut = max(1, MEASURE_BYTES // (w.shape[1] * w.element_size()))
            b = layers[0].bias
            samples.append((len(layers) * w.shape[0] / cut, [(w[:cut], None if b is None else b[:cut])]))
        else:
            samples.append((len(layers) / take, [(m.weight, m.bias) for m in layers[:take]]))
    inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for _, ws in samples for w, _ in ws}
              for n in rows}
    packed = {id(w): pack(w) for _, ws in samples for w, _ in ws} if PACKED in KERNELS else {}
    names = list(KERNELS)

    def one_pass(name: str, n: int) -> float:
        kernel, total = KERNELS[name], 0.0
        for scale, weights in samples:
            t0 = time.perf_counter()
            for w, b in weights:
                kernel(inputs[n][w.shape[1]], packed[id(w)] if name == PACKED else w, b)
            total += scale * (time.perf_counter() - t0)
        return total

    for name in names:  # warm-up: first calls set up the library's kernels
        one_pass(name, rows[0])
        one_pass(name, rows[-1])
    seconds: dict[str, dict[int, list[float]]] = {name: collections.defaultdict(list) for name in names}
    bar = _progress(progress, reps * len(rows), "timing linear kernels")
    for rep in range(reps):
        for n in rows:
            for i in range(len(names)):
                name = names[(i + rep) % len(names)]  # rotate the order so drift hits every kernel alike
                seconds[name][n].append(one_pass(name, n))
            bar.update()
    bar.close()
    return {name: {n: min(ts) for n, ts in per.items()} for name, per in seconds.items()}


def _progress(enabled: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)
