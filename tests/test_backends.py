"""ssr/backends/__init__.py: the choice of backend ("auto", ``$SSR_BACKEND``, an explicit name)."""

from __future__ import annotations


def test_auto_backend_is_llama_cpp_for_the_embedded_model_when_installed(monkeypatch):
    """``"auto"`` picks llama.cpp for an embedded model when llama-cpp-python is importable and no CUDA device is;
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
        assert choose_backend(None, "/some/local/model") == "transformers"  # not an embedded GGUF
        assert choose_backend("vllm", "qwen2.5-coder-0.5b-instruct") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "transformers"  # measured on CPU only
    monkeypatch.setenv("SSR_BACKEND", "llama.cpp")
    assert choose_backend("auto", "qwen2.5-coder-0.5b-instruct") == "llama.cpp"
