"""Build a tiny random Qwen2 model (head_dim 32, vLLM's CPU attention needs >= 32) with the real Qwen2.5 tokenizer.

No model hub is reachable here, so tests make their model in code. The weights are random but drawn with a wide
initializer so the greedy top-2 logit margins are far above float32 batch-shape noise.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_DIR = Path(os.environ.get("SSR_CACHE", Path.home() / ".cache" / "ssr")) / "qwen2.5-coder-0.5b-instruct"


def vllm_installed() -> bool:
    """True where the real vLLM is importable (not this test folder, which sits on sys.path as "vllm")."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    # a namespace package (this folder, as "vllm") has no origin
    return spec is not None and spec.origin is not None and not spec.origin.startswith(str(Path(__file__).parent))


def tokenizer_source() -> Path | None:
    return TOKENIZER_DIR if (TOKENIZER_DIR / "tokenizer.json").exists() else None


def build_tiny_qwen2(out_dir: str | os.PathLike, seed: int = 0, hidden: int = 128, layers: int = 2,
                     init_std: float = 0.2, attention: float = 0.25) -> str:
    """Save a tiny random Qwen2ForCausalLM (float32) and the Qwen2.5 tokenizer into ``out_dir``; return the path.

    ``attention`` scales the attention output projections: at 0 the model is a bigram model (a draft continues
    exactly as the verifier would, so drafts are accepted whole); small values keep it mostly bigram-like, so drafts
    are accepted in part and suffix proposals are sometimes rejected: every path of the engine runs.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return str(out)
    src = tokenizer_source()
    if src is None:
        raise FileNotFoundError(f"no tokenizer at {TOKENIZER_DIR} (the converted default model); run `ssr` once to build it")
    tok = AutoTokenizer.from_pretrained(src)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=init_std,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


if __name__ == "__main__":
    import sys

    print(build_tiny_qwen2(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ssr-tiny-qwen2"))
