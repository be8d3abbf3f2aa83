"""A program that uses SSR on the in-process vLLM backend and ends without ``close()`` exits with status 0 (issue 32):
``RUNS`` programs (tests/exit_check.py: forked from a driver that has imported vLLM and SSR, nothing computed, so
no program pays vLLM's import), half ending right after a ``generate``, half with requests still streaming, on the
tiny Qwen2 of this folder."""

from __future__ import annotations

import pytest
from tiny_model import vllm_installed

if not vllm_installed():  # tests/vllm itself would import as a namespace package "vllm": look for the real one
    pytest.skip("vllm is not installed (install it into a separate venv: .ci/install_vllm.sh)", allow_module_level=True)

from conftest import ENGINE_ARGS  # noqa: E402
from exit_check import check, run_programs  # noqa: E402

pytestmark = pytest.mark.vllm

RUNS = 20


def test_a_vllm_program_exits_cleanly_without_close(tiny_model_dir, tmp_path):
    runs = run_programs("vllm", tiny_model_dir, "Count from 1 to 300.", RUNS, tmp_path, kwargs=ENGINE_ARGS,
                        call={"thinking": False}, timeout=600,
                        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    check(runs, RUNS)  # requests in flight at exit are not asserted: the tiny model may end its answers at once
