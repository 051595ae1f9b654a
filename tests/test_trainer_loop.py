"""The shape of the training loop: `omnirl.trainer._train`'s loop is a short list of named calls, and what
depends on the algorithm, the rollout's settings or the model family lives in those calls, not in it."""

from __future__ import annotations

import ast
from pathlib import Path

import omnirl.trainer

MAX_STATEMENTS = 20
# Settings a branch of the loop must not read: an algorithm, a rollout backend or precision, a family.
FORBIDDEN = ("cfg.algo", "cfg.rollout", "cfg.model", "cfg.family", "cfg.families")


def _loop() -> ast.For:
    tree = ast.parse(Path(omnirl.trainer.__file__).read_text())
    train = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train")
    loops = [n for n in ast.walk(train) if isinstance(n, ast.For)]
    assert len(loops) == 1, f"_train holds {len(loops)} for loops, expected the step loop alone"
    return loops[0]


def _statements(body: list[ast.stmt]) -> int:
    """Statements of `body`, those nested in with / if / try blocks included."""
    return sum(1 for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.stmt))


def test_loop_is_short():
    count = _statements(_loop().body)
    assert count <= MAX_STATEMENTS, f"the step loop holds {count} statements, at most {MAX_STATEMENTS}"


def test_loop_has_no_algorithm_or_family_branch():
    branches = [n for n in ast.walk(_loop()) if isinstance(n, (ast.If, ast.IfExp, ast.Match))]
    for n in branches:
        test = ast.unparse(n.subject if isinstance(n, ast.Match) else n.test)
        bad = [name for name in FORBIDDEN if name in test] + (["family"] if "family" in test else [])
        assert not bad, f"line {n.lineno}: the step loop branches on {test!r}"


def test_counter_counts_nested_statements():
    """The count includes what a with / if block holds (the check above can fail)."""
    body = ast.parse("with a:\n    x = 1\n    if y:\n        z()\nw()\n").body
    assert _statements(body) == 5
