"""How should an instruct model think when tools are bound with tool_choice="auto"? Runs BFCL items (``per_cat``
per category of the bfcl-auto suite) under several prompt recipes, greedy, with SSR (token-identical to plain
decoding), and writes one JSON line per (item, recipe).

    python docs/bench/auto-tools/recipes.py bare,R2,R4,R5 3 docs/bench/auto-tools/recipes.jsonl

bare: the model's own template, no thinking. R0: the coding demonstration (the recipe without tools). R1: the
thinking instruction, no demonstration. R2: a demonstration with a call and a direct answer (tools unlike the
bound ones). R3: R2 plus an instruction to call only fitting tools. R4: that instruction, no demonstration.
R5: the bare template with a think prefill.
"""
import dataclasses, json, sys, time
from ssr.engine import SSREngine
from ssr.chat import QWEN2_INSTRUCT, THINK_INSTRUCTION
from ssr_bench.suites import load_bfcl
from ssr_bench.scoring import score_bfcl
from ssr_bench.runner import base_config

variants = sys.argv[1].split(",")
per_cat = int(sys.argv[2])
out = open(sys.argv[3], "a")
eng = SSREngine.from_pretrained()
items = load_bfcl(tool_choice="auto")
seen = {}
chosen = []
for it in items:
    if seen.get(it["category"], 0) < per_cat:
        seen[it["category"]] = seen.get(it["category"], 0) + 1
        chosen.append(it)
AUTO_DEMO = (
    {"role": "user", "content": "What is 20 euros in US dollars? (Tools in this example: convert(amount: number, to: string).)"},
    {"role": "assistant", "content": "<think>\nThe user wants 20 euros in US dollars. The convert tool does exactly this, so I call it with amount 20 and to \"USD\".\n</think>\n\n<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"amount\": 20, \"to\": \"USD\"}}\n</tool_call>"},
    {"role": "user", "content": "Who wrote the novel Dracula? (Tools in this example: convert(amount: number, to: string).)"},
    {"role": "assistant", "content": "<think>\nThe user asks who wrote Dracula. The convert tool changes currencies, which does not help here, so I answer directly.\n</think>\n\nBram Stoker wrote Dracula (1897)."},
)
AUTO_SYS = THINK_INSTRUCTION + (" When one of the tools fits the request, call it after </think>; when none fits, "
                                "answer directly without calling a tool.")
fams = {
    "R0": QWEN2_INSTRUCT,
    "R1": dataclasses.replace(QWEN2_INSTRUCT, demonstration=()),
    "R2": dataclasses.replace(QWEN2_INSTRUCT, demonstration=AUTO_DEMO),
    "R3": dataclasses.replace(QWEN2_INSTRUCT, demonstration=AUTO_DEMO, system_prompt=AUTO_SYS),
    "R4": dataclasses.replace(QWEN2_INSTRUCT, demonstration=(), system_prompt=AUTO_SYS),
    "R5": dataclasses.replace(QWEN2_INSTRUCT, demonstration=(), system_prompt=None),
}
from ssr_bench.methods import method_config
cfg = method_config("ssr", base_config("bfcl"))
for it in chosen:
    for v in variants:
        eng.family = fams.get(v, QWEN2_INSTRUCT)
        t0 = time.time()
        r = eng.generate(it["messages"], tools=it["tools"], tool_choice="auto", config=(base_config("bfcl").override(enabled=False) if v == "bare" else cfg), thinking=(v != "bare"))
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in r.tool_calls]
        sc = score_bfcl(it, calls)
        rec = {"item": it["id"], "cat": it["category"], "variant": v, "score": sc["score"], "err": sc.get("error"),
               "ncalls": len(calls), "invalid": len(r.invalid_tool_calls or []), "answer": r.answer[:300],
               "reasoning": (r.reasoning or "")[:200], "s": round(time.time() - t0, 1)}
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n"); out.flush()
