"""vLLM's own decoding loops as benchmark peers: plain vLLM (``vllm``), ngram prompt lookup (``vllm-ngram``) and
suffix decoding (``vllm-suffix``, needs ``arctic-inference``).

Each peer is one vLLM engine in a persistent worker process (vLLM 0.32 starts at most two in-process engines in
one process; the third fails in its kernel registration), started once per run. The harness feeds every peer the
engine's prompt ids for each item, between the other methods of that item, so machine drift hits all methods
alike. A peer generates as many tokens as plain decoding did (``ignore_eos``): its latency compares the same
amount of work, and its token ids are compared with plain's like ``prompt-lookup``'s (a vLLM loop cannot insert
the engine's budget-forcing text, so it may leave plain's tokens exactly there).

The worker protocol is JSON lines on stdin/stdout: ``{"prompt_ids": [...], "max_tokens": N}`` in,
``{"token_ids": [...], "seconds": s, "steps": k}`` out, timed around ``LLM.generate`` inside the worker.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

SPECS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
# arguments of the SSR backend that are not vllm.LLM's (the KV cache size reaches the worker as its env variable)
_SSR_ONLY = ("logprobs", "cpu_kvcache_gib")


def peer_engine_args(backend_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM arguments for a peer: the run's backend arguments (same dtype, context, eager mode, ...)."""
    args = {k: v for k, v in backend_kwargs.items() if k not in _SSR_ONLY}
    args.setdefault("enable_prefix_caching", True)
    args.setdefault("disable_log_stats", True)
    return args


class VLLMPeer:
    """A worker process holding one ``vllm.LLM`` with ``speculative_config=spec`` (None: plain vLLM)."""

    def __init__(self, name: str, model_path: str, backend_kwargs: dict[str, Any], start_timeout: float = 900):
        if name not in SPECS:
            raise ValueError(f"unknown vLLM peer {name!r}; choose from {', '.join(SPECS)}")
        self.name = name
        config = {"model": model_path, "spec": SPECS[name], "engine_args": peer_engine_args(backend_kwargs)}
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine core inside the worker
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if "cpu_kvcache_gib" in backend_kwargs:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(backend_kwargs["cpu_kvcache_gib"])
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"ssr-{name}-", suffix=".log", delete=False)
        self._proc = subprocess.Popen([sys.executable, "-m", "ssr_bench.vllm_peers", json.dumps(config)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                      env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self._read(start_timeout)
        if not ready.get("ready"):
            raise RuntimeError(f"vLLM peer {name} did not start: {ready.get('error')}")

    def _read(self, timeout: float) -> dict[str, Any]:
        """The worker's next protocol line; fails when the worker exits (a forked grandchild may keep the pipe open,
        so EOF alone is not enough) or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=1.0)
                break
            except queue.Empty:
                if self._proc.poll() is not None:
                    line = None
                    break
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"vLLM peer {self.name}: no answer in {timeout:.0f} s ({self._tail()})")
        if line is None:
            raise RuntimeError(f"vLLM peer {self.name} exited ({self._tail()})")
        return json.loads(line)

    def _pump(self) -> None:
        """Protocol lines from the worker's stdout into a queue (None at EOF), so reads can time out."""
        for line in self._proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def _tail(self, chars: int = 1500) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f"log {self._log.name}: ..." + f.read()[-chars:]

    def generate(self, prompt_ids: list[int], max_tokens: int, timeout: float = 3600) -> dict[str, Any]:
        """Greedy, exactly ``max_tokens`` new tokens: ``{"token_ids", "seconds", "steps"}``."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"vLLM peer {self.name} is not running ({self._tail()})")
        self._proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens)}) + "\n")
        self._proc.stdin.flush()
        out = self._read(timeout)
        if "error" in out:
            raise RuntimeError(f"vLLM peer {self.name}: {out['error']}")
        return out

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a stuck worker is killed
                self._proc.kill()
        self._log.close()
        if self._proc.poll() == 0:
            os.unlink(self._log.name)  # kept only when the worker failed


def _serve(config: dict[str, Any]) -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol; everything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    args = dict(config["engine_args"])
    args.setdefault("dtype", "float32" if current_platform.is_cpu() else "auto")  # as the "vllm" backend does
    try:
        llm = LLM(model=config["model"], speculative_config=config["spec"], **args)
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    steps = [0]  # forward passes: the in-process engine core's model-executing steps
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:
        step = core.step_fn

        def counted_step():
            outputs, executed = step()
            steps[0] += int(bool(executed))
            return outputs, executed

        core.step_fn = counted_step
    llm.generate([TokensPrompt(prompt_token_ids=[0, 1, 2, 3])], SamplingParams(max_tokens=4), use_tqdm=False)
    send({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
        try:
            before = steps[0]
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=job["prompt_ids"])], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            reply = {"token_ids": list(out[0].outputs[0].token_ids), "seconds": seconds,
                     "steps": steps[0] - before if core is not None else None}
        except Exception as exc:  # noqa: BLE001 - one failed item must not end the worker
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        send(reply)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
