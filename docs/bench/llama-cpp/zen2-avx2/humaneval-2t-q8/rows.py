"""Both files, alternating, 3 rounds: ms of one lane fed w tokens (all rows wanted), 256 cached, 2 threads."""
import time, statistics
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.calibrate import dummy_ids
from ssr.models import gguf_file, DEFAULT_MODEL
g=str(gguf_file(DEFAULT_MODEL))
bs={f: LlamaCppBackend(g, DEFAULT_MODEL, n_threads=2, n_seq_max=4, n_ctx=2048, q5_0_as_q8_0=f) for f in (False, True)}
W=(1,2,3,4,8,16)
t={(f,w):[] for f in bs for w in W}
for r in range(4):
    for f,b in (bs.items() if r%2==0 else list(bs.items())[::-1]):
        base=b.new_lane(); b.step({base: dummy_ids(256,b.vocab_size)},{base:1})
        for w in W:
            for k in range(3):
                lane=b.fork(base); b.step({lane:[5]})
                t0=time.perf_counter(); b.step({lane: dummy_ids(w,b.vocab_size,k)},{lane:w}); dt=time.perf_counter()-t0
                if r>0: t[f,w].append(dt)
                b.release(lane)
        b.release_all()
for w in W:
    a=statistics.median(t[False,w])*1e3; c=statistics.median(t[True,w])*1e3
    print(f"w={w:2d} as-is {a:6.1f} ms  q8 {c:6.1f} ms  ratio {c/a:.3f}")
