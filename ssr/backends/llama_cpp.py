"""llama.cpp backend (``llama-cpp-python``): SSR on the engine local users already run, on their GGUF file.

Why: on CPU, llama.cpp decodes the embedded Q4_K_M model about 2x faster than the transformers backend in float32,
and its batched API fits SSR's lanes one to one:

* A lane is a llama.cpp *sequence* (a seq id) in ONE context with a unified KV cache (``kv_unified``): a ``step``
  decodes a ``llama_batch`` holding each fed lane's tokens under its seq id, with the logits flag set only on the
  positions whose rows are wanted; those rows are copied out of ``llama_get_logits`` as float32 torch tensors (the
  full vocabulary, so greedy decoding and sampling both see exactly what llama.cpp computed).
* ``fork`` is ``llama_memory_seq_cp``: in a unified cache the child's cells ARE the parent's (a cell carries a set
  of seq ids), so a fork copies no data. ``truncate`` is ``llama_memory_seq_rm`` from the cut on; ``release``
  removes the whole sequence and frees its seq id.
* Exactness. llama.cpp's CPU kernels are not batch-invariant: from 2 rows of a decode on, matmuls take other
  kernels (llamafile's sgemm for the f16 attention products, repacked gemm for each group of 4 rows), and flash
  attention splits a one-row decode's keys across threads, so a position's logits differ (by up to ~0.4 on the
  embedded model) with the number of rows computed with it. Multi-row decodes are what lets speculation pay here
  (16 tokens in one decode cost 5.3 steps on a compute-bound 2-core CPU, far less on others), so ``exact=False``
  puts the whole step in one decode: SSR's greedy tokens then equal plain decoding's up to a near-tie, a position
  where SSR's token lies within twice the kernel noise that calibration measures (``ssr.calibrate.measure_noise``)
  of plain's, where either token is the model's (``ssr.agreement``). ``exact=True`` keeps bitwise identity
  instead, and is the default (``exact=None``) on a build with the script's patches whose matmuls run SSR's rows
  kernels (``_rows_kernels``): on SSR's AVX-512 layout where the CPU has AVX-512 VNNI (AMX tiles too where it has
  AMX), on ggml's own layout elsewhere on x86 (patch 0007: AVX2).
  On the build scripts/install_llama_cpp.sh makes, flash attention is switched to SSR's kernel for exact mode (each
  query row over its own keys in cache order, whatever the batch and wherever those keys lie: the script's
  ``ssr_attention.h``; ggml's reference path for models it does not cover) and the weights stay in the AMX layout
  on a build with SSR's rows kernels (SSR's
  VNNI kernels, which the script adds, run every batch, and give each row the bits ggml's one-row kernel gives it;
  ggml's AMX tiles, with ``SSR_AMX_VNNI_ROWS``, do too) or in the plain layout elsewhere (no repacking): then
  every row's logits are the same bits in any decode (measured: 2-32 rows, lanes side by side, prompts prefilled
  in other splits, 64-2000 cached tokens; no KV cell is freed while another lane is live, see ``_retire``), so
  exact mode keeps the multi-row decodes and their cost.
  On other builds, every wanted row (and each lane's last fed token) goes in decodes of at most ``EXACT_ROWS`` rows,
  which gives the one-row kernels' bits but costs about a step per verified token, so SSR rarely speculates there.

The weights: the file as it is, or, where it measures faster on this machine, a copy whose Q5_0 tensors are
rewritten as Q8_0 blocks of the same values (``ssr.backends.gguf_weights``). In the multi-row mode llama.cpp repacks
Q8_0 for its multi-row kernels and computes the same bits from both files (measured: prefills, 3 lanes of 2-16 rows,
one-token steps), so only the time changes (on an AVX2 Zen 2, 6-12% off a one-token step, 12-15% off 4 rows, 20%
off a prefill). In exact mode on the AMX layout the Q8_0 tensors go through SSR's VNNI kernels, which keep every row
bitwise in any batch, where ggml's Q5_0 kernels ran before (on the AMX Xeon: 30% off a one-token step, 34-36% off
4-16 rows, 52% off a prefill); on ggml's layout SSR's x86 rows kernels take Q8_0 too, and the choice is measured
in exact mode.
``weights_path`` is the file loaded, ``model_path`` the one named (the benchmark's peers run that one).

What a step costs here differs from the transformers backend (on one CPU core every extra row costs about a whole
step), which is why ``ssr.calibrate`` measures it like any backend; the cache key carries the GGUF file type, the
thread count and the mode (``dtype``, ``device``). Measurements: docs/backends/llama-cpp.md.

The tokenizer is a Hugging Face tokenizer (the engine's chat templates and grammars need one): for the embedded
default, the same one the transformers backend uses; for another GGUF file, the one transformers reads out of the
GGUF (or ``tokenizer=`` a directory). Loading checks that it encodes like llama.cpp's own vocabulary.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..calibrate import _cpuinfo, dummy_ids, machine
from ..models import EMBEDDED_MODELS, canonical_name, embedded_files, embedded_tokenizer, gguf_file, read_config
from . import llama_log
from .base import Backend, Lane, rows_wanted, stop_token_ids
from .errors import LlamaCppError
from .gguf_weights import REWRITE, rewritten, tensor_types, weights_for

DEFAULT_N_SEQ_MAX = 32  # lanes live at once (every request's thinking lane and drafts)
# KV cells shared by every lane (forked lanes share their prefix's cells) and the parked lanes of finished requests:
# exact mode takes a new cell for every token while any lane is live, so a session's prefix cache lasts about twice
# as many requests as with 16384 (0.9 GB of f16 keys and values for the 1.5B, 0.4 GB for the 0.5B)
DEFAULT_N_CTX = 32768
# llama.cpp's CPU matmuls take another kernel from 4 rows of a ubatch on (repacked weights: gemm for each group of
# 4 rows, gemv for the rest), which changes the logits by up to ~0.4; with at most 3 rows per decode every row is
# bitwise what a one-token decode computes (measured on the embedded model: verification of 2-24 rows, lanes
# stepped together, lanes alone after others were released). Builds without the attention patch only (below).
EXACT_ROWS = 3
_PROBE = "def add(a, b):\n    return a + b  # <|im_start|>user\nHello, 世界! 123"


def _hf_tokenizer(gguf: Path, model_name: str | None, model_path: str | None, tokenizer):
    """The Hugging Face tokenizer for ``gguf`` (see the module docstring) and the directory it came from."""
    source = model_path if model_path and Path(model_path).is_dir() else None
    if tokenizer is None and source is None and model_name and canonical_name(model_name) in EMBEDDED_MODELS:
        source = str(embedded_files(canonical_name(model_name)))
        return embedded_tokenizer(source), source
    from transformers import AutoTokenizer

    if tokenizer is not None:  # named by the caller: a tokenizer, or where one is (an error if it is not there)
        if not isinstance(tokenizer, (str, os.PathLike)):
            return tokenizer, None
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True), str(tokenizer)
    if source is not None and (Path(source) / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(source, local_files_only=True), str(source)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True), None


@dataclass
class _Lane(Lane):
    seq: int  # llama.cpp sequence id


class LlamaCppBackend(Backend[_Lane]):
    """``Backend`` over one llama.cpp context: lanes are sequences of a unified KV cache.

    ``n_seq_max``: lanes live at once; ``n_ctx``: KV cells for all lanes together (forks share their prefix);
    ``n_threads``: llama.cpp's threads (default: torch's thread count, so ``ssr bench --threads`` applies);
    ``n_batch``: tokens per ``llama_decode`` (longer feeds are split); ``exact``: bitwise the rows one-row decodes
    compute (default None: True on a build with SSR's rows kernels and scripts/install_llama_cpp.sh's patches, an
    AVX-512 VNNI CPU, where it costs what the multi-row mode costs; else False, one multi-row decode a step with
    near-ties; see the module docstring); ``repack``: llama.cpp's CPU weight repacking and, on a build with SSR's
    rows kernels, the AMX weight layout (in exact mode: the AMX layout on such a build with the attention patch,
    the repacking where exact mode splits rows); ``verbose``: llama.cpp's own log lines (``llama_log``; errors are
    always shown); ``tokenizer``: a Hugging Face tokenizer or the directory of one (default: see the module
    docstring); ``q5_0_as_q8_0``: load
    the file's Q5_0 tensors rewritten as Q8_0 (the same values: ``ssr.backends.gguf_weights``; default None: where
    that measures faster on this machine, in the multi-row mode and in exact mode on the AMX layout; exact mode on
    the plain layout loads the file as it is, its bitwise promise measured on those kernels only).
    """

    # part of the cost table's cache key: tables measured while a second OpenMP team slowed every step (before
    # calibration ran on a thread of its own, ssr.threads; its barrier waits weigh most on one-row steps) are stale
    cost_version = "one-openmp-team"
    # a new request forks a live lane sharing this much of its prompt (its system prompt), as on transformers: a
    # fork shares the parent's cells. Without it, requests arriving together each prefilled the shared prompt again
    # (HumanEval's 177 shared tokens, 4 s a request on an AVX2 EPYC; 8 at once ran 1.4x slower than one by one)
    min_shared = 16

    def __init__(self, model_path: str, model_name: str | None = None, *, n_seq_max: int = DEFAULT_N_SEQ_MAX,
                 n_ctx: int = DEFAULT_N_CTX, n_threads: int | None = None, n_batch: int = 512,
                 n_ubatch: int | None = None, exact: bool | None = None, repack: bool = True, tokenizer=None,
                 q5_0_as_q8_0: bool | None = None, verbose: bool = False) -> None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ImportError("backend 'llama.cpp' needs llama-cpp-python: bash scripts/install_llama_cpp.sh "
                              "(pip install 'ssr[llamacpp]' with the build flags it documents)") from exc
        super().__init__()
        self._ll = ll = llama_cpp
        llama_log.install(ll, verbose)
        gguf = gguf_file(model_name, model_path)
        self.model_path = str(gguf)
        self.model_name = model_name or gguf.stem
        if not 1 <= n_seq_max < ll.llama_max_parallel_sequences():
            raise ValueError(f"n_seq_max must be in 1..{ll.llama_max_parallel_sequences() - 1}, got {n_seq_max}")
        self.n_threads = int(n_threads or torch.get_num_threads())
        self.n_seq_max, self.n_batch = int(n_seq_max), int(min(n_batch, n_ctx))
        ll.llama_backend_init()
        built_with = _kernels(ll)
        library = _cpu_library(ll)
        rows_kernels = _rows_kernels(built_with, gguf, library.x86_rows)
        # exact=None: bitwise where that costs what the multi-row mode costs: a build whose matmuls run SSR's rows
        # kernels (on SSR's AVX-512 layout, with or without AMX, or on ggml's layout with AVX2) and whose attention
        # has SSR's patch; elsewhere exact mode splits rows, so the multi-row mode with its near-tie promise is the
        # default
        self.exact = self.row_exact = (bool(exact) if exact is not None
                                       else bool(rows_kernels) and library.reference_attention)
        # finished requests' lanes kept for later prompts that start with their tokens (an agent's next step extends
        # its last one; its conversations share the system prompt and tools): a fork shares the parked lane's cells.
        # Exact mode keeps 16 (half the default n_seq_max; a running request's new lane takes a parked lane's id if
        # needed): its attention skips the cells a row does not attend at a few instructions per 32 rows. The
        # multi-row mode's (ggml's) reads every cell of the cache for every row and head, so there parked lanes slow
        # every step (12 of 800 tokens: a one-token step of the 0.5B 24.5 -> 28.5 ms, a 400-token prefill 839 ->
        # 1359 ms): it keeps one
        self.max_parked = 16 if self.exact else 1
        # exact mode on a build whose attention can compute every row alike (install_llama_cpp.sh's patch): every
        # step in one multi-row decode, bitwise whatever the batch. The AMX layout keeps that (SSR's rows kernels,
        # ggml's one-row kernel and AMX tiles give a row the bits it has alone: measured, and tests/test_llama_cpp.py
        # checks it); ggml's CPU repacking does not (its gemm for each group of 4 rows rounds differently), so exact
        # mode on other builds repacks only Q8_0, Q4_K and Q6_K, into SSR's eight-row layouts (patch 0008), whose
        # kernel gives a row the same bits in any batch, and loads the rest on the plain layout, where the patched
        # CPU backend runs every matmul per row (patch 0007: SSR's x86 rows kernels, ggml's vec_dot for other types).
        # Without the patch, exact mode splits the rows (EXACT_ROWS).
        self.batch_invariant = self.exact and library.reference_attention
        self.released_cells_linger = self.exact  # _retire: a freed lane's cells stay taken while others live
        amx_layout = rows_kernels == "amx"
        self.x86_rows = self.batch_invariant and rows_kernels == "x86"  # SSR's x86 rows kernels
        # SSR's eight-row layouts (patch 0008): in exact mode ggml's repack buffer takes them alone
        self.x86_layout = (self.x86_rows and bool(repack) and library.x86_layout
                           and os.environ.get("SSR_X86_LAYOUT", "").strip() != "0")
        if not self.exact:
            extra = bool(repack)  # llama.cpp's CPU weight repacking and, on an AMX build, the AMX layout
        elif self.batch_invariant:
            extra = (bool(repack) and amx_layout) or self.x86_layout
        else:
            extra = bool(repack) and not amx_layout
        self.amx = extra and amx_layout  # the AMX layout: SSR's rows kernels (and AMX tiles where the CPU has them)
        # the build is part of the cost table's key: the same CPU costs differently per build and kernel patch
        self.cost_version = (f"{type(self).cost_version};{','.join(built_with)};{library.digest}"
                             + (";amx" if self.amx else "") + (";x86-rows" if self.x86_rows else "")
                             + (";x86-layout" if self.x86_layout else "")
                             + (";reference-attention" if self.batch_invariant else "")
                             + "".join(f";{name.lower()}={os.environ[name]}"  # the kernels' row limits, moved
                                       for name in ("SSR_AMX_VNNI_ROWS", "SSR_AMX_TILE_ROWS")
                                       if self.amx and name in os.environ))
        self.tokenizer, config_dir = _hf_tokenizer(gguf, model_name, model_path, tokenizer)
        weights = gguf
        # the rewrite keeps exact mode's bits where SSR's rows kernels take Q8_0 (tests/test_llama_cpp.py checks
        # it); elsewhere exact mode's Q8_0 kernels are not measured
        if q5_0_as_q8_0 or (q5_0_as_q8_0 is None and (not self.exact or self.amx or self.x86_rows)):
            weights = self._weights(gguf, measured=q5_0_as_q8_0 is None, build=self.cost_version)
        self.weights_path = str(weights)  # the file llama.cpp runs (model_path: the one named, which peers load)
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra
        with _environment(GGML_CPU_USE_REF="1" if self.x86_layout else None):  # patch 0008 reads it as weights load
            self._model = ll.llama_model_load_from_file(str(weights).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {weights}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = int(min(n_ubatch or self.n_batch, self.n_batch))
        cparams.n_seq_max = self.n_seq_max + 1  # one more sequence: the cells exact mode keeps (_retire)
        cparams.kv_unified = True  # one cache for every sequence: forks share cells, a fork copies nothing
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        with _environment(GGML_CPU_USE_REF="1" if self.batch_invariant else None):  # read as the CPU backend starts
            self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise LlamaCppError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self._mem = ll.llama_get_memory(self._ctx)
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.vocab_size = int(ll.llama_vocab_n_tokens(self._vocab))
        self.context_window = int(min(ll.llama_n_ctx(self._ctx), ll.llama_model_n_ctx_train(self._model)))
        self.file_type = self._meta("general.file_type")
        arch = self._meta("general.architecture") or "llama"
        self.dtype = f"gguf:{_FILE_TYPES.get(self.file_type or '', self.file_type)}"  # calibration cache keys
        if weights != gguf:
            self.dtype += f"+{REWRITE}"  # part of the cost table's key; the reports say which weights ran
        self.config = _config(config_dir, arch)
        eos = int(ll.llama_vocab_eos(self._vocab))
        self.eos_token_ids = stop_token_ids(self.tokenizer, eos if eos >= 0 else None,
                                            getattr(self.config, "eos_token_id", None))
        try:
            self._check_vocabulary()
        except BaseException:
            self.close()
            raise
        self._free_seqs = list(range(self.n_seq_max - 1, -1, -1))  # pop() hands out the lowest
        # exact mode: llama.cpp's attention sums a row's keys in the order their cells lie in the cache, and the cache
        # puts new tokens into the first free cells, so a lane whose later tokens filled cells freed before its
        # earlier ones (a released draft lane's, another request's) summed in another order than plain decoding
        # and its logits moved (by up to 0.56, measured). So exact mode frees no cell while another lane is live: a
        # cut or released lane's cells go to sequence ``_retired`` (attended by no row), and are freed when no lane
        # is live; new tokens then always take cells after every live token. (Kept cells widen every row's attention
        # span, so a lane alone frees its cut tail: only its own next tokens can take those cells.) ``_cells_fed``
        # counts the cells taken since the cache was last empty; where the next step would not fit, the retired
        # cells are freed with lanes live (``kv_order_resets`` counts it: a live lane's later tokens may then sum in
        # another order).
        self._retired = self.n_seq_max
        self._cells_fed = 0
        self.kv_order_resets = 0
        self._batch = None
        self._batch_size = 0
        self.decodes = 0  # llama_decode calls (forward passes)
        self.rows_per_decode: Counter[int] = Counter()  # llama_decode calls by the logit rows they computed

    @classmethod
    def load(cls, model_path: str, model_name: str | None = None, **kwargs) -> "LlamaCppBackend":
        return cls(model_path, model_name, **kwargs)

    def _weights(self, gguf: Path, measured: bool, build: str) -> Path:
        """The file to load for ``gguf``: its Q5_0-as-Q8_0 rewrite (where it has Q5_0 tensors) if not ``measured``,
        else whichever of the two runs a round of typical steps faster here (``gguf_weights.weights_for``)."""
        timer = _StepTimer(self.model_name, self.tokenizer, self.n_threads, self.exact)
        try:
            if not measured:
                return rewritten(gguf) or gguf
            return weights_for(gguf, timer, {"machine": machine(), "threads": self.n_threads, "build": build})
        except OSError as exc:  # no room or no write access for the copy: a speed choice must not stop the load
            logging.getLogger(__name__).warning("loading %s as it is: its Q8_0 copy failed (%s)", gguf, exc)
            return gguf
        finally:
            timer.close()

    # -- model facts -----------------------------------------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def llama_tokenize(self, text: str, special: bool = True) -> list[int]:
        """``text`` in llama.cpp's own tokenization (no BOS); special tokens parsed when ``special``."""
        raw = text.encode()
        buf = (self._ll.llama_token * (len(raw) + 16))()
        n = self._ll.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf), False, special)
        if n < 0:
            raise LlamaCppError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])

    def _check_vocabulary(self) -> None:
        """The engine's token ids come from the HF tokenizer: they must be llama.cpp's ids for the same text."""
        hf = list(self.tokenizer.encode(_PROBE, add_special_tokens=False))
        if hf != self.llama_tokenize(_PROBE):
            raise LlamaCppError(f"the tokenizer of {self.model_name!r} does not encode like the vocabulary of "
                                f"{self.model_path}; pass tokenizer= the matching tokenizer directory")
        if max(hf) >= self.vocab_size:
            raise LlamaCppError("tokenizer ids exceed the GGUF vocabulary")

    @property
    def device(self) -> str:
        """Where and how it runs (part of the calibration cache key: the two modes cost differently)."""
        return f"cpu:{self.n_threads}-threads" + (":amx" if self.amx else "") + (":exact-rows" if self.exact else
                                                                                  ":multi-row")

    # -- lane hooks: a lane is a llama.cpp sequence ---------------------------------------------------------------
    # A parked lane goes on for the next request of its salt whose prompt starts with some of its tokens (taken, or
    # forked where it holds more: nothing recomputed).
    def _open(self, parent: _Lane | None) -> _Lane:
        if not self._free_seqs:  # a running request's lane before a parked one
            spare = [lane for lane in self.lanes.parked if self.lanes[lane] is not parent]
            if spare:
                self.release(spare[0])
        if not self._free_seqs:
            raise LlamaCppError(f"backend 'llama.cpp' has {self.n_seq_max} lanes (n_seq_max) and all are live; "
                                "load it with a larger n_seq_max")
        state = _Lane(seq=self._free_seqs.pop())
        if parent is not None:  # the child's cells ARE the parent's: nothing is copied
            self._ll.llama_memory_seq_cp(self._mem, parent.seq, state.seq, -1, -1)
        return state

    def _cut(self, state: _Lane, length: int) -> None:
        if self.exact and len(self.lanes) > 1:
            self._retire(state.seq, length)
        elif self.exact:  # alone, a lane's freed tail can only be refilled by its own next tokens, in order
            self._cells_fed -= len(state.tokens) - length
        if not self._ll.llama_memory_seq_rm(self._mem, state.seq, length, -1):
            raise LlamaCppError(f"llama.cpp could not truncate sequence {state.seq} to {length} tokens")

    def _free(self, state: _Lane) -> None:
        if self.exact and self.lanes:
            self._retire(state.seq, -1)
        self._ll.llama_memory_seq_rm(self._mem, state.seq, -1, -1)
        self._free_seqs.append(state.seq)
        if self.exact and not self.lanes:  # no lane live: the retired cells go too, the cache is empty again
            self._free_all([])

    def _free_all(self, states: list[_Lane]) -> None:
        self._free_seqs = list(range(self.n_seq_max - 1, -1, -1))
        self._cells_fed = 0
        if self._ctx:  # not after close()
            self._ll.llama_memory_clear(self._mem, True)

    def _keep_parked(self) -> bool:
        """Exact mode takes a new cell for every token while a lane is live, parked ones included (see ``_retired``):
        past three quarters of the cache, the parked lanes go, so that the cache empties before new tokens must fill
        freed cells (another summation order); the last quarter is room for the requests running then."""
        return not self.exact or self._cells_fed <= self._ll.llama_n_ctx(self._ctx) * 3 // 4

    def _retire(self, seq: int, start: int) -> None:
        """Exact mode: the cells of ``seq`` from position ``start`` on (-1: all) stay taken, by ``_retired``."""
        self._ll.llama_memory_seq_cp(self._mem, seq, self._retired, start, -1)

    def _make_room(self, n: int) -> None:
        """Exact mode, before a step of ``n`` tokens: free the retired cells where the step would not fit."""
        if self._cells_fed + n > self._ll.llama_n_ctx(self._ctx):
            self._ll.llama_memory_seq_rm(self._mem, self._retired, -1, -1)
            self.kv_order_resets += 1
            self._cells_fed = sum(len(state.tokens) for state in self.lanes.values())  # at most what they hold
        self._cells_fed += n

    # -- the batched forward pass ------------------------------------------------------------------------------------
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        want = want or {}
        self.lanes.check(feeds)
        bulk: list[list[tuple[int, int, int, bool]]] = []  # per lane: fed tokens before its wanted rows
        rows_part: list[tuple[int, int, int, bool]] = []  # every lane's wanted rows, lane after lane
        rows: dict[int, int] = {}
        for lane, feed in feeds.items():
            k = rows_wanted(lane, feed, want)
            state = self.lanes[lane]
            if len(state.tokens) + len(feed) > self.context_window:
                raise LlamaCppError(f"lane {lane} would hold {len(state.tokens) + len(feed)} tokens, over the "
                                    f"context window of {self.context_window} (n_ctx)")
            start, cut = len(state.tokens), len(feed) - k
            bulk.append([(state.seq, t, start + i, False) for i, t in enumerate(feed[:cut])])
            rows_part.extend((state.seq, t, start + i, True) for i, t in enumerate(feed[cut:], cut))
            rows[lane] = k
        if self.exact:
            self._make_room(sum(len(feed) for feed in feeds.values()))
        if self.exact and not self.batch_invariant:
            # each lane's bulk on its own (so its numerics depend on nothing else in the step), then the wanted
            # rows EXACT_ROWS at a time: llama.cpp's one-row kernels, bitwise what a one-token step computes
            calls = [b[i: i + self.n_batch] for b in bulk for i in range(0, len(b), self.n_batch)]
            calls += [rows_part[i: i + EXACT_ROWS] for i in range(0, len(rows_part), EXACT_ROWS)]
        else:  # everything in as few decodes as n_batch allows (llama.cpp's multi-row kernels)
            flat = [e for b in bulk for e in b] + rows_part
            calls = [flat[i: i + self.n_batch] for i in range(0, len(flat), self.n_batch)]
        try:
            parts = [self._decode(call) for call in calls]
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        except BaseException:
            for lane in feeds:  # the step did not happen: drop whatever part of it was cached
                state = self.lanes[lane]
                self._ll.llama_memory_seq_rm(self._mem, state.seq, len(state.tokens), -1)
            raise
        for lane, feed in feeds.items():
            self.lanes[lane].tokens.extend(feed)
        return dict(zip(rows, logits.split(list(rows.values()))))

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One ``llama_decode`` of ``entries``; float32 logits of the wanted ones, in order (``[0, vocab]`` if
        none)."""
        batch = self._batch_for(len(entries))
        for i, (seq, token, pos, wanted) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wanted
        batch.n_tokens = len(entries)
        code = self._ll.llama_decode(self._ctx, batch)
        self.decodes += 1
        if code != 0:
            raise LlamaCppError(f"llama_decode returned {code}" + (
                " (no KV slot: more tokens live than n_ctx holds; load the backend with a larger n_ctx)"
                if code == 1 else ""))
        n_out = sum(1 for e in entries if e[3])
        self.rows_per_decode[n_out] += 1
        if not n_out:
            return torch.empty(0, self.vocab_size)
        ptr = self._ll.llama_get_logits(self._ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size)).copy())

    def _batch_for(self, n: int):
        if n > self._batch_size:
            if self._batch is not None:
                self._ll.llama_batch_free(self._batch)
            self._batch = self._ll.llama_batch_init(max(n, 64), 0, 1)
            self._batch_size = max(n, 64)
        return self._batch

    # -- shutdown --------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the context, the model and the batch (the backend is unusable afterwards)."""
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        if getattr(self, "_batch", None) is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = self._mem = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None
        self.lanes.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _StepTimer:
    """``timer(path)``: seconds of one round of the steps SSR runs most on a small context over the GGUF file
    ``path`` (a 32-token prefill, 8 one-token steps, 2 four-token verifications) in the mode that will run (``exact``:
    other kernels, other costs); each file's backend is loaded once and kept for the next rounds, ``close()`` frees
    them."""

    def __init__(self, model_name: str, tokenizer, n_threads: int, exact: bool) -> None:
        self.model_name, self.tokenizer, self.n_threads, self.exact = model_name, tokenizer, n_threads, exact
        self.backends: dict[Path, LlamaCppBackend] = {}

    def __call__(self, path: Path) -> float:
        backend = self.backends.get(path)
        if backend is None:
            backend = self.backends[path] = LlamaCppBackend(
                str(path), self.model_name, n_seq_max=2, n_ctx=512, n_threads=self.n_threads, exact=self.exact,
                q5_0_as_q8_0=False, tokenizer=self.tokenizer)
            warm = backend.new_lane()
            backend.step({warm: dummy_ids(4, backend.vocab_size)}, {warm: 4})  # allocations, first touch
            backend.release_all()
        lane = backend.new_lane()
        started = time.perf_counter()
        backend.step({lane: dummy_ids(32, backend.vocab_size)}, {lane: 1})
        for k in range(8):
            backend.step({lane: dummy_ids(1, backend.vocab_size, k)})
        for k in range(2):
            backend.step({lane: dummy_ids(4, backend.vocab_size, k)}, {lane: 4})
        seconds = time.perf_counter() - started
        backend.release_all()
        return seconds

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()


