"""Exact mode (AMX build), both files, alternating, 4 rounds (first dropped): ms of one lane fed w tokens (all rows
wanted) over 256 cached, and a 300-token prefill; then the bits: the rewrite's exact-mode rows vs one-row rows."""
import sys, time, statistics, torch
from ssr.backends.llama_cpp import LlamaCppBackend
from ssr.calibrate import dummy_ids
from ssr.models import gguf_file, DEFAULT_MODEL
exact = sys.argv[1] == "exact" if len(sys.argv) > 1 else True
g = str(gguf_file(DEFAULT_MODEL))
bs = {f: LlamaCppBackend(g, DEFAULT_MODEL, n_threads=2, n_seq_max=4, n_ctx=2048, exact=exact, q5_0_as_q8_0=f)
      for f in (False, True)}
for f, b in bs.items():
    print(f, b.weights_path, b.dtype, b.device, b.exact, b.batch_invariant, b.amx)
W = (1, 2, 3, 4, 8, 16)
t = {(f, w): [] for f in bs for w in list(W) + ["pp300"]}
for r in range(4):
    for f, b in (bs.items() if r % 2 == 0 else list(bs.items())[::-1]):
        base = b.new_lane()
        t0 = time.perf_counter(); b.step({base: dummy_ids(300, b.vocab_size, r)}, {base: 1}); dt = time.perf_counter() - t0
        if r > 0: t[f, "pp300"].append(dt)
        for w in W:
            for k in range(3):
                lane = b.fork(base); b.step({lane: [5]})
                t0 = time.perf_counter(); b.step({lane: dummy_ids(w, b.vocab_size, k)}, {lane: w}); dt = time.perf_counter() - t0
                if r > 0: t[f, w].append(dt)
                b.release(lane)
        b.release_all()
for w in list(W) + ["pp300"]:
    a = statistics.median(t[False, w]) * 1e3; c = statistics.median(t[True, w]) * 1e3
    print(f"w={w!s:>5} as-is {a:7.1f} ms  q8 {c:7.1f} ms  ratio {c/a:.3f}")
# bits, each file: 24 greedy one-row steps vs one 24-row verification and beside two other lanes
tok = bs[True].tokenizer
prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a Python function is_even(n)."}],
                                            add_generation_prompt=True, tokenize=False), add_special_tokens=False)
for f, b in bs.items():
    b.release_all()
    lane = b.new_lane(); logits = b.step({lane: prompt}, {lane: 1})[lane]
    ref, rows = [], []
    for _ in range(24):
        rows.append(logits[-1]); ref.append(int(logits[-1].argmax())); logits = b.step({lane: [ref[-1]]})[lane]
    b.release_all()
    lane = b.new_lane(); b.step({lane: prompt}, {lane: 1}); b.truncate(lane, len(prompt) - 1)
    ver = b.step({lane: prompt[-1:] + ref[:-1]}, {lane: 24})[lane]
    b.truncate(lane, len(prompt) - 1)
    side = [b.fork(lane), b.fork(lane)]
    got = []
    for x in prompt[-1:] + ref[:7]:
        out = b.step({lane: [x], side[0]: [x, 7], side[1]: [9, 8, 7]}, {side[0]: 2, side[1]: 3}); got.append(out[lane][-1])
    d1 = float((ver - torch.stack(rows)).abs().max()); d2 = float((torch.stack(got) - torch.stack(rows[:8])).abs().max())
    print(f"rewrite={f}: verify rows max diff {d1}, beside-lanes max diff {d2}, bitwise {torch.equal(ver, torch.stack(rows)) and d2 == 0}")
    print("  tokens", tok.decode(ref))
    b.release_all()
