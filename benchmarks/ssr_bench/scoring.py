"""Answer quality per suite.

Generated code never runs in the harness's process: it is written to a fresh temporary directory and run by a
separate Python (or a compiled C++ binary) with a timeout, its own process group (killed whole on timeout), a memory
limit, and no network where the machine allows it (``unshare -n``, a new network namespace with no interfaces).

Every scorer returns ``{"score": float in [0, 1], ...details}``.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
from typing import Any

DEFAULT_TIMEOUT = 10.0
MEMORY_LIMIT = 4 << 30

# ---------------------------------------------------------------------------------------------------- sandbox


@functools.lru_cache(maxsize=1)
def _no_network_prefix() -> tuple[str, ...]:
    """``("unshare", "-n")`` where this machine lets us drop the network, else ``()``."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-n") if ok else ()


def _limits() -> None:  # runs in the child before exec
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def _sandbox_env(tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")}
    env.update({"HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "no_proxy": "*", "http_proxy": "http://0.0.0.0:9", "https_proxy": "http://0.0.0.0:9"})
    return env


def run_sandboxed(argv: list[str], cwd: str, timeout: float, stdin: str | None = None) -> dict[str, Any]:
    """Run ``argv`` in ``cwd`` with a timeout; returns {returncode, stdout, stderr, timed_out}."""
    proc = subprocess.Popen(
        [*_no_network_prefix(), *argv], cwd=cwd, env=_sandbox_env(cwd), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_limits, text=True,
        errors="replace",
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        return {"returncode": proc.returncode, "stdout": out, "stderr": err, "timed_out": False}
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        out, err = proc.communicate()
        return {"returncode": None, "stdout": out, "stderr": err, "timed_out": True}


def run_python(program: str, timeout: float = DEFAULT_TIMEOUT, files: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``program`` (Python source) in a fresh temporary directory by a separate interpreter."""
    with tempfile.TemporaryDirectory(prefix="ssr-bench-") as tmp:
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        return run_sandboxed([sys.executable, "-I", "-B", path], cwd=tmp, timeout=timeout)


# ---------------------------------------------------------------------------------------------------- code extraction

_ALIASES = {"python": ("py", "python3"), "cpp": ("c++",)}
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+\-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(answer: str, language: str = "python") -> str:
    """The code in an answer: the longest fenced block in ``language`` (or untagged), else the raw answer."""
    text = answer or ""
    tags = {"", language, *_ALIASES.get(language, ())}
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in tags]
    if blocks:
        return max(blocks, key=len).strip("\n") + "\n"
    return text.strip("\n") + "\n"


# ---------------------------------------------------------------------------------------------------- HumanEval


def humaneval_program(item: dict[str, Any], answer: str) -> str:
    code = extract_code(answer)
    entry = item["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        # a whole function: keep the prompt's imports and helpers (its target function gets a stub body), then the
        # model's code, which redefines the target
        head = item["prompt"].rstrip() + "\n    pass\n\n"
    else:  # a function body continuing the prompt
        head = item["prompt"]
    return f"{head}\n{code}\n\n{item['test']}\n\ncheck({entry})\n"


def score_humaneval(item: dict[str, Any], answer: str, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    res = run_python(humaneval_program(item, answer), timeout=timeout)
    passed = res["returncode"] == 0 and not res["timed_out"]
    out = {"score": 1.0 if passed else 0.0, "passed": passed, "timed_out": res["timed_out"]}
    if not passed:
        out["error"] = (res["stderr"] or "")[-400:] if not res["timed_out"] else f"timeout after {timeout}s"
    return out


# ---------------------------------------------------------------------------------------------------- ClassEval

_CLASSEVAL_DRIVER = r'''
import json, sys, unittest
sys.path.insert(0, ".")
try:
    import solution_test as mod
except BaseException as exc:  # the model's code does not even import
    print("@@RESULT@@" + json.dumps({"tests": 0, "failures": 0, "errors": 1, "import_error": repr(exc)[:300]}))
    raise SystemExit(0)
names = NAMES
loader = unittest.defaultTestLoader
suite = unittest.TestSuite()
for name in names or [n for n in dir(mod) if isinstance(getattr(mod, n), type)
                      and issubclass(getattr(mod, n), unittest.TestCase)]:
    if hasattr(mod, name):
        suite.addTests(loader.loadTestsFromTestCase(getattr(mod, name)))
import io
result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
print("@@RESULT@@" + json.dumps({"tests": result.testsRun, "failures": len(result.failures),
                                 "errors": len(result.errors)}))
'''


def score_classeval(item: dict[str, Any], answer: str, timeout: float = 30.0) -> dict[str, Any]:
    code = extract_code(answer)
    imports = "\n".join(item.get("import_statement") or [])
    module = f"{imports}\n\n{code}\n\n{item['test']}\n"
    driver = _CLASSEVAL_DRIVER.replace("NAMES", repr(list(item.get("test_classes") or [])))
    res = run_python(driver, timeout=timeout, files={"solution_test.py": module})
    m = re.search(r"@@RESULT@@(\{.*\})", res["stdout"] or "")
    if res["timed_out"] or m is None:
        return {"score": 0.0, "passed": False, "tests": 0, "passed_tests": 0, "timed_out": res["timed_out"],
                "error": f"timeout after {timeout}s" if res["timed_out"] else (res["stderr"] or "")[-400:]}
    r = json.loads(m.group(1))
    ok = r["tests"] - r["failures"] - r["errors"]
    passed = r["tests"] > 0 and ok == r["tests"]
    out = {"score": 1.0 if passed else 0.0, "passed": passed, "tests": r["tests"], "passed_tests": max(ok, 0),
           "partial": max(ok, 0) / r["tests"] if r["tests"] else 0.0, "timed_out": False}
    if "import_error" in r:
        out["error"] = r["import_error"]
    return out


# ---------------------------------------------------------------------------------------------------- LongProc


def _extract_tag(text: str, tag: str) -> str | None:
    end = text.rfind(f"</{tag}>")
    if end == -1:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start == -1:
        return None
    return text[start + len(tag) + 2:end].strip()


def score_path_traversal(item: dict[str, Any], answer: str) -> dict[str, Any]:
    """LongProc's metric: the route in <Route> tags equals the gold route (accuracy); partial accuracy is the share
    of gold lines up to the first wrong one."""
    pred = _extract_tag(answer, "Route")
    gold = item["reference"].strip()
    if pred is None:
        return {"score": 0.0, "partial": 0.0, "extracted": False}
    if pred.strip() == gold:
        return {"score": 1.0, "partial": 1.0, "extracted": True}
    gl, pl = gold.split("\n"), pred.strip().split("\n")
    good = 0
    for g, p in zip(gl, pl):
        if g.strip() != p.strip():
            break
        good += 1
    return {"score": 0.0, "partial": good / len(gl), "extracted": True}


def countdown_solution_valid(nums: list[int], target: int, solution: str) -> bool:
    """LongProc's countdown check: three equations ``a op b = c``, each correct, using the numbers available
    (each once, intermediate results added back), ending at ``target``."""
    pool = list(nums)
    lines = [ln.strip() for ln in solution.strip().split("\n") if ln.strip()]
    if len(lines) != 3:
        return False
    for line in lines:
        m = re.fullmatch(r"(-?\d+)\s*([+\-*/])\s*(-?\d+)\s*=\s*(-?\d+(?:\.\d+)?)", line)
        if not m:
            return False
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), float(m.group(4))
        if op == "/" and b == 0:
            return False
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        if value is None or abs(value - c) > 1e-9 or c != int(c):
            return False
        for x in (a, b):
            if x not in pool:
                return False
            pool.remove(x)
        pool.append(int(c))
    return len(pool) == 1 and pool[0] == target


def score_countdown(item: dict[str, Any], answer: str) -> dict[str, Any]:
    sol = _extract_tag(answer, "Solution")
    if sol is None:
        return {"score": 0.0, "extracted": False}
    ok = countdown_solution_valid(item["nums"], item["target"], sol)
    return {"score": 1.0 if ok else 0.0, "extracted": True}


def _normalize_tom(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in string.punctuation and ch != "\u2019")
    s = re.sub(r"\b(a|an|the|on|in|at|step|thinks|think|believes|believe|is|are|of|location|know|knows|belief)\b",
               " ", s)
    return " ".join(s.split())


def _tom_steps(text: str) -> list[str]:
    if "- Step 0:" in text:
        text = text[text.rfind("- Step 0:"):]
    out = []
    for line in text.strip().split("\n"):
        line = line.strip()
        if re.match(r"^- Step \d+:", line):
            out.append(_normalize_tom(line.split("-", 1)[1]))
    return out


def score_tom_tracking(item: dict[str, Any], answer: str) -> dict[str, Any]:
    """Score: the step-by-step trace equals the gold trace line for line (LongProc's strict accuracy, with its
    normalisation); ``final_correct``: the "Final Answer:" line names the gold location."""
    pred, gold = _tom_steps(answer), _tom_steps(item["reference"])
    strict = bool(gold) and pred == gold
    first_diff = next((i for i, (a, b) in enumerate(zip(pred, gold)) if a != b), None)
    if strict:
        partial = 1.0
    elif first_diff is not None:
        partial = first_diff / len(gold)
    else:
        partial = min(len(pred), len(gold)) / len(gold) if gold else 0.0
    m = re.findall(r"Final Answer:\s*(.+)", answer)
    final_ok = bool(m) and _normalize_tom(m[-1]) == _normalize_tom(item.get("final_answer", ""))
    return {"score": 1.0 if strict else 0.0, "partial": partial, "final_correct": final_ok}


CPP_HEADER = """#include <cstdio>
#include <iostream>
#include <vector>
#include <algorithm>
#include <numeric>
#include <cmath>
#include <cstring>
#include <set>
#include <map>
#include <queue>
#include <stack>
#include <list>
#include <fstream>
#include <climits>
#include <cassert>
#include <iomanip>
#include <sstream>
#include <bitset>
#include <string>
using namespace std;
"""


def score_pseudo_to_code(item: dict[str, Any], answer: str, timeout: float = 10.0,
                         compile_timeout: float = 60.0) -> dict[str, Any]:
    """LongProc's metric: the ```cpp block compiles (g++) and passes every test case (whitespace-separated
    output tokens compared)."""
    m = re.search(r"```(?:cpp|c\+\+)\s*\n(.*?)```", answer or "", re.S)
    if m is None:
        return {"score": 0.0, "extracted": False}
    gxx = shutil.which("g++")
    if gxx is None:
        return {"score": 0.0, "extracted": True, "error": "g++ not found"}
    with tempfile.TemporaryDirectory(prefix="ssr-bench-") as tmp:
        src = os.path.join(tmp, "main.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(CPP_HEADER + m.group(1))
        comp = run_sandboxed([gxx, "-O1", "-std=c++17", "-w", "-o", "main", "main.cpp"], cwd=tmp,
                             timeout=compile_timeout)
        if comp["timed_out"] or comp["returncode"] != 0:
            return {"score": 0.0, "extracted": True, "compiled": False, "error": (comp["stderr"] or "")[-400:]}
        cases = item["testcases"]
        for k, (inp, expected) in enumerate(cases):
            stdin = "\n".join(inp) + "\n"
            res = run_sandboxed([os.path.join(tmp, "main")], cwd=tmp, timeout=timeout, stdin=stdin)
            if res["timed_out"] or (res["stdout"] or "").split() != "\n".join(expected).split():
                return {"score": 0.0, "extracted": True, "compiled": True, "failed_case": k,
                        "timed_out": res["timed_out"]}
    return {"score": 1.0, "extracted": True, "compiled": True}


_LONGPROC_SCORERS = {
    "countdown": score_countdown,
    "path_traversal": score_path_traversal,
    "tom_tracking": score_tom_tracking,
    "pseudo_to_code": score_pseudo_to_code,
}


def score_longproc(item: dict[str, Any], answer: str) -> dict[str, Any]:
    return _LONGPROC_SCORERS[item["task"]](item, answer)


# ---------------------------------------------------------------------------------------------------- BFCL


def _std_string(s: str) -> str:
    """BFCL's string normalisation: drop spaces and ,./-_*^ punctuation, lower case, ' -> "."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def value_matches(value: Any, allowed: Any, expected_type: str | None = None) -> bool:
    """``value`` equals ``allowed`` under BFCL's rules: strings normalised, int accepted for float, lists compared
    element-wise, dicts key-wise with per-key lists of possible values."""
    if isinstance(allowed, str):
        return isinstance(value, str) and _std_string(value) == _std_string(allowed)
    if isinstance(allowed, bool) or isinstance(value, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(allowed, (int, float)):
        if not isinstance(value, (int, float)):
            return False
        if expected_type == "integer" and isinstance(value, float) and isinstance(allowed, int):
            return False
        return float(value) == float(allowed)
    if isinstance(allowed, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(allowed):
            return False
        return all(value_matches(v, a) for v, a in zip(value, allowed))
    if isinstance(allowed, dict):
        if not isinstance(value, dict):
            return False
        # gold dicts map each key to a list of possible values ("" = may be absent)
        for key, options in allowed.items():
            opts = options if isinstance(options, list) else [options]
            if key not in value:
                if "" not in opts:
                    return False
                continue
            if not any(value_matches(value[key], o) for o in opts if o != ""):
                return False
        return all(key in allowed for key in value)
    return value == allowed


def _param_ok(value: Any, options: list[Any], expected_type: str | None) -> bool:
    for option in options:
        if option == "" and value != "":
            continue
        if value_matches(value, option, expected_type):
            return True
    return False


def check_bfcl_call(call: dict[str, Any], gold: dict[str, dict[str, list[Any]]],
                    function: dict[str, Any] | None) -> tuple[bool, str]:
    """One model call ``{"name", "arguments"}`` against one gold entry ``{func_name: {param: [possible values]}}``.

    Rules: the function name matches (BFCL also accepts "." written as "_"); every required parameter is present;
    every given parameter is known to the gold answer and its value is among the possible values; a parameter the
    gold lists but the call leaves out must be optional (its possible values include "").
    """
    (gold_name, gold_params), = gold.items()
    name = call.get("name") or ""
    if name != gold_name and name != gold_name.replace(".", "_"):
        return False, f"wrong function {name!r}, expected {gold_name!r}"
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return False, "arguments are not valid JSON"
    if not isinstance(args, dict):
        return False, "arguments are not an object"
    props = ((function or {}).get("parameters") or {}).get("properties") or {}
    required = ((function or {}).get("parameters") or {}).get("required") or []
    for p in required:
        if p not in args:
            return False, f"missing required parameter {p!r}"
    for p, v in args.items():
        if p not in gold_params:
            return False, f"unexpected parameter {p!r}"
        expected_type = (props.get(p) or {}).get("type")
        if not _param_ok(v, gold_params[p], expected_type):
            return False, f"value {v!r} for {p!r} not among {gold_params[p]!r}"
    for p, options in gold_params.items():
        if p not in args and "" not in options:
            return False, f"parameter {p!r} left out but not optional"
    return True, ""


def _materialize(allowed: Any) -> Any:
    if isinstance(allowed, dict):  # key -> list of possible values
        out = {}
        for key, options in allowed.items():
            opts = [o for o in (options if isinstance(options, list) else [options]) if o != ""]
            if opts:
                out[key] = _materialize(opts[0])
        return out
    if isinstance(allowed, list):
        return [_materialize(a) for a in allowed]
    return allowed


def bfcl_reference_calls(gold: list[dict[str, dict[str, list[Any]]]]) -> list[dict[str, Any]]:
    """One correct call per gold entry (first possible value of each parameter, optional ones left out)."""
    calls = []
    for entry in gold:
        (name, params), = entry.items()
        args = {p: _materialize(opts[0]) for p, opts in
                ((p, [o for o in options if o != ""]) for p, options in params.items()) if opts}
        calls.append({"name": name, "arguments": args})
    return calls


def score_bfcl(item: dict[str, Any], tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """As many calls as gold entries, each gold entry matched by a different call in any order (BFCL's parallel
    rule); no gold entry (the irrelevance categories) means the right answer calls nothing."""
    gold = item["ground_truth"]
    calls = list(tool_calls or [])
    if len(calls) != len(gold):
        return {"score": 0.0, "error": f"{len(calls)} tool call(s), expected {len(gold)}"}
    functions = {f["name"]: f for f in item.get("functions", [])}
    why = ""
    for order in itertools.permutations(range(len(calls))):
        checks = [check_bfcl_call(calls[i], g, functions.get(next(iter(g)))) for i, g in zip(order, gold)]
        if all(ok for ok, _ in checks):
            return {"score": 1.0}
        why = why or next(reason for ok, reason in checks if not ok)
        if len(calls) > 4:  # BFCL's parallel items have at most a handful of calls; do not try 5! orders
            break
    return {"score": 0.0, "error": why}


# ---------------------------------------------------------------------------------------------------- dispatch


def score_item(item: dict[str, Any], answer: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Score one generation of ``item``; ``answer`` is the text after the chain of thought."""
    suite = item["suite"]
    try:
        if suite == "humaneval":
            return score_humaneval(item, answer)
        if suite == "classeval":
            return score_classeval(item, answer)
        if suite == "longproc":
            return score_longproc(item, answer)
        if suite in ("bfcl", "bfcl-auto"):
            return score_bfcl(item, tool_calls or [])
    except Exception as exc:  # a scorer bug must not kill a long run
        return {"score": 0.0, "error": f"scorer failed: {type(exc).__name__}: {exc}"}
    raise ValueError(f"no scorer for suite {suite!r}")
