"""Backends behind one protocol (``base.Backend``); chosen by name."""

from __future__ import annotations

from .base import Backend

BACKENDS = ("transformers", "vllm", "vllm-server", "llama.cpp")


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
