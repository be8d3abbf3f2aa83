"""Are a row's logits the same bits whatever else is in the step, at a real model's shapes? The engine's kernel-noise
measurement (``ssr.calibrate.measure_noise``: the largest logit difference between a position computed one token a
step, as plain decoding does, and the same position among 2-16 rows of its lane beside two other lanes) on models
shaped like Qwen2.5-Coder-0.5B and 1.5B (random weights: whether kernels split work by batch shape does not depend
on the weights), bf16 and float32, on the running device. 0.0 means SSR's verify rows are bitwise plain decoding's
there; anything else means greedy SSR agrees with plain except at near-ties within twice that value.

    python3 benchmarks/gpu/kernel_noise.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from calibrate_shapes import SHAPES, shaped_backend

from ssr.calibrate import measure_noise


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "noise": {}}
    for name in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            backend = shaped_backend(name, dtype, device)
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            report["noise"][key] = measure_noise(backend)
            print(key, report["noise"][key], flush=True)
            (out / "kernel_noise.json").write_text(json.dumps(report, indent=1))
            del backend
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
