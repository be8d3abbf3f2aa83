"""The engine's tests: the tiny-model, scripted-backend and server helpers of this folder on sys.path, and the
shared fixtures (the real default model, its tokenizer, no network) from shared_fixtures.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# the shared fixtures (the default model, its tokenizer, no network), and the hooks of parallel runs (pytest-xdist:
# workers, their torch threads, tests that share a worker), registered by import
from shared_fixtures import *  # noqa: E402, F403
