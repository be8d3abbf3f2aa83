"""The long-chain benchmark runs end to end at small lengths (the real numbers come from ``python -m
ssr_bench.long_chain``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssr_bench.long_chain import per_token_engine_time, to_markdown


@pytest.mark.skipif(not (Path.home() / ".cache/ssr/qwen2.5-coder-0.5b-instruct/tokenizer.json").exists(),
                    reason="the default model's tokenizer is not cached")
def test_long_chain_small():
    results = per_token_engine_time(lengths=(24, 64), window=8)
    assert set(results) == {"plain", "ssr"}
    for r in results.values():
        assert r["think_tokens"] >= 64  # EOS is masked and min_think_tokens holds the chain open to the budget
        for row in r["lengths"].values():
            assert row["per_token_ms"] > 0 and 0 <= row["backend_ms"] <= row["per_token_ms"]
        assert "function calls" in r["profile"]
    assert "| plain | 64 |" in to_markdown(results)
