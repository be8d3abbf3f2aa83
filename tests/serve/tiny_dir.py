"""A tiny random model saved as a model directory, so that a server process can load it with ``--model <dir>``.

The character-level vocabulary of ``tests/tiny.py`` (with the tool-call characters), a chat template that marks the
model as a reasoning model (the template names ``<think>``, so the engine gives it the reasoning family: no system
prompt or demonstration is added, and prompts stay short), and a 1024-token context window, so that an over-long
prompt is easy to write.
"""

from __future__ import annotations

from pathlib import Path

from tiny import CHAT_TEMPLATE, TOOL_VOCAB, tiny_model, tiny_tokenizer

CONTEXT = 1024


def save_tiny_model(out: str | Path, seed: int = 0, scale: float = 0.5) -> str:
    """Save the tiny model (float32, random weights of ``seed``) and its tokenizer into ``out``; return the path."""
    out = Path(out)
    if (out / "config.json").exists():
        return str(out)
    tokenizer = tiny_tokenizer(TOOL_VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_model(seed, vocab_size=len(TOOL_VOCAB), scale=scale)
    model.config.max_position_embeddings = CONTEXT
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
