"""Step costs of models shaped like Qwen2.5-Coder-0.5B and 1.5B on the running accelerator (random weights built
from their configs: a step's cost does not depend on the weights, and the real weights are too large to travel to a
lent GPU), bf16 and float32, through the engine's own calibration (``ssr.calibrate.measure_costs``).

    python3 benchmarks/gpu/calibrate_shapes.py OUT_DIR
    python3 benchmarks/gpu/calibrate_shapes.py OUT_DIR --projection

``--projection``: the tables ``ssr bench --costs`` prices recorded runs with (``ssr_bench.projection``), bf16 (a
GPU's default dtype), at a context of 1024 and widths up to 1024, so a prompt's prefill is a measured point, not an
extrapolation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ssr.backends.transformers import TransformersBackend
from ssr.calibrate import markdown, measure_costs

SHAPES = {  # Qwen2.5-Coder-{0.5B,1.5B}-Instruct's config.json, the fields a step's cost depends on
    "qwen2.5-coder-0.5b-shape": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                     num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b-shape": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}
ROWS, WIDTHS = (1, 2, 3, 4, 8, 16), (1, 2, 4, 8, 16, 32, 64)
PROJECTION_WIDTHS = WIDTHS + (128, 256, 512, 1024)


def shaped_backend(name: str, dtype: torch.dtype, device: str) -> TransformersBackend:
    """A backend on a random-weight model of ``SHAPES[name]`` (seed 0), in ``dtype`` on ``device``."""
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, **SHAPES[name])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()
    return TransformersBackend(model, name, {151645}, 151643)


def main(out: Path, dtypes=(torch.bfloat16, torch.float32), widths=WIDTHS, context: int = 256,
         file_name: str = "gpu_costs") -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "tables": {}}
    lines = [f"# Step costs on {report['device']} (torch {torch.__version__}), random weights, context {context}", ""]
    for name in SHAPES:
        for dtype in dtypes:
            backend = shaped_backend(name, dtype, device)
            t0 = time.perf_counter()
            table = measure_costs(backend, rows=ROWS, widths=widths, context=context, reps=5, progress=False)
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            report["tables"][key] = {"base_ms": table.base_seconds * 1000, "rows": list(table.rows),
                                     "widths": list(table.widths), "cost": table.cost,
                                     "context": context, "seconds": time.perf_counter() - t0}
            lines += [f"## {key}: one step {table.base_seconds * 1000:.2f} ms", "", markdown(table), ""]
            print(lines[-4], flush=True)
            (out / f"{file_name}.json").write_text(json.dumps(report, indent=1))  # after each table: a later one
            (out / f"{file_name}.md").write_text("\n".join(lines))  # that runs out of time loses only itself
            del backend
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="gpu-out")
    parser.add_argument("--projection", action="store_true", help="bf16, context 1024, widths up to 1024")
    args = parser.parse_args()
    if args.projection:
        main(Path(args.out), dtypes=(torch.bfloat16,), widths=PROJECTION_WIDTHS, context=1024,
             file_name="gpu_costs_projection")
    else:
        main(Path(args.out))
