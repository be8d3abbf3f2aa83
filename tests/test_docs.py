"""The documentation's own checks: every relative Markdown link resolves (file and heading), and the pages that
issue 59 trimmed stay short. Counts only, standard library only, no model, well under a second.

The docs are read on GitHub, so "resolves" means what GitHub does: a relative target is a path from the linking
file's folder (or from the repository root when it starts with '/'), and a '#fragment' names a heading by its
GitHub anchor slug."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent


def doc_files() -> list[Path]:
    """The Markdown pages whose links are checked: README.md, CHANGELOG.md when there is one,
    benchmarks/README.md, and every .md under docs/ (docs/bench's reports included: README.md links into them)."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


# ---------------------------------------------------------------------------------------------------------------
# reading Markdown: code is not prose


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def prose_lines(text: str, blank_code_spans: bool = True) -> list[tuple[int, str]]:
    """(line number, line) for the lines outside fenced code blocks, with inline code spans blanked out unless
    `blank_code_spans` is false (a heading's code span is part of its title, hence of its anchor).

    Why: a shell comment ('# ...') in a ``` block is not a heading, and `[x](y)` shown as code is not a link; both
    would otherwise give false headings and false broken links. A fence closes only on the same character, at
    least as long, as CommonMark says; a block left open runs to the end of the file."""
    out = []
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            if blank_code_spans:
                line = _INLINE_CODE.sub(lambda c: " " * len(c.group(0)), line)
            out.append((number, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and line.strip() == m.group(1):
            fence = None
    return out


# ---------------------------------------------------------------------------------------------------------------
# headings and their anchors


_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_LINK_IN_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_HTML_TAG = re.compile(r"<[^>]+>")
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def heading_texts(text: str) -> list[str]:
    """The text of every heading, in order, as GitHub renders it (links become their text, HTML tags vanish).

    Both ATX ('## Title') and setext (a 'Title' line underlined by '===' or '---') headings count, since GitHub
    gives both an anchor. Order matters: repeated titles are numbered by their position."""
    lines = prose_lines(text, blank_code_spans=False)
    titles = []
    for i, (number, line) in enumerate(lines):
        m = _ATX.match(line)
        if m:
            titles.append(m.group(2) or "")
        elif (
            _SETEXT.match(line)
            and i > 0
            and lines[i - 1][0] == number - 1
            and lines[i - 1][1].strip()
            and not _ATX.match(lines[i - 1][1])
            and not lines[i - 1][1].lstrip().startswith(("-", "*", "+", ">", "|"))
        ):
            titles.append(lines[i - 1][1].strip())
    return [_HTML_TAG.sub("", _LINK_IN_TEXT.sub(r"\1", t)) for t in titles]


def github_slug(title: str) -> str:
    """The anchor GitHub gives a heading titled `title`, before the -1, -2 numbering of repeats.

    GitHub (github-slugger) lowercases, trims, drops every character that is not a letter, a digit, a space, '-'
    or '_' (letters of any script are kept), and turns each space into '-' (no collapsing: 'a - b' is 'a---b')."""
    kept = "".join(c for c in title.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


@lru_cache(maxsize=None)
def page_anchors(page: Path) -> frozenset[str]:
    """anchors() of a page file, read once however many links point into it."""
    return frozenset(anchors(page.read_text(encoding="utf-8")))


def anchors(text: str) -> set[str]:
    """Every fragment a link may name in a page: its headings' slugs, a repeated slug numbered -1, -2, ... in
    order (as GitHub does), plus the ids of explicit HTML anchors (<a id="..."> or <a name="...">)."""
    seen: set[str] = set()
    for title in heading_texts(text):
        base = slug = github_slug(title)
        n = 0
        while slug in seen:
            n += 1
            slug = f"{base}-{n}"
        seen.add(slug)
    for _, line in prose_lines(text):
        seen.update(_HTML_ANCHOR.findall(line))
    return seen


# ---------------------------------------------------------------------------------------------------------------
# links


_INLINE_START = re.compile(r"\]\(")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]^][^\]]*\]:[ \t]*(<[^>]*>|\S+)")  # not a footnote ('[^1]: ...')
_EXTERNAL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|//)")


def _inline_target(line: str, start: int) -> str | None:
    """The target of the inline link whose '(' is at line[start - 1]: '<with spaces>' or a run of non-space
    characters with balanced parentheses; a '"title"' after it is not part of it. None when it is not a link."""
    rest = line[start:].lstrip()
    if rest.startswith("<"):
        end = rest.find(">")
        return rest[1:end] if end > 0 else None
    depth = 0
    for i, c in enumerate(rest):
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                return rest[:i]
            depth -= 1
        elif c.isspace():
            return rest[:i]
    return None


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) for every inline link and image ('[text](target "title")', '![alt](<target>)') and
    every reference definition ('[label]: target'), outside code.

    Why this way and not one big regex: a link's text may itself hold brackets ('[![badge](a.svg)](b)'), so every
    '](' is taken as the start of a target, and the target is read up to its closing ')' with parentheses balanced,
    the way CommonMark reads it."""
    found = []
    for number, line in prose_lines(text):
        ref = _REF_DEF.match(line)
        if ref:
            found.append((number, ref.group(1).strip("<>")))
            continue
        for m in _INLINE_START.finditer(line):
            target = _inline_target(line, m.end())
            if target:
                found.append((number, target))
    return found


def broken_link(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, does not resolve; None when it does or is not ours to check (a URL, a
    mail address: anything with a scheme). Paths and fragments are percent-decoded, as a browser would."""
    if _EXTERNAL.match(target):
        return None
    path_part, _, fragment = target.partition("#")
    path_part, fragment = unquote(path_part), unquote(fragment)
    if not path_part:
        dest = page
    elif path_part.startswith("/"):
        dest = ROOT / path_part.lstrip("/")
    else:
        dest = page.parent / path_part
    if not dest.exists():
        return "no such file"
    if fragment and dest.is_file() and dest.suffix.lower() == ".md":
        if fragment not in page_anchors(dest.resolve()):
            return f"no heading with anchor #{fragment} in {os.path.relpath(dest, ROOT)}"
    return None


def test_relative_links_resolve():
    pages = doc_files()
    assert pages, "no Markdown pages found"
    problems = []
    checked = 0
    for page in pages:
        for number, target in links(page.read_text(encoding="utf-8")):
            checked += 1
            why = broken_link(page, target)
            if why:
                problems.append(f"{page.relative_to(ROOT)}:{number} -> {target} ({why})")
    assert checked, "no links found at all: the extraction is broken"
    assert not problems, f"{len(problems)} broken link(s) of {checked}:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------------
# the length limits of issue 59


def _lines(relative: str) -> list[str]:
    return (ROOT / relative).read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("relative, limit", [("README.md", 180), ("docs/backends/llama-cpp.md", 450)])
def test_page_length(relative, limit):
    count = len(_lines(relative))
    assert count <= limit, f"{relative} has {count} lines, issue 59 allows {limit}"


def test_results_current_section_length():
    """docs/results.md keeps its latest numbers in one '## Current' section (from that heading to the next '## '
    line), short enough to read; the history below it may grow."""
    lines = _lines("docs/results.md")
    starts = [i for i, line in enumerate(lines) if line.rstrip() == "## Current"]
    assert starts, "docs/results.md has no '## Current' section"
    start = starts[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    assert end - start <= 200, f"docs/results.md's '## Current' section has {end - start} lines, issue 59 allows 200"
