"""The engine stands alone (issue 17): importing it needs nothing from the benchmark harness (``ssr_bench``), the
adapters (``langchain_ssr``, ``llama_index.llms.ssr``) or their frameworks, and ``ssr bench`` without the harness
names the command that installs it.

Each check runs in a fresh interpreter in which those modules cannot be imported: a finder at the head of
``sys.meta_path`` refuses them (as if they were not installed) and records every attempt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BLOCKED = ("ssr_bench", "langchain_ssr", "llama_index", "langchain_core")

BLOCKER = f"""
import importlib, json, pkgutil, sys

BLOCKED = {BLOCKED!r}
attempts = []

class Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Blocker)
"""

IMPORT_ENGINE = BLOCKER + """
for name in ("ssr", "ssr.engine", "ssr.scheduler", "ssr.serve"):
    importlib.import_module(name)
import ssr.backends
optional = {}  # backends whose own optional dependency (vllm, llama_cpp, ...) is not installed
for info in pkgutil.iter_modules(ssr.backends.__path__):
    try:
        importlib.import_module(f"ssr.backends.{info.name}")
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] in BLOCKED + ("ssr",):
            raise
        optional[info.name] = exc.name
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
print(json.dumps({"attempts": attempts, "loaded": loaded, "optional": optional,
                  "backends": sorted(m for m in sys.modules if m.startswith("ssr.backends."))}))
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, outside the repository (so only installed packages can be imported)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_engine_imports_without_the_harness_and_the_adapters(tmp_path):
    proc = _run(IMPORT_ENGINE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [] and report["attempts"] == [], report
    imported = set(report["backends"])
    assert {"ssr.backends.base", "ssr.backends.transformers", "ssr.backends.vllm_server"} <= imported, report


def test_ssr_bench_without_the_harness_names_its_install_command(tmp_path):
    proc = _run(BLOCKER + "from ssr.cli import main\nmain(['bench', '--suite', 'humaneval'])\n", tmp_path)
    assert proc.returncode != 0
    assert "ssr-bench" in proc.stderr and "pip install -e ./benchmarks" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_every_module_says_why_it_exists():
    """Each module of the engine, the adapters and the harness opens with a docstring."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    packages = ("ssr", "benchmarks/ssr_bench", "integrations/langchain/langchain_ssr",
                "integrations/llamaindex/llama_index/llms/ssr")
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    assert len(files) > 40
    missing = [str(p.relative_to(root)) for p in files if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []
