"""Benchmark harness: suites (HumanEval, ClassEval, LongProc, BFCL), methods (plain, suffix decoding, SSR variants,
transformers' prompt lookup), an interleaved resumable runner, scoring in sandboxed subprocesses, a Markdown report
with plots, and the engine microbenchmarks. Entry point: ``ssr bench`` (or ``python -m ssr_bench``)."""
