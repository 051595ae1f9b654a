"""Module docstrings stay short and point at docs that exist: every module docstring under omnirl/ is at
most MAX_DOCSTRING_LINES lines (the explanation lives in docs/, where users read it), every docs page or
README a docstring names exists, and every #anchor it names is a heading of that page. The links between
the docs pages resolve the same way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "omnirl"
MAX_DOCSTRING_LINES = 14
# A page a docstring names: docs/<page>.md or a family's README, with an optional #anchor.
POINTER = re.compile(r"((?:docs|omnirl)/[\w/.-]+\.md)(#[\w-]+)?")
# A relative markdown link of a docs page: [text](target.md#anchor); external addresses are skipped.
LINK = re.compile(r"\]\(([^)\s:]+?\.md)?(#[^)\s]+)?\)")


def module_docstrings() -> dict[Path, str]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc is not None:
            out[path.relative_to(ROOT)] = doc
    return out


def anchors(page: Path) -> set[str]:
    """The GitHub anchors of a markdown page's headings: lower case, punctuation but - and _ dropped,
    spaces as hyphens; headings inside code blocks do not count."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def broken(page: Path, anchor: str | None) -> str | None:
    if not page.is_file():
        return f"{page.relative_to(ROOT)} does not exist"
    if anchor and anchor[1:] not in anchors(page):
        return f"{page.relative_to(ROOT)} has no heading for {anchor}"
    return None


@pytest.mark.parametrize("path,doc", list(module_docstrings().items()), ids=str)
def test_module_docstring_is_short(path: Path, doc: str):
    lines = len(doc.splitlines())
    assert lines <= MAX_DOCSTRING_LINES, (
        f"{path}'s module docstring has {lines} lines (at most {MAX_DOCSTRING_LINES}): move the explanation "
        "to its page under docs/ (or the family's README.md) and point to it"
    )


def test_docstring_pointers_resolve():
    problems = []
    for path, doc in module_docstrings().items():
        for target, anchor in POINTER.findall(" ".join(doc.split())):
            if (problem := broken(ROOT / target, anchor)) is not None:
                problems.append(f"{path}: {problem}")
    assert not problems, "\n".join(problems)


def test_docs_links_resolve():
    pages = sorted(ROOT.glob("docs/*.md")) + sorted(PACKAGE.glob("models/*/README.md"))
    problems = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target, anchor in LINK.findall(text):
            dest = (page.parent / target).resolve() if target else page
            if (problem := broken(dest, anchor)) is not None:
                problems.append(f"{page.relative_to(ROOT)}: {problem}")
    assert not problems, "\n".join(problems)
