"""What a backend raises when it cannot go on; every class is an ``SSRBackendError``, so one ``except`` catches all.

The request that met one ends with it; other requests and the backend go on (``ssr.scheduler``)."""

from __future__ import annotations


class SSRBackendError(RuntimeError):
    """A backend failed to run a step (the request cannot go on)."""


class SSRBackendUnavailable(SSRBackendError):
    """The backend cannot be used here (a package is missing, or the server is not a vLLM server)."""


class SSRBackendConnectionError(SSRBackendError):
    """The inference server could not be reached (refused, reset, unreachable)."""


class SSRBackendTimeout(SSRBackendError):
    """The inference server did not answer within the timeout."""


class SSRBackendServerError(SSRBackendError):
    """The inference server answered with an error status or a malformed body."""

    def __init__(self, message: str, status: int | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class LlamaCppError(SSRBackendError):
    """llama.cpp refused a call (loading, a decode, a cache operation), or the tokenizer does not match its
    vocabulary."""
