"""llama.cpp's own ``llama-server`` as a benchmark peer: what Ollama and llama-server users run on a CPU.

Three methods (and their ``-q8`` twins), each a real server process on 127.0.0.1 over the run's GGUF file, threads
and context:

* ``llama-server``: plain decoding;
* ``llama-server-ngram-mod`` / ``llama-server-ngram-map-k``: its draft-free speculation (``--spec-type``), whose
  n-gram pool is shared across the requests one server answers;
* each also as ``NAME-q8``: on the file the engine loaded (its Q5_0-as-Q8_0 copy where the engine chose it) instead
  of the GGUF as shipped, which tells the weights' gain from speculation's.

Like the other replay peers, a request asks for exactly plain's number of tokens from plain's prompt ids
(``ignore_eos``), greedy, with ``cache_prompt`` off (every method prefills its prompt, as the engine's methods do
after ``release_all``). Where plain decoding forced text (budget forcing), the peer decodes up to it, the text is
appended and a continuation request (``cache_prompt`` on: only the added tokens are prefilled) goes on, so the peer
does plain's work, forced text included (``methods.generate_with_forced``). The time is the HTTP round trips on
loopback; the server's own ``timings`` of the first request (prompt and decode milliseconds, drafted and accepted
tokens) are kept in the record.

The binary: ``$SSR_LLAMA_SERVER``, else the one ``scripts/install_llama_cpp.sh --tools`` keeps beside the installed
llama-cpp-python wheel (the same llama.cpp source and build flags as the backend, with the libraries built with it),
else ``llama-server`` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .methods import ON_ENGINE_WEIGHTS

SPECS = {"llama-server": (), "llama-server-ngram-mod": ("--spec-type", "ngram-mod"),
         "llama-server-ngram-map-k": ("--spec-type", "ngram-map-k")}
SPECS |= {name + ON_ENGINE_WEIGHTS: spec for name, spec in SPECS.items()}


def _wheelhouses() -> list[Path]:
    root = Path(os.environ.get("SSR_WHEELHOUSE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "ssr" / "wheels")
    return sorted(root.glob("llama-cpp-python-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def installed_flags_house() -> Path | None:
    """The wheelhouse whose wheel is the installed llama-cpp-python (its tools share its source and flags)."""
    try:
        from importlib.metadata import distribution

        record = distribution("llama-cpp-python").read_text("direct_url.json") or ""
    except Exception:  # noqa: BLE001 - not installed, or installed without a record of where from
        return None
    for house in _wheelhouses():
        if str(house) in record:
            return house
    return None


def find_server() -> tuple[str, dict[str, str]] | None:
    """(the llama-server binary, extra environment to run it), or None where no build exists."""
    named = os.environ.get("SSR_LLAMA_SERVER")
    if named:
        return (named, {}) if os.access(named, os.X_OK) else None
    house = installed_flags_house()
    candidates = ([house] if house else []) + _wheelhouses()
    for h in candidates:
        binary = h / "bin" / "llama-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary), {"LD_LIBRARY_PATH": str(binary.parent)}  # the libraries built with it
    on_path = shutil.which("llama-server")
    return (on_path, {}) if on_path else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerPeer:
    """One ``llama-server`` process for method ``name`` (a key of ``SPECS``); ``close()`` stops it."""

    def __init__(self, name: str, model_path: str, n_threads: int, n_ctx: int = 8192, parallel: int = 1,
                 timeout: float = 120.0) -> None:
        found = find_server()
        if found is None:
            raise RuntimeError("no llama-server build: run `bash scripts/install_llama_cpp.sh --tools` (or set "
                               "SSR_LLAMA_SERVER to a llama-server binary)")
        binary, env = found
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        args = [binary, "-m", model_path, "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads),
                "-np", str(parallel), "--host", "127.0.0.1", "--port", str(self.port), *SPECS[name]]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env})
        self._wait_healthy(timeout)
        self.generate([0, 1, 2, 3], 2)  # warm-up (first-call allocations)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not become healthy in {timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    keeps_prefix = True  # with ``reuse_cache``: a continuation prefills only what it adds (``methods.run_peer``)

    def generate(self, prompt_ids: list[int], max_tokens: int, reuse_cache: bool = False) -> dict[str, Any]:
        """Greedy, exactly ``max_tokens`` new tokens: ``{"token_ids", "seconds", "steps", "prefill_s", "server"}``.
        ``reuse_cache``: keep the slot's cache for the prefix this prompt shares with the last request and its
        output (a continuation after forced text); off, the whole prompt is prefilled."""
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_tokens), "temperature": 0.0,
                "top_k": 1, "ignore_eos": True, "cache_prompt": bool(reuse_cache), "return_tokens": True,
                "stream": False}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            reply = json.loads(r.read())
        seconds = time.perf_counter() - t0
        timings = reply.get("timings") or {}
        return {"token_ids": [int(t) for t in reply.get("tokens") or []][:max_tokens], "seconds": seconds,
                "steps": None, "prefill_s": (timings.get("prompt_ms") or 0) / 1000 or None,
                "server": {k: timings.get(k) for k in ("prompt_ms", "predicted_ms", "predicted_n", "draft_n",
                                                        "draft_n_accepted")}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def peer_for(method: str, engine, backend_kwargs: dict[str, Any], parallel: int = 1) -> LlamaServerPeer:
    """The peer for a run on the ``llama.cpp`` backend: same GGUF file (``NAME-q8``: the file the engine loaded)
    and threads."""
    backend = engine.backend
    path = backend.weights_path if method.endswith(ON_ENGINE_WEIGHTS) else backend.model_path
    return LlamaServerPeer(method, path, n_threads=getattr(backend, "n_threads", 1),
                           n_ctx=min(backend.context_window, 32768) * parallel, parallel=parallel)
