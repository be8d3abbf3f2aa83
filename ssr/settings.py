"""Settings both framework adapters take the same way: the thinking budget by name, the aliases users type for the
token limit, and a server key given among the backend options."""

from __future__ import annotations

import hashlib
from typing import Any

REASONING_EFFORT_BUDGETS = {"low": 128, "medium": 512, "high": 2048}
"""``reasoning_effort`` -> the thinking budget (``SSRConfig.max_think_tokens``); 512 is ``SSRConfig``'s default."""


def normalise_settings(owner: str, values: dict[str, Any], max_tokens_aliases: tuple[str, ...]) -> dict[str, Any]:
    """``values`` with the token-limit aliases folded into ``max_tokens`` (two of them at once is an error) and an
    ``api_key`` found in ``backend_kwargs`` moved to the ``api_key`` setting (kept secret there)."""
    values = dict(values)
    given = {k: values.pop(k) for k in max_tokens_aliases if k in values}
    named = {k: v for k, v in given.items() if v is not None}
    if len(named) > 1:
        raise TypeError(f"{owner} got {sorted(named)}: they name one setting (the most tokens to generate); "
                        "give only one")
    if given:
        values["max_tokens"] = next(iter(named.values()), None)
    backend_kwargs = values.get("backend_kwargs")
    if isinstance(backend_kwargs, dict) and "api_key" in backend_kwargs:
        backend_kwargs = dict(backend_kwargs)
        key = backend_kwargs.pop("api_key")
        if values.get("api_key") is None:
            values["api_key"] = key
        values["backend_kwargs"] = backend_kwargs
    return values

SERVER_BACKENDS = frozenset({"vllm-server"})  # the backends that take api_key, timeout and max_retries


class ApiKey(str):
    """The API key as text for the backend, with a ``repr`` that shows only a digest: the engine registry keys
    engines by ``repr`` of their backend arguments, so different keys stay different engines and no key is shown."""

    def __repr__(self) -> str:
        return f"<api key sha256:{hashlib.sha256(self.encode()).hexdigest()[:12]}>"


def backend_kwargs(backend: str, kwargs: dict[str, Any] | None, api_key: Any, timeout: float | None,
                   max_retries: int | None) -> dict[str, Any]:
    """An adapter's ``backend_kwargs`` plus, for a server backend, its API key (a ``SecretStr``), timeout and
    retries."""
    out = dict(kwargs or {})
    if backend in SERVER_BACKENDS:
        if api_key is not None and api_key.get_secret_value():
            out.setdefault("api_key", ApiKey(api_key.get_secret_value()))
        if timeout is not None:
            out.setdefault("timeout", timeout)
        if max_retries is not None:
            out.setdefault("max_retries", max_retries)
    return out
