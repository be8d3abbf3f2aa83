"""The engine's tests: the tiny-model, scripted-backend and server helpers of this folder on sys.path, and the
shared fixtures (the real default model, its tokenizer, no network) from shared_fixtures.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from shared_fixtures import default_engine, no_network, tokenizer  # noqa: E402, F401  (registered by import)
# the hooks of parallel runs (pytest-xdist: workers, their torch threads, tests that share a worker)
from shared_fixtures import pytest_cmdline_main, pytest_collection_modifyitems, pytest_configure  # noqa: E402, F401
