"""examples/coding_agent.py runs from a clean checkout: two agent steps on the real default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "coding_agent.py"


def test_coding_agent_reads_then_writes_with_savings(capsys):
    spec = importlib.util.spec_from_file_location("coding_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 1: read_file(" in out  # the loop names the tool; the model writes the arguments
    assert "step 2: " in out
    assert "prompt tokens reused from the previous step's cache: 0 of" not in out.split("step 2: ")[1]
    assert "SSR saved" in out and "outputs are the model's own" in out
