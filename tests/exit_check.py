"""Programs that use an engine and end without ``close()``, each in a process of its own, for the exit tests
(tests/test_exit.py; tests/vllm/test_vllm_exit.py): issue 32, a program that uses SSR exits cleanly.

Two kinds of program, alternating: "finished" runs one ``generate`` and ends (the scheduler's thread may still be
leaving its last pass as the interpreter finalizes: the abort issue 32 measured); "streaming" also leaves a request
streaming in a daemon thread and another one half-read in the main thread, so the scheduler is mid-pass at exit.

Each program is a process that ends as a script does: it falls off the end and the interpreter finalizes (atexit
hooks, then daemon threads, then the modules). The processes are forked from one driver that has imported torch,
transformers, SSR and the backend (only imported: nothing computed, so no thread pool exists yet), which saves the
seconds of imports per run (vLLM's alone: 8-11 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MODES = ("finished", "streaming")

PROGRAM = r'''
import json, sys, threading
from ssr import SSREngine
from ssr.costs import CostTable
from ssr.errors import Cancelled

backend, model, mode, prompt = sys.argv[1], sys.argv[2] or None, sys.argv[3], sys.argv[4]
kwargs, call = json.loads(sys.argv[5]), json.loads(sys.argv[6])  # the backend's options, the requests' arguments
engine = SSREngine.from_pretrained(model, backend=backend, costs=CostTable.flat(), **kwargs)
print("generated", len(engine.generate(prompt, max_tokens=8, **call).token_ids), flush=True)
if mode == "streaming":
    def read():
        try:
            for _ in engine.stream(prompt, max_tokens=1000, **call):
                pass
        except Cancelled:  # what a request still running at exit ends with
            pass
    threading.Thread(target=read, daemon=True).start()
    stream = engine.stream(prompt, max_tokens=1000, **call)
    next(stream)  # one event of it, then the program ends with the request running
    load = engine.load_stats()
    print("in flight", load["running"] + load["queued"], flush=True)
# the end of the program: no engine.close()
'''

# forks ``runs`` programs, ``parallel`` at a time; prints one JSON line per program (its number, mode, exit code)
DRIVER = r'''
import json, os, signal, sys, time
backend, model, prompt, kwargs, call, runs, parallel, out, timeout = sys.argv[1:10]
import ssr, ssr.engine, ssr.backends
{imports}
program, modes = {program!r}, {modes!r}
child, running, started = None, {{}}, 0
while child is None and (started < int(runs) or running):
    if started < int(runs) and len(running) < int(parallel):
        i, mode = started, modes[started % 2]
        started += 1
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, name in ((1, "out"), (2, "err")):
                os.dup2(os.open(os.path.join(out, f"{{i}}.{{name}}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["<program>", backend, model, mode, prompt, kwargs, call]
            child = i
        else:
            running[pid] = (i, mode, time.monotonic())
        continue
    for pid, (i, mode, start) in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0 and time.monotonic() - start < float(timeout):
            continue
        if done == 0:  # hung: a failure of its own
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status) if done else "timeout"
        print(json.dumps({{"i": i, "mode": mode, "exit": code}}), flush=True)
        del running[pid]
    time.sleep(0.02)
if child is not None:  # the program, then the end of this script: the interpreter finalizes as a script's does
    exec(compile(program, "<program>", "exec"), {{"__name__": "__main__"}})
'''

# what the driver imports before it forks (the seconds of imports every program would otherwise pay)
_TRANSFORMERS = "import torch, transformers; from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer"
BACKEND_IMPORTS = {"transformers": f"{_TRANSFORMERS}, Qwen2ForCausalLM; import ssr.backends.transformers",
                   "llama.cpp": f"{_TRANSFORMERS}; import llama_cpp, ssr.backends.llama_cpp",
                   "vllm": f"{_TRANSFORMERS}; import vllm, ssr.backends.vllm"}  # vllm's import: 8-11 s a program


@dataclass
class Run:
    mode: str
    returncode: int | str  # the exit status (negative: the signal), or "timeout"
    stdout: str
    stderr: str

    @property
    def in_flight(self) -> int:
        """Requests running or queued as the program ended (the "streaming" programs print it)."""
        for line in self.stdout.splitlines():
            if line.startswith("in flight "):
                return int(line.split()[-1])
        return 0


def run_programs(backend: str, model: str | None, prompt: str, runs: int, workdir: str | Path,
                 kwargs: dict | None = None, call: dict | None = None, parallel: int = 2,
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> list[Run]:
    """``runs`` programs on ``backend`` (modes alternating), forked ``parallel`` at a time from a driver that has
    imported the backend; their output under ``workdir``. ``kwargs``: the backend's options; ``call``: the requests'
    arguments."""
    # one torch thread each: two programs at a time on two cores
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    args = [backend, model or "", prompt, json.dumps(kwargs or {}), json.dumps(call or {})]
    root = str(Path(__file__).resolve().parents[1])  # the checkout's ssr, as the tests import it
    driver = DRIVER.format(imports=BACKEND_IMPORTS.get(backend, ""), program=PROGRAM, modes=MODES)
    done = subprocess.run([sys.executable, "-c", driver, *args, str(runs), str(parallel), str(workdir), str(timeout)],
                          capture_output=True, text=True, timeout=timeout * runs + 120, env=environment, cwd=root)
    assert done.returncode == 0, f"the driver failed ({done.returncode}):\n{done.stderr[-3000:]}"
    results = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["i"])
    return [Run(r["mode"], r["exit"], Path(workdir, f"{r['i']}.out").read_text(errors="replace"),
                Path(workdir, f"{r['i']}.err").read_text(errors="replace")) for r in results]


def check(runs: list[Run], expected: int) -> list[int]:
    """Assert that ``expected`` programs ran, half of each mode, each generated and exited 0 without an abort;
    return the requests in flight as each "streaming" program ended."""
    counts = {mode: sum(r.mode == mode for r in runs) for mode in MODES}
    assert len(runs) == expected and min(counts.values()) == expected // len(MODES), counts
    failed = [r for r in runs if r.returncode != 0 or "terminate called" in r.stderr or "generated" not in r.stdout]
    codes = [r.returncode for r in runs]
    assert not failed, f"{len(failed)} of {len(runs)} programs failed (exit codes {codes}):\n" + "\n".join(
        f"--- {r.mode}: exit {r.returncode}\n{r.stdout[-500:]}\n{r.stderr[-1500:]}" for r in failed[:3])
    return [r.in_flight for r in runs if r.mode == "streaming"]
