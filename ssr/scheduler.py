"""The engine's scheduler: one thread steps the lanes of every live request together (continuous batching).

A request is a generator (``ssr.decode.Decoding.run``) that yields the pass it needs next. Between passes requests
join and leave; each pass puts the thinking, draft and answer lanes of every running request into ONE backend
step, since a step with a few more rows costs little more than one row. A new request's prefill runs in a pass of
its own, in chunks while others are decoding, so a long prompt stalls them by one chunk at a time; requests start
one prefill at a time, so that a request can fork the cached prompt of one already running (``Backend.new_lane``).

Only this thread touches the backend, so callers iterate their streams without holding any lock; other compute
that must share its OpenMP team runs there too, between passes (``call``). Admission is
bounded (``QueueFull``); a request that times out, or whose caller cancels it, is closed at the next pass
boundary, queued, prefilling or mid-stream alike, which frees its lanes; a pass that raises fails only the
requests in it, and the scheduler goes on serving the others.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable, Iterator, TypeVar

from .decode import Decoding, Event, Phase, Step
from .errors import Cancelled, QueueFull, RequestTimeout
from .policy import Shared

_END = object()
T = TypeVar("T")


class Job:
    """One submitted request: its generator, the events its caller reads, its deadline, the pass it waits for."""

    def __init__(self, request: Decoding, timeout: float | None) -> None:
        self.request = request
        self.run = request.run()
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # Events, then _END or the exception it ended with
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.deadline = None if timeout is None else self.submitted + timeout
        self.step: Step | None = None
        self.prefilled = 0  # tokens of a chunked prefill already fed

    @property
    def next_step(self) -> Step:
        """The pass the request waits for; only a job that has one (``step`` not None) is in a pass."""
        if self.step is None:
            raise RuntimeError("the request waits for no pass: it has ended")
        return self.step

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted

    def advance(self, out=None) -> None:
        """Resume the request with its pass's logits; it runs until it asks for the next pass, or ends."""
        try:
            item = self.run.send(out)
            while not isinstance(item, Step):
                self.events.put(item)
                item = self.run.send(None)
            self.step = item
        except StopIteration:
            self.step = None
            self.events.put(_END)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            self.step = None
            self.events.put(exc)

    def stop(self, exc: BaseException) -> None:
        """End the request with ``exc``: closing its generator frees its lanes."""
        self.step = None
        try:
            self.run.close()
        except Exception as cleanup:  # noqa: BLE001 - the request ends either way; the caller hears of both
            exc.__context__ = cleanup
        self.events.put(exc)

    def why_stop(self, now: float) -> BaseException | None:
        if self.request.cancel.is_set():
            return Cancelled("request cancelled")
        if self.deadline is not None and now > self.deadline:
            return RequestTimeout(f"request timed out after {now - self.submitted:.1f} s "
                                  f"({self.queue_seconds:.1f} s of it queued)")
        return None

    def results(self) -> Iterator[Event]:
        """The request's events as they come (the caller's thread); raises the error it ended with."""
        while (item := self.events.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """Runs every submitted request on ``backend`` from one thread, ``max_running`` at a time."""

    def __init__(self, backend, max_queue: int = 64, max_running: int = 16, prefill_chunk: int = 128) -> None:
        self.backend = backend
        self.max_queue, self.max_running, self.prefill_chunk = max_queue, max_running, prefill_chunk
        self.passes = 0  # backend steps run (one per iteration and kind: decode, prefill)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._calls: collections.deque[tuple[Callable[[], object], dict, threading.Event]] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- callers' side -------------------------------------------------------------------------------------------
    def submit(self, request: Decoding, timeout: float | None = None) -> Job:
        """Queue ``request``; raises ``QueueFull`` when ``max_queue`` requests are already waiting."""
        job = Job(request, timeout)
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}); "
                                f"retry later")
            self._waiting.append(job)
            self._start()
            self._wake.notify()
        return job

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the scheduler's thread, between two passes (running requests wait for it); its result
        returned, its exception raised here. Why: compute on another long-lived thread starts an OpenMP team of its
        own, which slows every later step (``ssr.threads``); on this thread it shares the steps' team."""
        if threading.current_thread() is self._thread:
            return fn()
        box: dict = {}
        done = threading.Event()
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._calls.append((fn, box, done))
            self._start()
            self._wake.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _start(self) -> None:
        """Start the thread on first use (under ``_wake``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="ssr-scheduler")
            self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def load(self) -> dict[str, int]:
        """Requests queued and running, the backend's live lanes and (where it says) the bytes its cache holds."""
        with self._wake:
            load = {"queued": len(self._waiting), "running": len(self._running),
                    "live_lanes": self.backend.live_lanes}
        memory = self.backend.memory_bytes
        if memory is not None:
            load["cache_bytes"] = memory
        return load

    def close(self) -> None:
        """Stop the thread; requests still queued or running end with ``Cancelled``."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the scheduler's thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._running or self._calls or self._closed):
                    self._wake.wait()
                if self._closed:
                    jobs, self._running = list(self._waiting) + self._running, []
                    self._waiting.clear()
                    break
                calls = list(self._calls)
                self._calls.clear()
            for call in calls:
                _run_call(*call)
            self._admit()
            self._iterate()
            with self._wake:
                self._running = [job for job in self._running if job.step is not None]
        for job in jobs:
            job.stop(Cancelled("the engine was closed"))
        with self._wake:
            calls = list(self._calls)
            self._calls.clear()
        for _, box, done in calls:
            box["error"] = RuntimeError("the engine is closed")
            done.set()

    def _admit(self) -> None:
        """Start the next waiting request once no request is prefilling: its lane can then fork the cached prompt
        of a running request that shares its prefix (a common system prompt is prefilled once), and prefills, which
        cost the same merged or apart, run one at a time."""
        while not any(job.step is not None and job.step.phase == Phase.PREFILL for job in self._running):
            with self._wake:
                if not self._waiting or len(self._running) >= self.max_running:
                    return
                job = self._waiting.popleft()
            job.started = time.perf_counter()
            if (why := job.why_stop(job.started)) is not None:  # cancelled or timed out while queued
                job.stop(why)
                continue
            job.advance()
            if job.step is not None:
                self._running.append(job)

    def _iterate(self) -> None:
        """One decode pass over every running request's lanes, then one prefill pass (a chunk each)."""
        now = time.perf_counter()
        for job in self._running:
            if job.step is not None and (why := job.why_stop(now)) is not None:
                job.stop(why)
        ready = [job for job in self._running if job.step is not None]
        decoding = [job for job in ready if job.next_step.phase != Phase.PREFILL]
        prefilling = [job for job in ready if job.next_step.phase == Phase.PREFILL]
        if decoding:
            self._pass(decoding, {job: (job.next_step.feeds, job.next_step.want) for job in decoding})
        if prefilling:
            self._pass(prefilling, {job: self._prefill_chunk(job, chunked=bool(decoding)) for job in prefilling})

    def _prefill_chunk(self, job: Job, chunked: bool) -> tuple[dict, dict]:
        """The next part of ``job``'s prefill: all of it when nothing else decodes, else ``prefill_chunk`` tokens."""
        (lane, tokens), = job.next_step.feeds.items()
        rest = tokens[job.prefilled:]
        if chunked and len(rest) > self.prefill_chunk:
            return {lane: rest[: self.prefill_chunk]}, {lane: 1}
        return {lane: rest}, job.next_step.want

    def _pass(self, jobs: list[Job], parts: dict[Job, tuple[dict, dict]]) -> None:
        feeds, want = {}, {}
        for job_feeds, job_want in parts.values():
            feeds.update(job_feeds)
            want.update(job_want)
        try:
            out = self.backend.step(feeds, want)
        except Exception as exc:  # noqa: BLE001 - only the requests in this pass fail
            for job in jobs:
                job.stop(exc)
            return
        finally:
            self.passes += 1
        if jobs[0].next_step.phase != Phase.PREFILL:
            _share(jobs, parts)
        for job in jobs:
            job_feeds = parts[job][0]
            if job.next_step.phase == Phase.PREFILL:
                (lane, fed), = job_feeds.items()
                job.prefilled += len(fed)
                if job.prefilled < len(job.next_step.feeds[lane]):
                    continue  # more of the prompt to come; these logits are not needed
            job.advance({lane: out[lane] for lane in job_feeds})


def _run_call(fn: Callable[[], object], box: dict, done: threading.Event) -> None:
    try:
        box["result"] = fn()
    except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
        box["error"] = exc
    finally:
        done.set()


def _share(jobs: list[Job], parts: dict[Job, tuple[dict, dict]]) -> None:
    """Tell each request of a decode pass what the others put in it, for its next speculation choices."""
    rows = {job: len(parts[job][0]) for job in jobs}
    widths = sorted(((max(map(len, parts[job][0].values())), id(job)) for job in jobs), reverse=True)
    total = sum(rows.values())
    for job in jobs:
        widest_other = next((w for w, who in widths if who != id(job)), 1)
        job.request.shared = Shared(rows=total - rows[job], width=widest_other, requests=len(jobs) - 1)
