"""SSREngine: the public API. Prompts in, reasoning + answer + exact token ids + stats out; sync, async, streaming.

Requests from any number of threads and event loops run together: the engine's scheduler (``ssr.scheduler``)
steps every live request's lanes in one backend pass."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import weakref
from numbers import Real
from typing import AsyncIterator, Callable, Iterator, TypeVar

from .backends import choose_backend, load_backend
from .chat import (
    ChatFamily,
    Prompt,
    detect_family,
    encode_prompt,
    resolve_thinking,
    tool_call_opening,
)
from .config import SSRConfig
from .costs import CostTable
from .decode import Decoding
from .grammar import Grammar, Grammars, check_tools, json_grammar, response_schema, tool_call_grammar
from .history import DEFAULT_MAX_TOKENS, OutputHistory
from .models import backend_model_path, canonical_name
from .policy import SpeculationPolicy
from .result import GenerationResult, StreamEvent
from .scheduler import Scheduler
from .threads import on_own_thread
from .toolcalls import ToolCallParse, prompt_seed
from .toolstream import ToolCallStream

T = TypeVar("T")

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")

log = logging.getLogger("ssr.engine")


class SSREngine:
    """One loaded model and its backend, and the scheduler that runs every request on it.

    ``max_queue`` bounds the requests waiting to start (``ssr.errors.QueueFull`` past it), ``max_running`` the
    requests stepped together, ``prefill_chunk`` the prompt tokens a new request prefills per pass while others
    decode. ``history_tokens`` bounds the earlier outputs kept as a suffix source for later requests (``ssr.history``;
    0 keeps none). ``close()`` (or ``with SSREngine(...)``) ends every request and frees the model's lanes."""

    def __init__(self, backend, tokenizer, config: SSRConfig | None = None, family: ChatFamily | None = None,
                 model_name: str | None = None, costs: CostTable | None = None, max_queue: int = 64,
                 max_running: int = 16, prefill_chunk: int = 128, history_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config or SSRConfig()
        self.family = family or detect_family(tokenizer, getattr(backend.config, "model_type", None))
        self.model_name = model_name or backend.model_name
        self.scheduler = Scheduler(backend, max_queue=max_queue, max_running=max_running, prefill_chunk=prefill_chunk)
        self._grammars: Grammars | None = None  # the tokenizer converted for llguidance, on first use
        if costs is None:  # measured here (or read from the disk cache), before any request holds a lane
            from .calibrate import calibrated

            costs = calibrated(backend)
        self.policy = SpeculationPolicy(costs)  # this machine's step costs and the acceptance rates seen so far
        self.history = OutputHistory(history_tokens)  # earlier outputs, a suffix source of later requests
        # the cache salt of requests that name none: a request reuses only the parked prompts of its own salt (a
        # harness comparing methods on one engine gives each its own, so that none is timed on another's prefill)
        self.cache_salt: str | None = None
        self._closed = False
        self._live_key = _track(self)  # closed at interpreter exit unless closed before

    @classmethod
    def from_pretrained(cls, model: str | None = None, backend: str = "auto",
                        config: SSRConfig | None = None, family: ChatFamily | None = None,
                        costs: CostTable | None = None, max_queue: int = 64, max_running: int = 16,
                        **backend_kwargs) -> "SSREngine":
        """Load ``model`` (None: the embedded default; a local directory; a cached hub name) on ``backend``, and
        its measured cost table (``ssr.calibrate``: from the disk cache, or measured now, in seconds)."""
        name = canonical_name(model)
        chosen = choose_backend(backend, name)
        # loaded on a thread of its own: the OpenMP team a load starts ends with it (ssr.threads)
        loaded = on_own_thread(load_backend, chosen, backend_model_path(chosen, model), name, name="ssr-load",
                               **backend_kwargs)
        return cls(loaded, loaded.tokenizer, config=config, family=family, model_name=name, costs=costs,
                   max_queue=max_queue, max_running=max_running)

    @property
    def closed(self) -> bool:
        return self.scheduler.closed

    def run_on_engine_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on the thread that runs every step, between two passes; its result returned.

        For torch (or llama.cpp) work in the same process, an embedding model for example: run on any other
        long-lived thread, it starts an OpenMP team of its own, and from then on every step is slower (about 1.6x on
        a 2-core CPU; ``ssr.threads``). Requests wait while ``fn`` runs."""
        return self.scheduler.call(lambda: fn(*args, **kwargs))

    def load_stats(self) -> dict[str, int]:
        """Requests waiting and running now, and the backend's live lanes."""
        return self.scheduler.load()

    def close(self) -> None:
        """End every queued and running request (``Cancelled``), free every lane, release the backend, in that
        order: the scheduler's thread is joined first, so that no pass runs on a released backend. A second call does
        nothing. Not needed at exit: an engine still open then is closed by ``_close_live_engines``."""
        with _LIVE_LOCK:
            if self._closed:
                return
            self._closed = True
            _LIVE.pop(self._live_key, None)
        with _ENGINES_LOCK:
            for key in [k for k, engine in _ENGINES.items() if engine is self]:
                del _ENGINES[key]
        self.scheduler.close()
        self.backend.release_all()
        self.backend.close()

    def __enter__(self) -> "SSREngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def costs(self) -> CostTable:
        return self.policy.costs

    @property
    def tie_window(self) -> float:
        """Twice the kernel noise calibration measured where a row's logits depend on the batch (0 where they do
        not): two candidates closer than this are a near-tie, which a batched step may resolve either way."""
        if getattr(self.backend, "row_exact", True):
            return 0.0
        return 2.0 * float(self.costs.meta.get("noise", 0.0))

    @property
    def context_window(self) -> int:
        return self.backend.context_window

    # -- prompts -------------------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, tools: list[dict] | None = None, tool_choice: str | None = None,
               thinking: bool | None = None) -> list[int]:
        """Prompt token ids (``ssr.chat.encode_prompt`` with this engine's tokenizer, family and context window)."""
        return encode_prompt(self.tokenizer, self.family, prompt, tools, tool_choice, self.context_window, thinking)

    def _request(self, prompt: Prompt, tools, tool_choice, config: SSRConfig | None, cancel=None,
                 thinking: bool | None = None, response_format: dict | None = None, cache_salt: str | None = None,
                 **overrides) -> Decoding:
        unknown = set(overrides) - set(_SAMPLING)
        if unknown:
            raise TypeError(f"unknown generation argument(s) {sorted(unknown)}")
        cfg = (config or self.config).override(**overrides)
        check_tools(tools, tool_choice)
        thinking = resolve_thinking(self.family, prompt, tools, tool_choice, thinking)
        grammar = self._grammar(response_format, tools if cfg.constrain_tool_calls else None, tool_choice)
        ids = self.encode(prompt, tools, tool_choice, thinking)
        opening = tool_call_opening(self.family, tool_choice, tools)
        window_cap = self._window_cap(len(ids), opening)
        if cfg.max_tokens > window_cap:
            cfg = cfg.override(max_tokens=window_cap, max_think_tokens=min(cfg.max_think_tokens, window_cap),
                               min_think_tokens=min(cfg.min_think_tokens, window_cap))
        request = Decoding(self.backend, self.tokenizer, self.family, cfg, ids, self.policy, thinking=thinking,
                           cancel=cancel, tools=tools if tool_choice != "none" else None, answer_opening=opening,
                           grammar=grammar, history=self.history,
                           cache_salt=self.cache_salt if cache_salt is None else cache_salt)
        request.window_cap = window_cap
        request.tie_window = self.tie_window
        return request

    def _window_cap(self, prompt_tokens: int, opening: str) -> int:
        """The most tokens a request may generate so that prompt plus generation stays in the context window:
        the room left, less the forced text (a close at the budget, a "Wait") that may follow the last token."""
        f, encode = self.family, self.tokenizer.encode
        forced = (len(encode(f.close_text + opening, add_special_tokens=False))
                  + len(encode(f.continue_text, add_special_tokens=False)))
        cap = self.context_window - prompt_tokens - forced
        if cap < 1:
            raise ValueError(f"the prompt ({prompt_tokens} tokens) leaves no room for an answer in the context "
                             f"window of {self.context_window} tokens")
        return cap

    def _grammar(self, response_format: dict | None, tools: list[dict] | None,
                 tool_choice: str | None) -> Grammar | None:
        """The grammar the answer must follow: the response format's JSON schema, or the bound tools' calls."""
        schema = response_schema(response_format)
        calls = bool(tools) and tool_choice != "none"
        if schema is not None and calls:
            raise ValueError("response_format and tools cannot both shape one answer: bind the schema as a tool "
                             "(tool_choice=<its name>) or leave the tools out")
        if schema is None and not calls:
            return None
        if self.family.harmony:  # its answer opens with channel headers, which these grammars do not know
            if schema is not None:
                raise ValueError("response_format is not supported for harmony (gpt-oss) models yet")
            return None
        grammars, family = self.grammars(), self.family
        text = json_grammar(schema) if schema is not None else tool_call_grammar(
            tools or [], tool_choice, family.tool_call_open, family.tool_call_close,
            special_markers=grammars.is_special(family.tool_call_open))
        return grammars.compile(text)

    def grammars(self) -> Grammars:
        """Grammar support, built on first use (the tokenizer's conversion takes seconds for a 150k vocabulary);
        call it before timing anything so that no timed request pays for it."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.backend.vocab_size, self.backend.eos_token_ids)
        return self._grammars

    # -- running -------------------------------------------------------------------------------------------------------
    def stream(self, prompt: Prompt, *, tools: list[dict] | None = None, tool_choice: str | None = None,
               config: SSRConfig | None = None, thinking: bool | None = None, response_format: dict | None = None,
               timeout: float | None = None, cache_salt: str | None = None, _cancel: threading.Event | None = None,
               **overrides) -> Iterator[StreamEvent]:
        """Yield reasoning and answer deltas as they become final, then a "done" event with the result.

        ``thinking=False`` answers at once, with the model's own chat template (no thinking recipe); ``True``
        always thinks; ``None`` (the default) lets ``ssr.chat.resolve_thinking`` decide: an instruct model with
        tools bound under "auto" decides on a call without thinking, and thinks once a tool result is in.

        ``response_format`` (OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
        {"schema": ...}}``) and bound ``tools`` constrain the answer with a grammar, in plain decoding and SSR
        alike.

        ``timeout`` (seconds from now, queue time included) ends the request with ``ssr.errors.RequestTimeout``;
        a full queue raises ``ssr.errors.QueueFull`` at once. Closing the iterator early cancels the request, which
        frees its lanes before the next pass.

        ``cache_salt`` (vLLM's): the request's prompt reuses only the cached prompts (parked lanes) of requests with
        the same salt, and its own is kept under it; None: the engine's ``cache_salt``."""
        _check_arguments(prompt, tools, tool_choice, config, thinking, response_format, timeout,
                         self.backend.vocab_size, cache_salt)
        request = self._request(prompt, tools, tool_choice, config, cancel=_cancel, thinking=thinking,
                                response_format=response_format, cache_salt=cache_salt, **overrides)
        id_seed = prompt_seed(request.prompt_ids) if tools else None  # the same request gets the same call ids
        calls = (ToolCallStream(tools, self.family.tool_call_open, self.family.tool_call_close, id_seed)
                 if tools else None)
        job = self.scheduler.submit(request, timeout)
        try:
            for kind, text in job.results():
                if kind == "answer" and calls is not None:
                    yield from _events(calls.feed(text))
                else:
                    yield StreamEvent(kind, text)
        finally:
            request.cancel.set()  # a no-op once it has ended; a caller that stops reading cancels it
        parsed = request.transcript.tool_calls(tools, id_seed) if tools else None  # in the family's call format
        if calls is not None and parsed is not None:  # both exist exactly when tools are bound
            yield from _events(calls.finish(parsed))  # also gives the parsed calls their streamed ids
        yield StreamEvent("done", result=self._result(request, parsed, job.queue_seconds))

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        """Think, then answer; same keywords as ``stream``."""
        for event in self.stream(prompt, **kwargs):
            if event.kind == "done" and event.result is not None:  # "done" always carries it
                return event.result
        raise RuntimeError("generation ended without a result")  # unreachable

    async def astream(self, prompt: Prompt, **kwargs) -> AsyncIterator[StreamEvent]:
        """``stream`` on a worker thread; the event loop never blocks. Closing the iterator cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        end = object()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening
                cancel.set()

        def produce() -> None:
            try:
                for event in self.stream(prompt, _cancel=cancel, **kwargs):
                    put(event)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                put(exc)
            finally:
                put(end)

        threading.Thread(target=produce, daemon=True, name="ssr-request").start()
        try:
            while (item := await queue.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()

    async def agenerate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        async for event in self.astream(prompt, **kwargs):
            if event.kind == "done" and event.result is not None:  # "done" always carries it
                return event.result
        raise RuntimeError("generation ended without a result")  # unreachable

    def _result(self, request: Decoding, parsed: ToolCallParse | None, queue_seconds: float) -> GenerationResult:
        t = request.transcript
        answer = t.answer()
        reason = t.finish.reason if t.finish else "stop"
        if parsed and parsed.tool_calls and reason == "stop":
            reason = "tool_calls"
        stats = request.stats()
        stats["seconds"] = {**stats["seconds"], "queue": round(queue_seconds, 4)}  # waiting for a running slot
        if reason == "length" and request.window_cap is not None and len(t.tokens) >= request.window_cap:
            stats["finish_note"] = (f"the context window of {self.context_window} tokens is full: "
                                    f"{len(request.prompt_ids)} prompt + {len(t.tokens)} generated tokens")
        return GenerationResult(
            reasoning=t.reasoning(), answer=answer, token_ids=list(t.tokens), prompt_tokens=len(request.prompt_ids),
            finish_reason=reason, stats=stats,
            tool_calls=parsed.tool_calls if parsed else [],
            invalid_tool_calls=parsed.invalid_tool_calls if parsed else [],
            content=parsed.content if parsed else answer, near_ties=dict(request.near_ties),
            prompt_token_ids=list(request.prompt_ids),
        )


def _check_arguments(prompt, tools, tool_choice, config, thinking, response_format, timeout,
                     vocab_size: int, cache_salt=None) -> None:
    """The shapes of one request's arguments, checked before anything is built from them, so that a wrong one is a
    ``TypeError`` (wrong type) or ``ValueError`` (wrong value) that names it, not an error from deep inside the
    template, the grammar or the model. Values are checked where they are used (``SSRConfig`` the sampling settings,
    ``encode_prompt`` roles and length, ``check_tools`` the tools' schemas, ``response_schema`` the format)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        outside = [t for t in prompt if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    elif isinstance(prompt, list):
        for i, message in enumerate(prompt):
            _check_message(message, f"prompt[{i}]")
    elif not isinstance(prompt, str):
        raise TypeError(f"prompt must be text, a list of chat messages or a list of token ids, got "
                        f"{type(prompt).__name__}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TypeError(f'tools must be a list of {{"type": "function", "function": {{...}}}} dicts, got {tools!r}')
    for name, value, kind, want in (("tool_choice", tool_choice, str, "a string"),
                                    ("config", config, SSRConfig, "an SSRConfig"),
                                    ("thinking", thinking, bool, "a bool"),
                                    ("response_format", response_format, dict, "a dict"),
                                    ("cache_salt", cache_salt, str, "a string")):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be None or {want}, got {value!r} ({type(value).__name__})")
    if timeout is not None and not (isinstance(timeout, Real) and not isinstance(timeout, bool)):
        raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
    if timeout is not None and not float(timeout) > 0:  # NaN too
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


def _check_message(message, where: str) -> None:
    """One chat message: a dict with a string role, string (or no) content, and well-formed tool calls."""
    if not isinstance(message, dict):
        raise TypeError(f"{where}: a prompt list holds chat-message dicts or token ids (ints), got {message!r}")
    if not isinstance(message.get("role"), str):
        raise TypeError(f"{where}.role must be a string (system, user, assistant or tool), got "
                        f"{message.get('role')!r}")
    for key in ("content", "tool_call_id", "name"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise TypeError(f"{where}.{key} must be a string, got {message[key]!r}")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise TypeError(f"{where}.tool_calls must be a list of calls, got {calls!r}")
    for j, call in enumerate(calls or []):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", fn.get("args", {})), (str, dict))):
            raise TypeError(f'{where}.tool_calls[{j}] must be {{"function": {{"name": str, "arguments": dict or '
                            f"JSON text}}}}, got {call!r}")


def _events(pieces) -> Iterator[StreamEvent]:
    """The tool-call stream's pieces as engine events: content as "answer", call pieces as "tool_call"."""
    for kind, value in pieces:
        yield StreamEvent("answer", value) if kind == "content" else StreamEvent("tool_call", tool_call=value)


_ENGINES: dict[tuple, SSREngine] = {}  # get_engine's: one per (model, backend, options), held until closed
_ENGINES_LOCK = threading.Lock()
_LIVE: weakref.WeakValueDictionary[int, SSREngine] = weakref.WeakValueDictionary()  # every open engine, oldest first
_LIVE_KEYS = itertools.count()
_LIVE_LOCK = threading.Lock()  # not _ENGINES_LOCK: get_engine holds that one while an engine is built
_exit_hook = False


def _track(engine: SSREngine) -> int:
    """Hold ``engine`` weakly among the live engines (an engine its user dropped is not kept alive) and, on the
    first engine, register ``_close_live_engines`` at exit: after the backend's library has been imported, so that
    the hook runs before any exit hook of that library (atexit runs the last registered first)."""
    global _exit_hook
    with _LIVE_LOCK:
        key = next(_LIVE_KEYS)
        _LIVE[key] = engine
        if not _exit_hook:
            atexit.register(_close_live_engines)
            _exit_hook = True
    return key


def _close_live_engines() -> None:
    """Close every engine still open, newest first: an atexit hook, so a program that never calls ``close()``
    still exits cleanly.

    Why: the scheduler steps the backend in a daemon thread, which may still be in a pass (a request streaming) or
    just leaving one (freeing its logits, after ``generate`` has returned) when the interpreter finalizes. CPython
    before 3.14 ends a daemon thread that takes the GIL during finalization with ``pthread_exit``; its forced unwind
    through torch's noexcept C++ frames (a tensor's destructor re-taking the GIL) calls ``std::terminate``:
    "terminate called without an active exception", exit status 134. atexit hooks run before finalization, so here
    the thread still finishes its pass, is stopped and joined, and then the lanes and the backend (llama.cpp's
    context, vLLM's engine) are released while every library is still loaded."""
    with _LIVE_LOCK:
        engines = list(_LIVE.values())
    for engine in reversed(engines):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the other engines are closed all the same
            log.exception("closing the engine of %s at exit failed", engine.model_name)


def get_engine(model: str | None = None, backend: str = "auto", **backend_kwargs) -> SSREngine:
    """The process-wide engine for (model, backend): every adapter instance naming it shares one loaded model.
    ``"auto"`` is the backend ``ssr.backends.choose_backend`` picks for the model."""
    backend = choose_backend(backend, canonical_name(model))
    key = (canonical_name(model), backend, tuple(sorted((k, repr(v)) for k, v in backend_kwargs.items())))
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = SSREngine.from_pretrained(model, backend=backend, **backend_kwargs)
        return _ENGINES[key]
