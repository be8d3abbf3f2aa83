"""Tiny random models built in code, with a tiny vocabulary, for fast exactness tests.

The vocabulary holds single characters plus "</think>", "Wait" and an end token, so a random model closes its
thinking, hits EOS and writes stop strings by chance, and every path of the engine gets exercised in milliseconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ssr.backends.transformers import TransformersBackend
from ssr.chat import ChatFamily
from ssr.costs import CostTable
from ssr.engine import SSREngine

VOCAB = ["<eos>", "</think>", "Wait", "\n", " ", "a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z"]
# enough to spell a required call's forced opening and guided name: <tool_call>\n{"name": "ab", "arguments":
TOOL_VOCAB = VOCAB + ["<tool_call>", "{", "}", '"', ":", ",", "_", "n", "m", "r", "u", "t", "s"]
GUIDED_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
                for name in ("ab", "abc", "h_z")]  # names the guide must keep a random model to
# a reasoning model's chat template in the tiny vocabulary (it names <think>: the engine gives it the reasoning
# family, no system prompt or demonstration): roles and contents, then the generation prompt
CHAT_TEMPLATE = (
    "{#- a reasoning model: it thinks in <think> ... </think> -#}"
    "{%- for m in messages -%}{{ m['role'][0] }}\n{{ m['content'] }}\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}a\n{%- endif -%}"
)
TINY_FAMILY = ChatFamily(name="tiny", close_text="\n</think>\n", continue_text="Wait", think_prefill="")
# where the tiny models run: CPU here; ``SSR_TEST_DEVICE=cuda`` runs the exactness matrix on a GPU
# (benchmarks/gpu/check.sh), float32 with TF32 off
DEVICE = os.environ.get("SSR_TEST_DEVICE", "cpu")


def tiny_tokenizer(vocab: list[str] = VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="x"))
    words = "|".join(t for t in vocab if len(t) > 1)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|\\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="x")


def tiny_model(seed: int, vocab_size: int = len(VOCAB), attention: float = 1.0, scale: float = 0.3,
               layers: int = 2) -> Qwen2ForCausalLM:
    """A random Qwen2 (head_dim 32). ``attention=0`` zeroes attention outputs: the model becomes a bigram model,
    so a draft continues exactly like the verifier would (full acceptance); ``scale`` sharpens the logits."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=scale, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
                         bos_token_id=0)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention)
    return model.to(DEVICE)


def tiny_engine(seed: int = 0, attention: float = 1.0, scale: float = 0.3, vocab: list[str] = VOCAB,
                dtype: torch.dtype = torch.float32, **config) -> SSREngine:
    from ssr import SSRConfig

    tokenizer = tiny_tokenizer(vocab)
    model = tiny_model(seed, vocab_size=len(vocab), attention=attention, scale=scale).to(dtype)
    backend = TransformersBackend(model, "tiny", {0}, 0)
    backend.tokenizer = tokenizer
    # a flat cost table: every proposal and draft pays, so the exactness matrix exercises every speculation path
    return SSREngine(backend, tokenizer, config=SSRConfig(**config), family=TINY_FAMILY, model_name=f"tiny-{seed}",
                     costs=CostTable.flat())


