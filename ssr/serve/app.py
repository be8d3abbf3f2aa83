"""The OpenAI-compatible HTTP API over one ``SSREngine``: ``create_app(engine)`` is a FastAPI application.

Requests go to the engine's scheduler through ``engine.astream``; closing that iterator cancels the request and
frees its lanes, which is what a client that disconnects (or a request that times out) gets. Streaming answers are
server-sent events, the first one sent only once the engine has taken the request (so that a full queue or a bad
schema is an HTTP error status, not an event in a 200 stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..chat import encode_prompt
from ..errors import Cancelled, QueueFull, RequestTimeout
from ..models import canonical_name
from . import convert
from .metrics import Metrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, bad_request, parse

log = logging.getLogger("ssr.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed its connection before the answer was complete (logged as status 499)."""


def _error_of(exc: BaseException, param: str | None = None) -> ApiError:
    """The HTTP error an exception from a request becomes (``param``: what an engine's ValueError is about)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(503, f"the server is busy: {exc or 'the queue of waiting requests is full'}; retry later",
                        code="queue_full")
    if isinstance(exc, (RequestTimeout, asyncio.TimeoutError, TimeoutError)):
        return ApiError(408, f"the request timed out: {exc}" if str(exc) else "the request timed out",
                        code="timeout")
    if isinstance(exc, (ClientGone, ClientDisconnect, Cancelled)):  # ClientDisconnect: gone while sending the body
        return ApiError(499, "the client closed the request", code="cancelled")
    if isinstance(exc, (ValueError, TypeError)):  # the engine refused the request (schema, tool choice, ...)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return bad_request(message, param, "invalid_schema" if "schema" in message else "invalid_value")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Track:
    """One request's latency, outcome and tokens: the metrics, and its one log line."""

    def __init__(self, server: "Server", endpoint: str, stream: bool) -> None:
        self.server, self.endpoint, self.stream = server, endpoint, stream
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.done = False
        server.metrics.started()

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter() - self.start

    def finish(self, status: int, result: Any = None, error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        seconds = time.perf_counter() - self.start
        self.server.metrics.finished(self.endpoint, status, seconds, result)
        head = f"{self.endpoint} {status}{' stream' if self.stream else ''} {seconds:.2f} s"
        if self.first_token is not None and self.stream:
            head += f" (first token {self.first_token:.2f} s)"
        parts = [head]
        if result is not None:
            s = result.stats
            if s.get("queue_seconds"):
                parts[0] += f" (queued {s['queue_seconds']:.2f} s)"
            parts.append(f"prompt {result.prompt_tokens} tokens (cached {s.get('reused_prompt_tokens', 0)}), "
                         f"completion {len(result.token_ids)} (reasoning {s.get('think_tokens', 0)}), "
                         f"finish {result.finish_reason}")
            if s.get("enabled", True):
                parts.append(f"SSR: {s.get('forward_passes')} forward passes for {s.get('plain_forward_passes')} "
                             f"plain (saved {s.get('forward_passes_saved')}), {s.get('accepted_tokens', 0)} answer "
                             f"and {s.get('think_accepted_tokens', 0)} thinking tokens from verified proposals")
        if error:
            parts.append(error)
        log.info("; ".join(parts))


class Server:
    """The application's state: the engine, the key, the names the model answers to, metrics."""

    def __init__(self, engine, api_key: str | None = None, served_model_name: str | None = None,
                 timeout: float | None = None) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.model_name = served_model_name or engine.model_name
        self.timeout = timeout
        self.metrics = Metrics()
        self.created = int(time.time())

    # -- checks ------------------------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    def check_model(self, model: str) -> None:
        if model in (self.model_name, self.engine.model_name) or canonical_name(model) == self.engine.model_name:
            return
        raise ApiError(400, f"unknown model {model!r}: this server serves {self.model_name!r} (GET /v1/models)",
                       "model", "model_not_found")

    def check_length(self, ids: list[int], param: str) -> None:
        window = self.engine.context_window
        if len(ids) >= window:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, over the model's context window of {window} "
                           "tokens (leave room for the answer)", param, "context_length_exceeded")

    def load(self) -> dict[str, int]:
        return self.engine.load_stats()

    # -- running -----------------------------------------------------------------------------------------------
    async def events(self, request: Request, prompt, call: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The engine's events for one request, until it ends, the client disconnects (``ClientGone``) or the
        timeout passes (``RequestTimeout``); in every case but the end the request is cancelled on the way out."""
        if self.timeout is not None:
            call = {**call, "timeout": self.timeout}  # the engine's: queue time included, lanes freed at once
        it = self.engine.astream(prompt, **call)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if step in done:
                    try:
                        event = step.result()
                    except StopAsyncIteration:
                        return
                    step = None
                    yield event
                    continue
                raise ClientGone()
        finally:
            watcher.cancel()
            if step is not None and not step.done():
                step.cancel()  # the engine's iterator, interrupted where it waits: its cleanup cancels the request
            else:
                await it.aclose()

    async def run(self, request: Request, prompt, call: dict[str, Any]) -> Any:
        result = None
        async for event in self.events(request, prompt, call):
            if event.kind == "done":
                result = event.result
        if result is None:
            raise RuntimeError("the engine ended the request without a result")
        return result

    async def stream(self, request: Request, prompt, call: dict[str, Any], chunks, track: _Track) -> Response:
        """An SSE response; the engine's first event is awaited here, so its errors get their status."""
        events = self.events(request, prompt, call)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await events.aclose()
            raise

        async def body() -> AsyncIterator[str]:
            result, status, error = None, 200, None
            try:
                if hasattr(chunks, "first"):
                    yield _sse(chunks.first())
                pending = [first] if first is not None else []
                while True:
                    event = pending.pop() if pending else await events.__anext__()
                    if event.kind in ("reasoning", "answer", "tool_call"):
                        track.token()
                    elif event.kind == "done":
                        result = event.result
                    for chunk in chunks.feed(event):
                        yield _sse(chunk)
            except StopAsyncIteration:
                yield "data: [DONE]\n\n"
            except (ClientGone, asyncio.CancelledError, GeneratorExit):
                status = 499
                raise
            except Exception as exc:  # noqa: BLE001 - the stream has begun: the error goes out as an event
                err = _error_of(exc)
                status, error = err.status, err.message
                if err.status == 500:
                    log.exception("error in a stream")
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
            finally:
                await events.aclose()
                track.finish(status, result, error)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _body(request: Request) -> Any:
    """The request's JSON. Every way it can be unreadable is a 400: not JSON, not UTF-8, nested deeper than the
    parser recurses (``RecursionError``), an integer past Python's digit limit (``ValueError``), or a string holding
    a lone surrogate (``\\ud800`` is valid JSON but not text: the tokenizer cannot encode it)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise bad_request(f"the request body is not valid JSON: {why}", code="invalid_json") from None
    if (where := _lone_surrogate(body)) is not None:
        raise bad_request(f"{where or 'the body'}: a string holds a lone UTF-16 surrogate, which is not text",
                          where or None, "invalid_json")
    return body


def _lone_surrogate(body: Any) -> str | None:
    """The path of a string (or key) in ``body`` that is not valid Unicode, or None (iterative: a body as deep as
    the parser allows does not recurse here)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key.encode("utf-8", "backslashreplace").decode()  # the path goes into the (UTF-8) answer
                stack += [(f"{path}.{name}" if path else name, key), (f"{path}.{name}" if path else name, item)]
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def create_app(engine, api_key: str | None = None, *, served_model_name: str | None = None,
               timeout: float | None = None, close_engine: bool = False) -> FastAPI:
    """The OpenAI-compatible application over ``engine``.

    ``api_key``: every ``/v1`` request must send ``Authorization: Bearer <api_key>`` (401 otherwise); ``/health``
    and ``/metrics`` stay open. ``served_model_name``: the model's name in the API (default: the engine's).
    ``timeout``: seconds a request may take, queue time included (408 after it; the request is cancelled).
    ``close_engine``: close the engine when the application shuts down (``ssr serve``'s own engine: uvicorn ends a
    server stopped by SIGTERM by raising the signal again once it has shut down, so nothing after ``uvicorn.run``,
    nor any exit hook, runs then).
    """
    server = Server(engine, api_key, served_model_name, timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine:  # the requests have ended (uvicorn's graceful shutdown): stop the scheduler, free the model
            await asyncio.to_thread(engine.close)
            log.info("engine closed")

    app = FastAPI(title="SSR", description="OpenAI-compatible API over an SSR engine", version="1", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                          str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_name, "in_flight": server.metrics.in_flight, **server.load()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(server.load()), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "ssr",
                "max_model_len": engine.context_window}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        server.authorize(request)
        try:
            server.check_model(model)
        except ApiError as exc:
            raise ApiError(404, exc.message, "model", exc.code) from None
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        track = _Track(server, "chat.completions", False)
        req = None
        try:
            server.authorize(request)
            req = parse(ChatCompletionRequest, await _body(request))
            track.stream = bool(req.stream)
            server.check_model(req.model)
            req.check()
            messages = convert.chat_messages(req)
            call = convert.chat_call(req, engine)
            try:
                ids = await asyncio.to_thread(encode_prompt, engine.tokenizer, engine.family, messages,
                                              call.get("tools"), call.get("tool_choice"), None,
                                              call.get("thinking"))
            except Exception as exc:  # noqa: BLE001 - the template refused the conversation (roles, order, ...)
                raise bad_request(str(exc) if isinstance(exc, ValueError) else
                                  f"the chat template cannot render these messages: {exc}", "messages") from None
            server.check_length(ids, "messages")
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            parallel = req.parallel_tool_calls is not False
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                chunks = convert.ChatChunks(id=rid, created=created, model=server.model_name,
                                            include_usage=include_usage, parallel_tool_calls=parallel,
                                            return_token_ids=bool(req.return_token_ids))
                return await server.stream(request, messages, call, chunks, track)
            result = await server.run(request, messages, call)
            track.finish(200, result)
            return JSONResponse(convert.chat_response(result, id=rid, created=created, model=server.model_name,
                                                      parallel_tool_calls=parallel,
                                                      return_token_ids=bool(req.return_token_ids)))
        except asyncio.CancelledError:  # the server is shutting down
            track.finish(499, error="cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every error is answered in OpenAI's format
            return _failed(track, _error_of(exc, None if req is None else "response_format"
                                            if req.response_format is not None else "tools" if req.tools else None))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        track = _Track(server, "completions", False)
        req = None
        try:
            server.authorize(request)
            req = parse(CompletionRequest, await _body(request))
            track.stream = bool(req.stream)
            server.check_model(req.model)
            req.check()
            prompt = req.prompt_value()
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(lambda: list(engine.tokenizer.encode(prompt)))
            else:
                vocab = getattr(engine.backend, "vocab_size", None) or len(engine.tokenizer)
                if any(not 0 <= t < vocab for t in prompt):
                    raise bad_request(f"prompt holds token ids outside the vocabulary [0, {vocab})", "prompt")
                ids = prompt
            server.check_length(ids, "prompt")
            call = {**convert.sampling(req), "thinking": False}  # raw text: the model continues it, no chat
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                chunks = convert.CompletionChunks(id=rid, created=created, model=server.model_name,
                                                  include_usage=include_usage,
                                                  return_token_ids=bool(req.return_token_ids), prompt_ids=ids)
                return await server.stream(request, ids, call, chunks, track)
            result = await server.run(request, ids, call)
            track.finish(200, result)
            return JSONResponse(convert.completion_response(result, id=rid, created=created,
                                                            model=server.model_name,
                                                            return_token_ids=bool(req.return_token_ids),
                                                            prompt_ids=ids))
        except asyncio.CancelledError:  # the server is shutting down
            track.finish(499, error="cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every error is answered in OpenAI's format
            return _failed(track, _error_of(exc))

    return app


def _failed(track: "_Track", err: ApiError) -> Response:
    """Log a failed request and answer it: 499 has no body (the client is gone); the rest are raised as errors,
    which the app's handler writes in OpenAI's format."""
    track.finish(err.status, error=err.message)
    if err.status == 499:
        return Response(status_code=499)
    if err.status == 500:
        log.exception("internal error")
    raise err from None
