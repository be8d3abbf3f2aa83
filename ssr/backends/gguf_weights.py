"""Which copy of a GGUF file's weights llama.cpp runs: the file as it is, or its Q5_0 tensors rewritten as Q8_0.

Why: a Q5_0 block (a float16 scale ``d`` and 32 five-bit values ``q``, read as ``d * (q - 16)``) holds exactly the
values of a Q8_0 block with the same ``d`` and the 8-bit values ``q - 16``, so the rewrite loses nothing. ggml
quantises a matmul's activations to Q8_0 for both types and sums each block's integer products alike, so the
logits are the same bits from either file (measured with the AVX2 build on the embedded 0.5B, whose Q4_K_M file
is mostly Q5_0: prefills, 3 lanes of 2-32 rows, 64 greedy one-token steps, every logit equal;
tests/test_llama_cpp.py checks it). But llama.cpp's CPU backend repacks Q8_0 weights for its multi-row kernels
and has no such layout for Q5_0, so on an AVX2 Zen 2 with 2 threads the rewritten file stepped one row in 6-12%
less time, 2-16 rows in 11-22% less and a 300-token prefill in 20% less (docs/log.md). It is also
30% larger (637 MB against 491), and where memory bandwidth bounds a step the larger file could be slower: so
``weights_for`` measures both on the machine that runs them, at the thread count that will run, and keeps the
faster; the choice and the rewritten file are cached under ``$SSR_CACHE/gguf/`` (``SSR_RECALIBRATE=1`` measures
again).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import struct
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..models import cache_dir, write_cached

Q5_0_BLOCK = 22  # bytes: float16 d, 32 high bits, 16 bytes of low nibbles (values 0-15 | 16-31)
Q8_0_BLOCK = 34  # bytes: float16 d, 32 int8 values
REWRITE = "q5_0-as-q8_0"
MARGIN = 0.97  # the rewritten file is kept when its measured time is below this fraction of the original's


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (bytes, ``(rows, n * 22)``) as Q8_0 blocks of the same values (bytes, ``(rows, n * 34)``)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, Q5_0_BLOCK)
    high = blocks[:, 2:6].copy().view("<u4")  # bit j: value j's fifth bit (j < 16: low nibbles, else high)
    nibbles = blocks[:, 6:]
    bit = np.arange(16, dtype=np.uint32)
    low = (nibbles & 0x0F) | (((high >> bit) & 1) << 4).astype(np.uint8)
    top = (nibbles >> 4) | (((high >> (bit + 16)) & 1) << 4).astype(np.uint8)
    values = (np.concatenate([low, top], axis=1).astype(np.int16) - 16).astype(np.int8)
    return np.concatenate([blocks[:, :2], values.view(np.uint8)], axis=1).reshape(rows, -1)


def rewrite_q5_0(source: Path, target: Path) -> int:
    """Write ``source`` to ``target`` with every Q5_0 tensor as Q8_0, the metadata copied byte for byte and the
    other tensors as they are; returns how many tensors were rewritten (0: nothing written).

    The file is walked here rather than through gguf-py's reader, which decodes every metadata value (the 0.5B's
    151,646 vocabulary strings and merges: 50 s of its 60)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(source, dtype=np.uint8, mode="r")
    layout = _layout(data)
    q5, q8 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
    rewrites = sum(kind == q5 for _, _, kind, _ in layout.tensors)
    if not rewrites:
        return 0
    infos, sizes, offset = bytearray(), [], 0
    for name, dims, kind, _ in layout.tensors:
        block, size = GGML_QUANT_SIZES[q8 if kind == q5 else GGMLQuantizationType(kind)]
        sizes.append(int(np.prod(dims)) // block * size)
        infos += _string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        infos += struct.pack("<IQ", q8 if kind == q5 else kind, offset)
        offset += _aligned(sizes[-1], layout.alignment)
    with open(target, "wb") as out:
        out.write(data[:layout.metadata_end].tobytes())
        out.write(infos)
        out.write(bytes(_aligned(layout.metadata_end + len(infos), layout.alignment) - layout.metadata_end
                        - len(infos)))
        for (_, _, kind, start), size in zip(layout.tensors, sizes):
            begin = layout.data_start + start
            if kind == q5:
                blob = q5_0_as_q8_0(data[begin:begin + size // Q8_0_BLOCK * Q5_0_BLOCK].reshape(1, -1)).tobytes()
            else:
                blob = data[begin:begin + size].tobytes()
            out.write(blob + bytes(_aligned(size, layout.alignment) - size))
    return rewrites


def tensor_types(path: Path) -> Counter[str]:
    """How many tensors of each ggml type (``"Q5_0"``, ``"Q8_0"``, ...) the GGUF file at ``path`` holds."""
    from gguf import GGMLQuantizationType

    layout = _layout(np.memmap(path, dtype=np.uint8, mode="r"))
    return Counter(GGMLQuantizationType(kind).name for _, _, kind, _ in layout.tensors)


# GGUF value types (gguf.GGUFValueType) and the bytes of each fixed-size one
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _layout(data: np.ndarray) -> SimpleNamespace:
    """Where a GGUF file's metadata ends and its tensors lie: ``metadata_end`` (the header and key-values),
    ``tensors`` (name, dims, ggml type, offset into the data section), ``alignment``, ``data_start``."""
    head = data[:24].tobytes()
    magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
    if magic != b"GGUF" or version < 2:
        raise ValueError("not a GGUF file (version 2 or later)")
    pos, alignment = 24, 32
    raw = data.data  # a memoryview: struct reads it in place
    for _ in range(n_kv):
        key, pos = _read_string(raw, pos)
        (kind,) = struct.unpack_from("<I", raw, pos)
        if key == "general.alignment" and kind == _UINT32:
            (alignment,) = struct.unpack_from("<I", raw, pos + 4)
        pos = _skip_value(raw, pos + 4, kind)
    metadata_end, tensors = pos, []
    for _ in range(n_tensors):
        name, pos = _read_string(raw, pos)
        (n_dims,) = struct.unpack_from("<I", raw, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", raw, pos + 4)
        kind, offset = struct.unpack_from("<IQ", raw, pos + 4 + 8 * n_dims)
        tensors.append((name, dims, kind, offset))
        pos += 4 + 8 * n_dims + 12
    return SimpleNamespace(metadata_end=metadata_end, tensors=tensors, alignment=alignment,
                           data_start=_aligned(pos, alignment))


def _read_string(raw: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", raw, pos)
    return bytes(raw[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _string(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return struct.pack("<Q", len(encoded)) + encoded


def _skip_value(raw: memoryview, pos: int, kind: int) -> int:
    """The position after a metadata value of type ``kind`` at ``pos``."""
    if kind == _STRING:
        return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
    if kind == _ARRAY:
        item, n = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        if item in _FIXED:
            return pos + n * _FIXED[item]
        for _ in range(n):
            pos = _skip_value(raw, pos, item)
        return pos
    return pos + _FIXED[kind]


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _file_id(path: Path) -> str:
    """The file by path, size and modification time (hashing 0.5-2 GB of weights would cost seconds a load)."""
    stat = path.resolve().stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def rewritten(source: Path) -> Path | None:
    """``source`` with its Q5_0 tensors as Q8_0, written once under ``$SSR_CACHE/gguf/``; None where it has none."""
    target = cache_dir() / "gguf" / f"{source.stem}-{_file_id(source)}.{REWRITE}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    try:
        if not rewrite_q5_0(source, partial):
            return None
        os.replace(partial, target)  # whole or absent: another process may be writing the same file
    finally:
        partial.unlink(missing_ok=True)
    return target


def faster(original: Path, candidate: Path, seconds: Callable[[Path], float],
           rounds: int = 3) -> tuple[Path, dict[str, list[float]]]:
    """The file whose median ``seconds`` is lower, the two measured alternately (drift hits both alike; the
    candidate must win by ``MARGIN``), and every round's seconds (``"as-is"``, ``REWRITE``)."""
    times: dict[str, list[float]] = {"as-is": [], REWRITE: []}
    order = [("as-is", original), (REWRITE, candidate)]
    for r in range(rounds):
        for name, path in order if r % 2 == 0 else order[::-1]:
            times[name].append(seconds(path))
    wins = statistics.median(times[REWRITE]) < MARGIN * statistics.median(times["as-is"])
    return (candidate if wins else original), times


def weights_for(source: Path, seconds: Callable[[Path], float], key: dict) -> Path:
    """The weights file to load for ``source``: its Q8_0 rewrite where it has Q5_0 tensors and measures faster
    here (``seconds(path)``: one round of typical steps on that file), else ``source``. The choice is cached per
    ``key`` (machine, thread count, build) and file; a rewrite not chosen is deleted (it would only take disk)."""
    fields = {"file": _file_id(source), "rewrite": REWRITE, **key}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    record = cache_dir() / "gguf" / f"{source.stem}-{digest}.choice.json"
    refresh = os.environ.get("SSR_RECALIBRATE", "") not in ("", "0")
    if record.exists() and not refresh:
        try:
            chosen = json.loads(record.read_text())["weights"]
            if chosen == "as-is":
                return source
            if Path(chosen).exists():
                return Path(chosen)
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: choose again
    candidate = rewritten(source)
    if candidate is None:
        chosen_path = source
    else:
        started = time.perf_counter()
        chosen_path, times = faster(source, candidate, seconds)
        if chosen_path == source:
            candidate.unlink(missing_ok=True)
        fields["round_seconds"] = {name: [round(t, 4) for t in ts] for name, ts in times.items()}  # to look at
        fields["measured_seconds"] = round(time.perf_counter() - started, 1)
    write_cached(record, json.dumps({**fields, "weights": "as-is" if chosen_path == source else str(chosen_path)}))
    return chosen_path
