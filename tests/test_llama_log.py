"""llama.cpp's own log lines (ssr.backends.llama_log): silent in normal use, every line with SSR_VERBOSE=1 or
``ssr --verbose``, errors always. The levels are ggml.h's (DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5), which
llama-cpp-python's own callback misreads: it printed each load's warnings and hid errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from ssr.backends import llama_log

LOAD = """
import sys
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.models import DEFAULT_MODEL, embedded_files, gguf_file
path = sys.argv[1] if len(sys.argv) > 1 else str(gguf_file(DEFAULT_MODEL))
try:
    LlamaCppBackend(path, DEFAULT_MODEL, n_seq_max=2, n_ctx=256, q5_0_as_q8_0=False,
                    tokenizer=str(embedded_files(DEFAULT_MODEL))).close()
    print("loaded")
except Exception as exc:
    print("failed:", type(exc).__name__)
"""


def test_levels_follow_ggml_and_only_errors_show_unless_verbose(monkeypatch):
    assert [llama_log.level_of(n) for n in (1, 2, 3, 4)] == [logging.DEBUG, logging.INFO, logging.WARNING,
                                                             logging.ERROR]
    llama_log._write(4, b"", None)
    assert llama_log.level_of(5) == logging.ERROR  # a continuation keeps its message's level
    monkeypatch.setitem(llama_log._state, "verbose", False)
    assert [llama_log.shown(level) for level in (logging.DEBUG, logging.WARNING, logging.ERROR)] == [False, False,
                                                                                                     True]
    monkeypatch.setitem(llama_log._state, "verbose", True)
    assert all(llama_log.shown(level) for level in (logging.DEBUG, logging.WARNING, logging.ERROR))
    for value, verbose in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("SSR_VERBOSE", value)
        assert llama_log.verbose_from_environment() is verbose


def _load(*args: str, verbose: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SSR_VERBOSE"} | ({"SSR_VERBOSE": "1"} if verbose else {})
    return subprocess.run([sys.executable, "-c", LOAD, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.real_model
def test_a_load_is_silent_and_verbose_shows_llama_cpps_lines():
    """The embedded model's load: no llama.cpp line on stderr by default (it printed "control-looking token ...
    this is probably a bug in the model" three times); SSR_VERBOSE=1 shows that warning and the loader's lines."""
    pytest.importorskip("llama_cpp")
    quiet, loud = _load(), _load(verbose=True)
    assert quiet.stdout.strip() == loud.stdout.strip() == "loaded", (quiet.stderr, loud.stderr)
    assert "control-looking token" not in quiet.stderr and "llama_model_loader" not in quiet.stderr
    assert "control-looking token" in loud.stderr and "llama_model_loader" in loud.stderr


@pytest.mark.real_model
def test_a_load_error_reaches_the_user_without_verbose(tmp_path):
    """A file llama.cpp cannot read: SSR raises, and llama.cpp's own error line is on stderr."""
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    out = _load(str(bad))
    assert out.stdout.strip() == "failed: LlamaCppError", out.stderr
    assert "gguf" in out.stderr.lower() and "control-looking" not in out.stderr, out.stderr
