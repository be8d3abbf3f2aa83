"""SSR in a few lines: the same answer as plain decoding, fewer forward passes.

Run: python examples/quickstart.py
"""

from ssr import SSRConfig, SSREngine

engine = SSREngine.from_pretrained()  # the embedded Qwen2.5-Coder-0.5B-Instruct, float32 on CPU
question = "Write a Python function that returns the n-th Fibonacci number."
config = SSRConfig(max_think_tokens=128, draft_start=16)

for event in engine.stream(question, config=config):
    if event.kind == "done":
        result = event.result
    else:
        print(event.text, end="", flush=True)

plain = engine.generate(question, config=config.override(enabled=False))
s = result.stats
print(f"\n\nidentical to plain decoding: {plain.token_ids == result.token_ids}")
print(f"answer tokens: {s['answer_tokens']}, accepted from drafts/proposals: {s['accepted_tokens']}")
print(f"forward passes: {s['forward_passes']} (plain: {plain.stats['forward_passes']})")
print(f"wall time: {s['seconds']['total']:.1f} s (plain: {plain.stats['seconds']['total']:.1f} s)")
