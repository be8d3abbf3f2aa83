"""The suite's parallel-run hooks (shared_fixtures.py) on a small suite of their own, run as the README's test command
runs the real one: pytest without ``-n`` on two workers. A module fixture that every test of its module shares must be
set up once, on one worker, as in one process; it was set up on every worker while the grouping silently did nothing
(workers never heard of ``--dist loadgroup``; pytest 9.2's node ids, pytest-xdist issue 1386)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from shared_fixtures import pytest_cmdline_main, pytest_collection_modifyitems, pytest_configure_node  # noqa: F401
"""

MODULE = """
import os
import pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(8))
def test_shares_the_module_fixture(shared, i):
    pass

@pytest.mark.parametrize("i", range(8))
def test_needs_no_fixture(i):
    pass
"""


def test_a_module_fixture_is_set_up_once_on_two_workers(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(MODULE)
    setups = tmp_path / "setups.txt"
    env = {**os.environ, "SETUPS": str(setups), "PYTEST_XDIST_AUTO_NUM_WORKERS": "2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_grouped.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 workers" in run.stdout, run.stdout
    passed = [line for line in run.stdout.splitlines() if " PASSED " in line]
    assert len(passed) == 16, run.stdout
    assert setups.read_text().splitlines() in (["gw0"], ["gw1"]), run.stdout  # once, on one worker
    # the grouped tests carry their group; the others (a plugin's module fixture is everywhere, not the suite's) not
    assert sum("test_shares_the_module_fixture" in line and "@test_grouped.py" in line for line in passed) == 8
    assert not any("test_needs_no_fixture" in line and "@" in line for line in passed), run.stdout
