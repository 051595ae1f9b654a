"""The package's imports run one way: every import of every module in omnirl/ (function-local and
TYPE_CHECKING ones included, read with `ast`) goes to the module's own floor or one below it, as
docs/architecture.md lists the floors, and no module reaches itself again through its imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "omnirl"


def floors() -> list[list[str]]:
    """The floors of docs/architecture.md's "Imports run one way", top first: module prefixes each."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Imports run one way", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\d+\. (.*)$", section, re.M)
    return [re.findall(r"`(omnirl[\w.]*)`", row.split(":", 1)[0]) for row in rows]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The omnirl modules `name` imports anywhere in its file: `from a.b import c` is a.b.c when c is a
    module, else a.b; a relative import is resolved against the module's package."""

    def module(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {module(a.name) for a in node.names if a.name.split(".")[0] == "omnirl"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "omnirl":
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else module(base))
    # Importing a.b.c runs the package a.b's __init__ first: it counts as an import of its own.
    out |= {p for m in set(out) if m for p in packages(m, known)}
    return {m for m in out if m and m != name and m != "omnirl" and not name.startswith(m + ".")}


def packages(name: str, known: dict[str, Path]) -> set[str]:
    """The packages above module `name` (omnirl.a.b: omnirl.a), whose __init__ an import of it runs."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items() if name != "omnirl"}


def floor_of(name: str, table: list[list[str]]) -> int | None:
    """The floor (0 = top) of the longest prefix listed that holds `name`."""
    best = None
    for i, prefixes in enumerate(table):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return best and best[0]


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_floors_are_listed():
    table = floors()
    assert len(table) >= 8 and all(table), table


def test_every_module_is_on_a_floor():
    table = floors()
    assert [m for m in graph() if floor_of(m, table) is None] == []


def test_no_import_reaches_a_higher_floor():
    table = floors()
    upward = [
        f"{a} (floor {floor_of(a, table)}) imports {b} (floor {floor_of(b, table)})"
        for a, targets in graph().items()
        for b in sorted(targets)
        if (fa := floor_of(a, table)) is not None and (fb := floor_of(b, table)) is not None and fb < fa
    ]
    assert upward == []


def test_no_circle():
    assert cycle(graph()) is None


def test_config_imports_nothing_of_omnirl():
    """config.py imports only its rollout sections, which import nothing of omnirl."""
    assert graph()["omnirl.config"] == {"omnirl.config_rollout"}
    assert graph()["omnirl.config_rollout"] == set()
    assert graph()["omnirl.errors"] == set()


@pytest.mark.parametrize(
    "edges, found",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_check_finds_a_circle(edges, found):
    assert cycle(edges) == found


def test_an_upward_import_is_found(tmp_path):
    """The walk sees a function-local import, and the floors put it above its importer."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from omnirl.trainer import train\n")
    known = {"omnirl.models.x": path, "omnirl.trainer": PACKAGE / "trainer.py"}
    assert imports("omnirl.models.x", path, known) == {"omnirl.trainer"}
    table = floors()
    assert floor_of("omnirl.trainer", table) < floor_of("omnirl.models.x", table)
