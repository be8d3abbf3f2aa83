"""LlamaIndex integration of SSR (self-speculative decoding for reasoning models)."""

from llama_index.llms.ssr.base import SSR

__all__ = ["SSR"]
