"""Greedy agreement of SSR with plain decoding in bfloat16 on the running device: the exactness matrix's cases and
tiny random models (tests/test_exactness_greedy.py), each model cast to bf16. In bf16 a row's logits may depend on
the other rows of its step (GPU kernels pick tiles by shape), so SSR promises no token identity there; this counts
how often it holds: outputs identical to plain's, and the share of plain's tokens before the first difference.

    SSR_TEST_DEVICE=cuda python3 benchmarks/gpu/bf16_agreement.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]

import torch  # noqa: E402
from test_exactness_greedy import CASES, MODELS, PROMPTS, _prompt, run_pair  # noqa: E402
from tiny import DEVICE, tiny_engine  # noqa: E402

from ssr.agreement import compare  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    engines = {m: tiny_engine(m[0], attention=m[1], scale=0.5, dtype=torch.bfloat16) for m in MODELS}
    identical = total = agreeing = plain_tokens = 0
    per_case = {}
    for name, overrides in CASES:
        same = 0
        for i, engine in enumerate(engines.values()):
            plain, ssr = run_pair(engine, overrides, _prompt(PROMPTS[i % len(PROMPTS)]))
            agreement = compare(list(plain.token_ids), {}, list(ssr.token_ids))
            same += agreement.identical
            agreeing += len(plain.token_ids) if agreement.identical else agreement.diverged_at
            plain_tokens += len(plain.token_ids)
        per_case[name] = f"{same}/{len(engines)}"
        identical += same
        total += len(engines)
    report = {"device": DEVICE, "dtype": "bfloat16", "identical": f"{identical}/{total}",
              "tokens_before_first_difference": round(agreeing / max(plain_tokens, 1), 4), "per_case": per_case}
    print(json.dumps(report, indent=1))
    (out / "bf16_agreement.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
