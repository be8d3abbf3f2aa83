"""Plain llama.cpp as a benchmark peer (``llama.cpp``): llama-cpp-python's own ``Llama.generate`` loop, greedy.

This is what a local user runs instead of SSR (Ollama, llama.cpp): one sequence, one token per ``llama_decode``.
The peer loads the same GGUF file as the run's ``llama.cpp`` backend, with the same thread count and batch size,
in its own ``Llama`` (its own context; the weights are memory-mapped, so the page cache holds them once). Like the
vLLM peers it generates exactly as many tokens as plain decoding did on the same prompt ids (it keeps going past an
end-of-turn token), so latencies compare the same amount of work; its token ids are compared with plain's (it
cannot insert the engine's budget-forcing text, so it may leave plain's tokens exactly there). ``Llama.generate``
keeps the previous prompt's cache for a shared prefix, as SSR's parked lane does.
"""

from __future__ import annotations

import logging
import time
from typing import Any


class LlamaCppPeer:
    """``llama_cpp.Llama`` on ``model_path`` (a GGUF file)."""

    def __init__(self, model_path: str, n_ctx: int = 8192, n_threads: int | None = None, n_batch: int = 512):
        import llama_cpp
        import torch

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        threads = int(n_threads or torch.get_num_threads())
        self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.generate([0, 1, 2, 3], 2)  # warm-up (first-call allocations)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy, exactly ``max_tokens`` new tokens: ``{"token_ids", "seconds", "steps", "prefill_s"}`` (prefill_s:
        time to the first token, i.e. the prompt's evaluation less what ``Llama``'s own prefix cache kept)."""
        out: list[int] = []
        first = None
        t0 = time.perf_counter()
        if max_tokens > 0:
            for token in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                           repeat_penalty=1.0):
                out.append(int(token))
                first = first or time.perf_counter() - t0  # the prompt's evaluation (and one sampling)
                if len(out) >= max_tokens:
                    break
        seconds = time.perf_counter() - t0
        return {"token_ids": out, "seconds": seconds, "steps": None, "prefill_s": first}

    def close(self) -> None:
        self.llm.close()


def peer_for(engine, backend_kwargs: dict[str, Any]) -> LlamaCppPeer:
    """The peer for a run on the ``llama.cpp`` backend: same GGUF file, threads and batch size."""
    backend = engine.backend
    return LlamaCppPeer(backend.model_path, n_ctx=min(backend.context_window, 32768),
                        n_threads=getattr(backend, "n_threads", None), n_batch=getattr(backend, "n_batch", 512))
