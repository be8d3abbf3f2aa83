"""Errors a request can end with besides a backend's own (``ssr.backends.errors.SSRBackendError``)."""

from __future__ import annotations


class Cancelled(Exception):
    """The caller stopped the request (closed its stream, cancelled its task); its lanes are already free."""


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is at its bound (``SSRConfig``-independent: ``SSREngine(max_queue=)``);
    a server answers 503."""


class RequestTimeout(TimeoutError):
    """The request ran past its ``timeout`` (seconds from submission, queue time included); its lanes are free."""
