"""vLLM backend tests: one in-process vLLM engine per test session, on a tiny model built in code.

Every module here starts with ``pytest.importorskip("vllm")``, so without vLLM (the default test environment) they
are skipped with that reason; install it into a separate venv with ``.ci/install_vllm.sh`` and run
``<venv>/bin/python -m pytest tests/vllm``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: keep the KV cache small on shared machines

# the same settings for the in-process engine and the `vllm serve` process
ENGINE_ARGS = dict(max_model_len=2048, enforce_eager=True, seed=0, dtype="float32", block_size=32, max_num_seqs=64)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tiny_model import build_tiny_qwen2, tokenizer_source

    if tokenizer_source() is None:
        pytest.skip("the Qwen2.5 tokenizer (~/.cache/ssr/qwen2.5-coder-0.5b-instruct) is not there")
    # attention 0: a bigram model, so drafts are accepted (multi-row verification runs); see tiny_model.py
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2") / "model", attention=0.0)


@pytest.fixture(scope="session")
def vllm_backend(tiny_model_dir):
    from ssr.backends.vllm import VLLMBackend

    backend = VLLMBackend(tiny_model_dir, model_name="tiny-qwen2", **ENGINE_ARGS)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def vllm_engine(vllm_backend):
    from ssr import SSREngine
    from ssr.costs import CostTable

    return SSREngine(vllm_backend, vllm_backend.tokenizer, model_name="tiny-qwen2", costs=CostTable.flat())


def vllm_greedy(llm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """vLLM's own plain greedy decoding; it stops where the engine does: at EOS and the tokenizer's end-of-text
    tokens (``end_of_text_ids``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ssr.backends.base import end_of_text_ids

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                            stop_token_ids=sorted(end_of_text_ids(llm.get_tokenizer())))
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