def bigram_engine(next_of: dict[str, str], **config) -> SSREngine:
    """A model built by hand whose greedy next token is ``next_of[token]`` (a cycle through "</think>", say): its
    attention and MLP are zeroed, embeddings are one-hot, and the output head maps each token to its successor."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(0, attention=0.0)
    ids = {t: i for i, t in enumerate(VOCAB)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(len(VOCAB), model.config.hidden_size))
        head = torch.zeros_like(model.lm_head.weight)
        for token, successor in next_of.items():
            head[ids[successor], ids[token]] = 1.0
        model.lm_head.weight.copy_(head)
    backend = TransformersBackend(model, "bigram", {0}, 0)
    backend.tokenizer = tokenizer
    from ssr import SSRConfig

    return SSREngine(backend, tokenizer, config=SSRConfig(**config), family=TINY_FAMILY, model_name="bigram",
                     costs=CostTable.flat())


def prompt_ids(text: str = "abc\nde") -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False)


def tiny_chat_engine(seed: int = 0, **config) -> SSREngine:
    """A tiny engine that takes chat messages (``CHAT_TEMPLATE``, the tool-call vocabulary), for the adapters."""
    from ssr import SSRConfig

    tokenizer = tiny_tokenizer(TOOL_VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    backend = TransformersBackend(tiny_model(seed, vocab_size=len(TOOL_VOCAB), scale=0.5), "tiny", {0}, 0)
    backend.tokenizer = tokenizer
    return SSREngine(backend, tokenizer, config=SSRConfig(**config), model_name=f"tiny-{seed}",
                     costs=CostTable.flat())


# -- reasoning-model families (tests/test_families.py): chat templates written for the tests in each format ---------

# the tool vocabulary plus what the families' templates and a scripted tool call spell
FAMILY_VOCAB = TOOL_VOCAB + ["<think>", "</tool_call>", "<tool_response>", "</tool_response>",
                             "i", "j", "k", "l", "o", "p", "q", "v", "w", "."]
_TURNS = (  # roles by first letter; an assistant turn's tool calls as Hermes tags, a tool result in tags
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}a\n{{ CONTENT }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}u\n<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% else %}{{ m['role'][0] }}\n{{ m['content'] }}\n{% endif %}{% endfor %}"
)
# DeepSeek-R1 distills: earlier reasoning is dropped from the history; the generation prompt opens the think block
R1_TEMPLATE = (_TURNS.replace("{{ CONTENT }}", "{{ m['content'].split('</think>')[-1] }}")
               + "{% if add_generation_prompt %}a\n<think>\n{% endif %}")
# Qwen3: reasoning kept as a think block; enable_thinking=False writes an empty one and the model answers
QWEN3_TEMPLATE = (_TURNS.replace("{{ CONTENT }}", "{% if m['reasoning_content'] %}<think>\n{{ m['reasoning_content'] }}"
                                                  "\n</think>\n\n{% endif %}{{ m['content'] }}")
                  + "{% if add_generation_prompt %}a\n{% if enable_thinking is defined and enable_thinking is false %}"
                    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
# gpt-oss names its channels in its template; SSR renders harmony with openai-harmony, never with this
HARMONY_TEMPLATE = ("{# harmony: <|start|>role<|channel|>analysis|commentary|final<|message|>...<|end|> #}"
                    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_SPECIALS = ["<|return|>", "<|call|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|endoftext|>"]
HARMONY_VOCAB = HARMONY_SPECIALS + [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def offline_harmony_vocab() -> None:
    """openai-harmony downloads the o200k_base vocabulary; there is no network here, so point it at the copy that
    litellm (a test dependency) ships, under the same cache name, unless a location is set already."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE") or os.environ.get("TIKTOKEN_RS_CACHE_DIR"):
        return
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.origin:
        os.environ["TIKTOKEN_RS_CACHE_DIR"] = os.path.join(os.path.dirname(spec.origin), "litellm_core_utils",
                                                           "tokenizers")


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """Harmony's markers as special tokens (as in gpt-oss's tokenizer), then printable characters one a token."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(HARMONY_VOCAB)}, unk_token="?"))
    markers = "|".join(re.escape(t) for t in HARMONY_SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{markers}|\\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                        unk_token="?")
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS[1:]})
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def family_engine(template: str | None, seed: int = 0, attention: float = 0.4, scale: float = 0.5,
                  **config) -> SSREngine:
    """A tiny engine whose family comes from its chat template (``detect_family``), as a real model's would;
    ``template=None``: harmony, with gpt-oss's end tokens (<|return|>, <|call|>)."""
    from ssr import SSRConfig

    if template is None:
        offline_harmony_vocab()
        tokenizer = harmony_tokenizer()
        eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}
    else:
        tokenizer = tiny_tokenizer(FAMILY_VOCAB)
        tokenizer.chat_template = template
        eos = {0}
    model = tiny_model(seed, vocab_size=len(tokenizer), attention=attention, scale=scale)
    backend = TransformersBackend(model, "tiny", eos, min(eos))
    backend.tokenizer = tokenizer
    return SSREngine(backend, tokenizer, config=SSRConfig(**config), model_name=f"tiny-family-{seed}",
                     costs=CostTable.flat())
