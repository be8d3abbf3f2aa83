"""Plain llama.cpp as a benchmark peer (``llama.cpp``): llama-cpp-python's own ``Llama.generate`` loop, greedy.

This is what a local user runs instead of SSR (Ollama, llama.cpp): one sequence, one token per ``llama_decode``.
The peer loads the same GGUF file as the run's ``llama.cpp`` backend, with the same thread count and batch size,
in its own ``Llama`` in a process of its own, as a user runs it: llama.cpp's OpenMP threads and the engine's would
otherwise share one libgomp, which stops spinning at barriers once the process holds more OpenMP threads than CPUs
and slows both (``ssr.threads``). Like the vLLM peers it generates exactly as many tokens as plain decoding did on the
same prompt ids (it keeps going past an end-of-turn token), so latencies compare the same amount of work; its token
ids are compared with plain's. Its loop cannot insert the engine's budget-forcing text, so the harness stops it where
plain forced text, appends that text and lets it go on (``methods.generate_with_forced``). ``Llama.generate`` keeps
the previous prompt's cache for a shared prefix, as SSR's parked lane does, so a continuation prefills only what it
adds.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any


def _generate(llm, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` new tokens: ``{"token_ids", "seconds", "steps", "prefill_s"}`` (prefill_s: time
    to the first token, i.e. the prompt's evaluation less what ``Llama``'s own prefix cache kept)."""
    out: list[int] = []
    first = None
    t0 = time.perf_counter()
    if max_tokens > 0:
        tokens = llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in tokens:
            out.append(int(token))
            first = first or time.perf_counter() - t0  # the prompt's evaluation (and one sampling)
            if len(out) >= max_tokens:
                break
        tokens.close()
    seconds = time.perf_counter() - t0
    return {"token_ids": out, "seconds": seconds, "steps": None, "prefill_s": first}


def _serve(conn, model_path: str, n_ctx: int, n_threads: int, n_batch: int) -> None:
    """The peer process: load the model, then answer ``(prompt_ids, max_tokens)`` requests until ``None``."""
    import logging

    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                          n_threads_batch=n_threads, verbose=False)
    try:
        while (request := conn.recv()) is not None:
            try:
                conn.send(("ok", _generate(llm, *request)))
            except Exception as exc:  # noqa: BLE001 - reported to the harness
                conn.send(("error", repr(exc)))
    finally:
        llm.close()


class LlamaCppPeer:
    """``llama_cpp.Llama`` on ``model_path`` (a GGUF file), in a child process; ``close()`` ends it."""

    def __init__(self, model_path: str, n_ctx: int = 8192, n_threads: int | None = None, n_batch: int = 512):
        import torch

        threads = int(n_threads or torch.get_num_threads())
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._proc = spawn.Process(target=_serve, args=(child, model_path, n_ctx, threads, n_batch), daemon=True,
                                   name="llama.cpp-peer")
        self._proc.start()
        child.close()
        self.generate([0, 1, 2, 3], 2)  # warm-up (first-call allocations)

    keeps_prefix = True  # ``Llama.generate`` keeps the cache of the prefix a prompt shares with the last one

    def generate(self, prompt_ids: list[int], max_tokens: int, reuse_cache: bool = True) -> dict[str, Any]:
        """See ``_generate``; timed in the peer process. (``reuse_cache``: ``Llama`` always does.)"""
        self._conn.send(([int(t) for t in prompt_ids], int(max_tokens)))
        try:
            status, reply = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the llama.cpp peer process ended (exit code {self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the llama.cpp peer failed: {reply}")
        return reply

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()


def peer_for(engine, backend_kwargs: dict[str, Any]) -> LlamaCppPeer:
    """The peer for a run on the ``llama.cpp`` backend: same GGUF file, threads and batch size."""
    backend = engine.backend
    return LlamaCppPeer(backend.model_path, n_ctx=min(backend.context_window, 32768),
                        n_threads=getattr(backend, "n_threads", None), n_batch=getattr(backend, "n_batch", 512))