def _config(config_dir: str | None, arch: str):
    """The model's config when a directory has one (``read_config``: chat-family detection reads ``model_type``);
    otherwise just the GGUF's architecture name."""
    if config_dir and (Path(config_dir) / "config.json").exists():
        return read_config(config_dir)
    return SimpleNamespace(model_type=arch)


# general.file_type values (llama_ftype) of the common quantisations, for readable cache keys and reports
_FILE_TYPES = {"0": "F32", "1": "F16", "2": "Q4_0", "3": "Q4_1", "7": "Q8_0", "8": "Q5_0", "9": "Q5_1",
               "10": "Q2_K", "11": "Q3_K_S", "12": "Q3_K_M", "13": "Q3_K_L", "14": "Q4_K_S", "15": "Q4_K_M",
               "16": "Q5_K_S", "17": "Q5_K_M", "18": "Q6_K", "32": "BF16"}


def _kernels(ll) -> list[str]:
    """The CPU features this llama.cpp build compiled kernels for (``llama_print_system_info``: "AVX2 = 1 | ...")."""
    info = ll.llama_print_system_info().decode("utf-8", "replace")
    return sorted(name for name, on in re.findall(r"(\w+) = (\d+)", info) if on != "0")


# The tensor types whose every matmul computes a row alike in any batch, at the cost of its arithmetic only, on a CPU
# without AMX tiles: SSR's rows kernels (Q4_K, Q6_K, Q8_0), Q5_0 (rewritten as Q8_0 where that measures faster, else
# ggml's per-row kernel) and F32 (the norms). Others (Q4_0, Q5_K, IQ4_NL, F16, ...) would go to ggml's repacked
# kernels on SSR's AVX-512 layout, whose rows round with the batch, or to ggml's per-row kernel on its own layout, a
# whole row's arithmetic a token; with AMX ggml's tiles take them, which keep a row's bits.
ROW_EXACT_TYPES = frozenset({"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"})


