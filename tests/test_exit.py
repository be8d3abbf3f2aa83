"""A program that uses SSR and ends without ``close()`` exits with status 0 (issue 32), on every backend installed.

Before the engine closed itself at exit (``ssr.engine._close_live_engines``), such a program aborted ("terminate
called without an active exception", status 134) whenever the scheduler's daemon thread took the GIL inside torch
while the interpreter finalized: in 7 of 20 runs of a one-``generate`` script on the default model, and in every run
that left a request streaming. Each backend here runs ``RUNS`` programs, each a process of its own that ends as a
script does (tests/exit_check.py): half end right after a ``generate``, half with requests still streaming.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
from exit_check import check, run_programs
from tiny import CHAT_TEMPLATE, TOOL_VOCAB, prompt_ids, tiny_engine, tiny_model, tiny_tokenizer

from ssr import engine as engine_module

RUNS = 20  # per backend, the two kinds of program alternating


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random model saved as a model directory (a reasoning model's template; 512-token window)."""
    out = tmp_path_factory.mktemp("tiny-exit")
    tokenizer = tiny_tokenizer(TOOL_VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model(0, vocab_size=len(TOOL_VOCAB), scale=0.5).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _installed(module: str) -> bool:
    """Whether the real package is there (not a folder of tests named like it: tests/vllm is a namespace package)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


@pytest.mark.parametrize("backend", ["transformers", "llama.cpp", "vllm"])
def test_a_program_exits_cleanly_without_close(backend, request, tmp_path):
    if backend == "vllm":  # the real vLLM; its tests' own venv, model and engine arguments
        pytest.skip("vLLM is not installed here (its own venv: .ci/install_vllm.sh)" if not _installed("vllm") else
                    "vLLM's programs run in tests/vllm/test_vllm_exit.py (the tiny Qwen2 of tests/vllm)")
    if backend == "llama.cpp":
        if not _installed("llama_cpp"):
            pytest.skip("llama-cpp-python is not installed (bash scripts/install_llama_cpp.sh)")
        pytest.importorskip("llama_cpp", reason="llama-cpp-python does not import here")
        # the embedded model (its GGUF as it ships); no thinking recipe, so the prompt is short and prefills at once
        runs = run_programs("llama.cpp", None, "Count from 1 to 300.", RUNS, tmp_path, call={"thinking": False})
    else:  # "abc de": the tiny model writes ~100 tokens for it, so a stream is still running when the program ends
        runs = run_programs("transformers", request.getfixturevalue("tiny_dir"), "abc de", RUNS, tmp_path)
    streaming = check(runs, RUNS)
    assert all(n >= 1 for n in streaming), f"a 'streaming' program ended with no request in flight: {streaming}"


def test_open_engines_are_held_weakly_until_closed():
    """The registry the exit hook closes: every open engine, weakly (one its user dropped is collected, its idle
    scheduler thread left waiting), none once closed; closing twice does nothing."""
    kept, closed, dropped = tiny_engine(0), tiny_engine(1), tiny_engine(2)
    dropped.generate(prompt_ids(), max_tokens=2)  # its scheduler thread is running
    closed.close()
    live = list(engine_module._LIVE.values())
    assert kept in live and dropped in live and closed not in live
    ref = weakref.ref(dropped)
    del dropped, live
    gc.collect()
    assert ref() is None
    kept.close()
    kept.close()
    assert kept.closed and kept not in list(engine_module._LIVE.values())
    assert closed.scheduler._thread is None and kept.backend.live_lanes == 0
