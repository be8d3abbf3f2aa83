"""Backend over an OpenAI-compatible vLLM server (``vllm serve``), standard library only.

Each ``step`` is ONE HTTP call to ``/v1/completions`` whose ``prompt`` is a list of token-id prompts, one per lane
(plus, for verification, one per extra wanted position), each with ``max_tokens=1`` and ``logprobs=K``. vLLM submits
the prompts of one call together, so its scheduler batches them into one engine step; automatic prefix caching
(on by default) serves every full KV block a lane already computed, so a step recomputes only the lane's last
partial block and the fed tokens. The server keeps no state for us: fork, truncate and release are list operations
here, and a cancelled request simply stops stepping.

Why not streaming: a step wants one token's logits per lane, so a stream would carry one event; and vLLM refuses
``prompt_logprobs`` on streams. vLLM aborts a request when its client disconnects, so closing the connection of a
call in flight (``close()``, or a timeout) cancels its work on the server.

Logits: vLLM returns top-K scores per position (K = ``logprobs``; the server's ``--max-logprobs`` bounds it; -1
asks for the full vocabulary, which also needs ``--max-logprobs -1`` and is slow over JSON). The other entries of a
row are ``-inf``. Greedy decoding needs only the top-1 and is exact; sampling from top-K scores samples from the
top-K renormalised (exact only with the full vocabulary). Start the server with ``--logprobs-mode raw_logits`` to
get raw logits (with the default mode the scores are log-probabilities, which give the same argmax and softmax).

Errors raise ``SSRBackendError`` subclasses: ``SSRBackendConnectionError`` (refused / reset / unreachable, after
``max_retries`` retries), ``SSRBackendTimeout`` (no answer within ``timeout`` seconds; never retried: the server is up
but busy, and a retry would only double the wait), ``SSRBackendServerError`` (HTTP error status, or a malformed
answer). A step is stateless on the server, so retrying one is safe.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import torch

from .base import Backend, Lane, LaneTable, rows_wanted, stop_token_ids
from .errors import (  # noqa: F401 - also imported from here by the adapters and their tests
    SSRBackendConnectionError,
    SSRBackendError,
    SSRBackendServerError,
    SSRBackendTimeout,
    SSRBackendUnavailable,
)


def _secret(value: Any) -> str | None:
    """An API key given as text or as a secret wrapper (pydantic ``SecretStr``)."""
    if value is not None and hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    return str(value) if value else None


class _Http:
    """One keep-alive connection per thread to ``base_url``; connection errors are retried ``max_retries`` times."""

    RETRY_BACKOFF = 0.25  # seconds before the first retry, doubled for each next one (at most 4 s)

    def __init__(self, base_url: str, timeout: float, api_key: str | None, max_retries: int = 2) -> None:
        parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"base_url must be http(s)://host:port[/v1], got {base_url!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        self.max_retries = int(max_retries)
        self.scheme, self.host, self.port = parts.scheme, parts.hostname or "127.0.0.1", parts.port
        path = parts.path.rstrip("/")
        self.prefix = path[: -len("/v1")] if path.endswith("/v1") else path
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key := _secret(api_key):
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self.base_url = f"{self.scheme}://{self.host}{':' + str(self.port) if self.port else ''}{self.prefix}"

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, payload: Any = None, timeout: float | None = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        url = f"{self.prefix}{path}"
        retries = 0
        stale_retry = True  # a kept-alive connection the server closed meanwhile gets one free retry
        while True:
            conn = self._conn()
            reused = conn.sock is not None
            conn.timeout = timeout or self.timeout
            if reused:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, url, body=body, headers=self.headers)
                response = conn.getresponse()
                data = response.read()
                status = response.status
                break
            except (socket.timeout, TimeoutError) as exc:
                self._drop()  # closing the connection makes vLLM abort the request in flight
                raise SSRBackendTimeout(f"the vLLM server at {self.base_url} did not answer {method} {path} within "
                                        f"the timeout of {conn.timeout:g} s (raise it with timeout=...)") from exc
            except (ConnectionError, OSError, http.client.HTTPException) as exc:
                self._drop()
                lost = isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if lost and reused and stale_retry:
                    stale_retry = False
                    continue
                if retries < self.max_retries:
                    time.sleep(min(self.RETRY_BACKOFF * 2 ** retries, 4.0))
                    retries += 1
                    continue
                attempts = f" (after {retries + 1} attempts; max_retries={self.max_retries})"
                what = f"{self.base_url}{path}: connection lost" if lost else \
                    f"cannot reach the vLLM server at {self.base_url}"
                raise SSRBackendConnectionError(f"{what} ({exc}){attempts}") from exc
        text = data.decode("utf-8", "replace")
        if status >= 400:
            message = text
            try:
                err = json.loads(text)
                message = (err.get("error") or {}).get("message") or err.get("message") or err.get("detail") or text
            except (ValueError, AttributeError):
                pass
            raise SSRBackendServerError(f"{self.base_url}{path}: HTTP {status}: {message}", status, text)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise SSRBackendServerError(f"{self.base_url}{path}: not JSON: {text[:200]!r}", status, text) from exc

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass


def _token_id(key: str) -> int:
    """Keys of ``top_logprobs`` with ``return_tokens_as_token_ids``: "token_id:123"."""
    return int(key.rsplit(":", 1)[1]) if ":" in key else int(key)


class VLLMServerBackend(Backend[Lane]):
    """``Backend`` over a running vLLM OpenAI-compatible server.

    ``model_path``: a local copy of the model (for the tokenizer and config); ``base_url``: the server
    (``http://host:port`` or ``.../v1``); ``served_model``: the server's model id (default: the first it lists);
    ``logprobs``: top-K scores per position (-1: all); ``timeout``: seconds per HTTP call (a call that gets no
    answer in time raises ``SSRBackendTimeout``); ``max_retries``: retries of a call that could not connect or lost
    its connection; ``api_key``: the server's key (text or a ``SecretStr``; default: ``$VLLM_API_KEY``).
    """

    def __init__(self, model_path: str, model_name: str | None = None, *, base_url: str = "http://127.0.0.1:8000",
                 served_model: str | None = None, logprobs: int = 20, timeout: float = 120.0,
                 api_key: Any = None, max_retries: int = 2, prompt_logprobs_max_tokens: int = 256,
                 **unused: Any) -> None:
        if unused:
            raise TypeError(f"vllm-server backend got unknown argument(s) {sorted(unused)}")
        if logprobs == 0 or logprobs < -1:
            raise ValueError(f"logprobs must be >= 1 or -1 (full vocabulary), got {logprobs}")
        from transformers import AutoConfig, AutoTokenizer

        super().__init__()
        self.http = _Http(base_url, timeout, _secret(api_key) or os.environ.get("VLLM_API_KEY"), max_retries)
        self.model_path = model_path
        self.model_name = model_name or os.path.basename(os.path.normpath(model_path))
        self.logprobs = logprobs
        self.logits_topk: int | None = None if logprobs == -1 else logprobs
        self.prompt_logprobs_max_tokens = prompt_logprobs_max_tokens
        models = self.http.request("GET", "/v1/models", timeout=min(timeout, 30.0))
        listed = models.get("data") or []
        if not listed:
            raise SSRBackendUnavailable(f"the server at {self.http.base_url} lists no models")
        entry = next((m for m in listed if m.get("id") == served_model), None) if served_model else listed[0]
        if entry is None:
            raise SSRBackendUnavailable(f"the server at {self.http.base_url} does not serve {served_model!r}; it "
                                        f"serves {[m.get('id') for m in listed]}")
        self.served_model = entry["id"]
        self.config = AutoConfig.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = int(getattr(self.config, "vocab_size", None) or len(self.tokenizer))
        self.context_window = int(entry.get("max_model_len") or getattr(self.config, "max_position_embeddings", 4096))
        eos = [getattr(self.config, "eos_token_id", None)]
        try:
            from transformers import GenerationConfig

            eos.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
        except Exception:  # noqa: BLE001 - optional file
            pass
        self.eos_token_ids = stop_token_ids(self.tokenizer, *eos)
        self.calls = 0  # HTTP step calls made

    # -- lanes: client-side only (the server's prefix cache holds the KV, for every request) ----------------------
    def _keep_parked(self) -> bool:
        return False  # nothing is held here: a new request's lane starts empty, its prefix cached on the server

    def view(self) -> "VLLMServerBackend":
        """Another backend on the same server and connection pool with its own lanes (one per concurrent request)."""
        other = object.__new__(VLLMServerBackend)
        other.__dict__.update(self.__dict__)
        other.lanes, other.calls = LaneTable(), 0
        return other

    def close(self) -> None:
        self.release_all()
        self.http.close()

    # -- one step: one HTTP call, one batch on the server -------------------------------------------------------------
    def step(self, feeds: dict[int, list[int]], want: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        want = want or {}
        prompts: list[list[int]] = []
        plan: list[tuple[int, int, int, bool]] = []  # (lane, first prompt index, rows, rows via prompt_logprobs)
        use_prompt_logprobs = False
        self.lanes.check(feeds)
        for lane_id, feed in feeds.items():
            state = self.lanes[lane_id]
            rows = rows_wanted(lane_id, feed, want)
            full = state.tokens + feed
            if len(full) >= self.context_window:
                raise SSRBackendError(f"lane {lane_id} would hold {len(full)} tokens, at or over the server's "
                                      f"max_model_len of {self.context_window}")
            # several rows: prompt logprobs recompute the whole prompt (vLLM skips the prefix cache for them), so
            # only short lanes use them; longer lanes send one prompt per row, each served from the prefix cache
            via_prompt = rows > 1 and len(full) <= self.prompt_logprobs_max_tokens
            plan.append((lane_id, len(prompts), rows, via_prompt))
            if rows == 1 or via_prompt:
                prompts.append(full)
                use_prompt_logprobs |= via_prompt
            else:
                for j in range(rows):
                    prompts.append(full[: len(full) - rows + 1 + j])
        for lane_id, feed in feeds.items():
            self.lanes[lane_id].tokens.extend(feed)
        payload = {
            "model": self.served_model, "prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": 1,
            "temperature": 0.0, "logprobs": self.logprobs, "ignore_eos": True, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "stream": False,
        }
        if use_prompt_logprobs:
            payload["prompt_logprobs"] = self.logprobs
        try:
            answer = self.http.request("POST", "/v1/completions", payload)
        except BaseException:
            for lane_id, feed in feeds.items():  # the step did not happen: the lanes stay as they were
                del self.lanes[lane_id].tokens[len(self.lanes[lane_id].tokens) - len(feed):]
            raise
        self.calls += 1
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise SSRBackendServerError(f"asked for {len(prompts)} completions, got {len(choices)}", None,
                                        json.dumps(answer)[:2000])
        out: dict[int, torch.Tensor] = {}
        for lane_id, first, rows, via_prompt in plan:
            if via_prompt:
                prompt_rows = choices[first].get("prompt_logprobs")
                if not prompt_rows:
                    raise SSRBackendServerError("the server returned no prompt_logprobs")
                # prompt_logprobs[i] scores prompt token i given the tokens before it: row for position p is i=p+1
                wanted = prompt_rows[len(prompts[first]) - rows + 1:]
                dense = [self._row_from_prompt(r) for r in wanted] + [self._row_from_sample(choices[first])]
            elif rows == 1:
                dense = [self._row_from_sample(choices[first])]
            else:
                dense = [self._row_from_sample(choices[first + j]) for j in range(rows)]
            out[lane_id] = torch.stack(dense)
        return out

    def _row_from_sample(self, choice: dict) -> torch.Tensor:
        lp = choice.get("logprobs") or {}
        top = (lp.get("top_logprobs") or [None])[0]
        row = torch.full((self.vocab_size,), float("-inf"))
        if top:
            for key, value in top.items():
                self._put(row, _token_id(key), value)
        tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
        if tokens and values and values[0] is not None:
            self._put(row, _token_id(tokens[0]), values[0])
        if not torch.isfinite(row).any():
            raise SSRBackendServerError("the server returned no logprobs for a step", None, json.dumps(choice)[:2000])
        return row

    def _row_from_prompt(self, entry: dict | None) -> torch.Tensor:
        row = torch.full((self.vocab_size,), float("-inf"))
        for key, info in (entry or {}).items():
            value = info.get("logprob") if isinstance(info, dict) else info
            self._put(row, _token_id(key), value)
        if not torch.isfinite(row).any():
            raise SSRBackendServerError("the server returned an empty prompt_logprobs row")
        return row

    def _put(self, row: torch.Tensor, token: int, value) -> None:
        if value is not None and 0 <= token < self.vocab_size:
            row[token] = float(value)

