"""The lossless Q5_0 -> Q8_0 rewrite of GGUF weights (``ssr.backends.gguf_weights``) and its cached, measured choice.

On small GGUF files written here with gguf-py: metadata and other tensors unchanged, each Q5_0 tensor's values
unchanged as Q8_0. On the real embedded model, llama.cpp's logits from both files: tests/test_llama_cpp.py."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from ssr.backends import gguf_weights as W

Q = gguf.GGMLQuantizationType


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], alignment: int | None = None) -> Path:
    """A GGUF file with a few kinds of metadata (a string array like a vocabulary) and ``tensors`` quantised."""
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_token_list([f"tok{i}\u00e9" for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    if alignment:
        writer.add_custom_alignment(alignment)
    for name, (values, kind) in tensors.items():
        data = values if kind == Q.F32 else gguf.quants.quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    rng = np.random.default_rng(seed)
    return {"a.weight": (rng.standard_normal((8, 64)).astype(np.float32), Q.Q5_0),
            "b.weight": (rng.standard_normal((3, 96)).astype(np.float32), Q.Q8_0),
            "norm": (rng.standard_normal(96).astype(np.float32), Q.F32),
            "c.weight": (rng.standard_normal((5, 32)).astype(np.float32) * 1e-3, Q.Q5_0)}


@pytest.mark.parametrize("alignment", [None, 64])
def test_q5_0_tensors_become_q8_0_with_the_same_values_and_the_rest_is_unchanged(tmp_path, alignment):
    source = _write(tmp_path / "m.gguf", _tensors(), alignment)
    target = tmp_path / "m.q8.gguf"
    assert W.rewrite_q5_0(source, target) == 2
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(target)
    assert {f.name: f.contents() for f in before.fields.values()} == \
        {f.name: f.contents() for f in after.fields.values()}
    assert [t.name for t in before.tensors] == [t.name for t in after.tensors]
    for old, new in zip(before.tensors, after.tensors):
        assert list(old.shape) == list(new.shape)
        if old.tensor_type == Q.Q5_0:
            assert new.tensor_type == Q.Q8_0
            assert np.array_equal(gguf.quants.dequantize(np.asarray(old.data), Q.Q5_0),
                                  gguf.quants.dequantize(np.asarray(new.data), Q.Q8_0))
        else:
            assert new.tensor_type == old.tensor_type and np.array_equal(np.asarray(old.data), np.asarray(new.data))
    assert W.tensor_types(source) == {"Q5_0": 2, "Q8_0": 1, "F32": 1}
    assert W.tensor_types(target) == {"Q8_0": 3, "F32": 1}


def test_every_five_bit_value_maps_to_its_eight_bit_value():
    """All 32 values in every position of a block, under two scales: the bit layout, not just random data."""
    values = np.tile(np.arange(-16, 16, dtype=np.float32), (2, 1))
    values[1] *= 0.5  # scales 1 and 0.5 (the value of largest magnitude is -16 d): every value exact in Q5_0
    rolled = np.stack([np.roll(values[i % 2], i) for i in range(32)])
    raw = gguf.quants.quantize(rolled, Q.Q5_0)
    assert np.array_equal(gguf.quants.dequantize(W.q5_0_as_q8_0(raw), Q.Q8_0), rolled)


def test_a_file_without_q5_0_is_not_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("SSR_CACHE", str(tmp_path / "cache"))
    source = _write(tmp_path / "m.gguf", {"b.weight": _tensors()["b.weight"]})
    assert W.rewrite_q5_0(source, tmp_path / "out.gguf") == 0 and not (tmp_path / "out.gguf").exists()
    assert W.rewritten(source) is None
    calls: list[Path] = []
    assert W.weights_for(source, lambda p: calls.append(p) or 1.0, {"threads": 1}) == source and calls == []


@pytest.mark.parametrize("rewrite_seconds, keeps_rewrite", [(0.8, True), (0.99, False), (1.2, False)])
def test_the_choice_is_measured_once_and_cached(tmp_path, monkeypatch, rewrite_seconds, keeps_rewrite):
    """The rewrite is kept only where its round is at least 3% faster; the next load reads the choice (no
    measurement); a rewrite not chosen is deleted; another key (thread count) or SSR_RECALIBRATE measures again."""
    monkeypatch.setenv("SSR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SSR_RECALIBRATE", raising=False)
    source = _write(tmp_path / "m.gguf", _tensors())
    calls: list[Path] = []

    def seconds(path: Path) -> float:
        calls.append(path)
        return 1.0 if path == source else rewrite_seconds

    chosen = W.weights_for(source, seconds, {"threads": 2})
    assert len(calls) == 6 and calls.count(source) == 3  # three rounds, alternating
    assert (chosen != source) == keeps_rewrite and chosen.exists()
    assert W.tensor_types(chosen) == ({"Q8_0": 3, "F32": 1} if keeps_rewrite else {"Q5_0": 2, "Q8_0": 1, "F32": 1})
    assert len(list((tmp_path / "cache" / "gguf").glob("*.q5_0-as-q8_0.gguf"))) == int(keeps_rewrite)
    record, = (tmp_path / "cache" / "gguf").glob("*.choice.json")
    assert json.loads(record.read_text())["round_seconds"] == {"as-is": [1.0] * 3, W.REWRITE: [rewrite_seconds] * 3}
    assert W.weights_for(source, seconds, {"threads": 2}) == chosen and len(calls) == 6
    W.weights_for(source, seconds, {"threads": 1})
    assert len(calls) == 12
    monkeypatch.setenv("SSR_RECALIBRATE", "1")
    assert W.weights_for(source, seconds, {"threads": 2}) == chosen and len(calls) == 18