def _rows_kernels(built_with: list[str], gguf: Path | None = None, x86_rows: bool = False) -> str | None:
    """Which of SSR's rows kernels run this build's matmuls and keep every row of ``gguf`` batch-invariant:
    ``"amx"``, those on SSR's AVX-512 layout (in ggml's AMX backend, which install_llama_cpp.sh builds wherever the
    CPU has AVX-512 VNNI; without AMX tiles, unless ``SSR_AMX_VNNI_ROWS=0``); else ``"x86"``, those on ggml's own
    layout (``x86_rows``: the library has them, patch 0007, built wherever it has AVX2; unless ``SSR_X86_ROWS=0``);
    else None. Without AMX tiles, only for files whose tensor types they cover (``ROW_EXACT_TYPES``)."""
    if "AMX_INT8" in built_with and "amx_tile" in (_cpuinfo().get("flags") or "").split():
        return "amx"
    if "AMX_INT8" in built_with and os.environ.get("SSR_AMX_VNNI_ROWS", "").strip() != "0":
        kernels = "amx"
    elif x86_rows and "AVX2" in built_with and os.environ.get("SSR_X86_ROWS", "").strip() != "0":
        kernels = "x86"
    else:
        return None
    if gguf is None:
        return kernels
    try:
        return kernels if set(tensor_types(gguf)) <= ROW_EXACT_TYPES else None
    except (OSError, ValueError):  # not a file this reader knows: llama.cpp's loader, next, says what is wrong
        return None


