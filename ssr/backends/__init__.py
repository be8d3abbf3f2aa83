"""Backends behind one protocol (``base.Backend``); chosen by name."""

from __future__ import annotations

import importlib.util
import os

from .base import Backend

BACKENDS = ("transformers", "vllm", "vllm-server", "llama.cpp")
AUTO = "auto"  # the default: ``choose_backend`` picks


def choose_backend(name: str | None, model_name: str | None) -> str:
    """The backend ``"auto"`` (or None) stands for: ``$SSR_BACKEND`` when set, else llama.cpp for an embedded model
    or a ``.gguf`` file when llama-cpp-python is installed and no CUDA device is (the GGUF runs as it ships, and a
    llama.cpp step costs about a quarter of a float32 transformers step on the CPUs measured:
    docs/backends/llama-cpp.md), else transformers."""
    if name not in (None, AUTO):
        return name
    chosen = os.environ.get("SSR_BACKEND", AUTO)
    if chosen != AUTO:
        return chosen
    from ..models import EMBEDDED_MODELS

    runs_as_gguf = model_name in EMBEDDED_MODELS or str(model_name or "").endswith(".gguf")
    if runs_as_gguf and importlib.util.find_spec("llama_cpp") is not None:
        import torch

        if not torch.cuda.is_available():
            return "llama.cpp"
    return "transformers"


def load_backend(name: str, model_path: str, model_name: str, **kwargs) -> Backend:
    """Instantiate backend ``name`` for the model at ``model_path``; the result carries ``.tokenizer``."""
    if name == "transformers":
        from .transformers import TransformersBackend

        return TransformersBackend.load(model_path, model_name, **kwargs)
    if name == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(model_path, model_name=model_name, **kwargs)
    if name == "vllm-server":
        from .vllm_server import VLLMServerBackend

        return VLLMServerBackend(model_path, model_name=model_name, **kwargs)
    if name == "llama.cpp":  # llama-cpp-python on a GGUF file (the embedded model's, as it ships)
        from .llama_cpp import LlamaCppBackend

        return LlamaCppBackend.load(model_path, model_name, **kwargs)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
