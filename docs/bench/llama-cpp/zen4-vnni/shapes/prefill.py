"""Prefill of n tokens (one lane, one logit row) on the default model: median ms of 5 after 1 warm-up, each n in
turn round after round. argv[1]: a label; the backend's mode comes from the environment and --exact."""
import json, statistics, sys, time
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.calibrate import dummy_ids
from ssr.models import DEFAULT_MODEL, gguf_file
exact = None if sys.argv[2] == "default" else sys.argv[2] == "true"
b = LlamaCppBackend(str(gguf_file(DEFAULT_MODEL)), DEFAULT_MODEL, n_threads=2, n_seq_max=2, n_ctx=2048, exact=exact)
sizes = (32, 128, 300, 600)
t = {n: [] for n in sizes}
for r in range(6):
    for n in sizes:
        lane = b.new_lane()
        t0 = time.perf_counter(); b.step({lane: dummy_ids(n, b.vocab_size, r)}, {lane: 1}); dt = time.perf_counter() - t0
        b.release_all()
        if r:
            t[n].append(dt * 1e3)
print(json.dumps({"label": sys.argv[1], "exact": b.exact, "weights": b.dtype,
                  "prefill_ms": {n: round(statistics.median(v), 1) for n, v in t.items()}}))
b.close()