def _cpu_library(ll) -> SimpleNamespace:
    """What the loaded CPU library (libggml-cpu) is, from its bytes: ``reference_attention``, whether it reads
    ``GGML_CPU_USE_REF`` (the patch scripts/install_llama_cpp.sh applies, which makes flash attention compute each
    query row alike in any batch); ``x86_rows``, whether it has SSR's rows kernels on ggml's own layout (patch
    0007, which also makes exact mode run every matmul per row); ``x86_layout``, whether its repack buffer has SSR's
    eight-row layouts for exact mode (patch 0008); ``digest``, a short hash of the file (a rebuilt
    library, SSR's multi-row AMX kernels among its patches, is calibrated again)."""
    found = sorted(path for path in Path(ll.llama_cpp._base_path).glob("libggml-cpu*") if path.is_file())
    data = found[0].read_bytes() if found else b""  # libggml-cpu.so (its versioned names hold the same library)
    return SimpleNamespace(reference_attention=b"GGML_CPU_USE_REF" in data, x86_rows=b"SSR_X86_ROWS" in data,
                           x86_layout=b"SSR_X86_LAYOUT" in data,
                           digest=hashlib.sha256(data).hexdigest()[:12])


@contextlib.contextmanager
def _environment(**values: str | None):
    """``values`` set in the environment for the block (None: left as it is), then restored."""
    before = {name: os.environ.get(name) for name, value in values.items() if value is not None}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def smoke_test(tokens: int = 4) -> None:
    """Load the embedded model's GGUF on this llama.cpp build and decode a few tokens (scripts/install_llama_cpp.sh
    runs this in a child process after installing a build for this CPU: a kernel that crashes kills only that
    process, and the portable build replaces it)."""
    from ..models import DEFAULT_MODEL

    backend = LlamaCppBackend(str(gguf_file(DEFAULT_MODEL)), DEFAULT_MODEL, n_seq_max=2, n_ctx=256)
    try:
        lane = backend.new_lane()
        ids = backend.tokenizer.encode("def add(a, b):", add_special_tokens=False)
        logits = backend.step({lane: ids}, {lane: 1})[lane]
        for _ in range(tokens - 1):
            logits = backend.step({lane: [int(logits[-1].argmax())]})[lane]
        print(f"llama.cpp smoke test: {tokens} tokens decoded on {backend.model_path}")
    finally:
        backend.close()
