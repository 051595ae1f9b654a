"""`scripts/train.py --help` and `--help-all`.

`--help` is short: the recipe's header, the fields it sets (value and documentation) section by section,
the names of the other fields of those sections (a component's own section, `--algo.dgpo.*`, only where
the recipe runs it), and the recipes in yaml/. `--help-all` documents every field of every section. Both
read the attribute docstrings of omnirl.config (and of the family's `Settings`), as tyro does, and wrap
them to the terminal as whole paragraphs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import shutil
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml

from omnirl.config import RECIPE_DIR, Config
from omnirl.config_checks import sections

USAGE = "usage: python scripts/train.py [--nproc_per_node N] --recipe NAME [--section.field VALUE ...]"


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string after a field), whitespace collapsed."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        doc = (
            after.value.value
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            else None
        )
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, str):
            docs[node.target.id] = " ".join(doc.split())
    return docs


def type_name(tp: Any) -> str:
    """A field's type as --help shows it: `{a, b}` for a Literal (a long list wraps between its words, not
    away from its flag), else its name (`list[str]`, `float`)."""
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ", ".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def runs(cfg: Config, section: str) -> bool:
    """Whether the run of `cfg` reads the component section `section` (`--help` names only those): its
    loss's own (algo.<loss>), the vLLM backend's with rollout.backend vllm, FP8's with rollout.precision
    fp8."""
    parent, _, name = section.partition(".")
    if parent == "algo":
        return name == cfg.algo.loss
    return {"rollout.vllm": cfg.rollout.backend == "vllm", "rollout.fp8": cfg.rollout.precision == "fp8"}[
        section
    ]


def recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def help_text(cfg: Config | None, source: Path | None, full: bool, width: int | None = None) -> str:
    """The help of `cfg` loaded from the recipe `source` (both None without --recipe): every section and
    field with `full`, else the sections the recipe sets."""
    width = width or min(shutil.get_terminal_size().columns, 110)
    out: list[str] = []

    def para(text: str, indent: str = "", more: str | None = None) -> None:
        lines = textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more or indent)
        out.extend(lines or [""])

    para(USAGE, "", " " * 7)
    out.append("")

    given: dict[str, Any] = {}
    if source is not None:
        lines = source.read_text().splitlines()
        header = [
            line[1:].strip()
            for line in lines[1 : next(i for i, x in enumerate(lines) if not x.startswith("#"))]
        ]
        shown = source.relative_to(RECIPE_DIR.parent) if source.is_relative_to(RECIPE_DIR.parent) else source
        para(f"{shown}: {' '.join(header)}")
        out.append("")
        given = {k: v for k, v in (yaml.safe_load(source.read_text()) or {}).items() if isinstance(v, dict)}
    cfg = cfg if cfg is not None else Config()
    if full:
        para("Every field (--section.field VALUE sets one; the value shown is the recipe's or the default):")
    elif source is not None:
        para("What the recipe sets, by section (--section.field VALUE overrides any field):")
    for name, cls in sections(type(cfg)):
        values = functools.reduce(getattr, name.split("."), cfg)
        mapping = functools.reduce(
            lambda d, k: d.get(k) if isinstance(d, dict) else None, name.split("."), given
        )
        if not (full or isinstance(mapping, dict)):
            continue
        set_here: dict = mapping if isinstance(mapping, dict) else {}
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        out.extend(["", name])
        rest = []
        for f in dataclasses.fields(cls):
            flag = f"--{name}.{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):  # a section of its own, printed after this one
                if not full and runs(cfg, flag[2:]) and not isinstance(set_here.get(f.name), dict):
                    rest.append(f"{flag}.*")
                continue
            if not full and f.name not in set_here:
                rest.append(flag)
                continue
            para(f"{flag} {type_name(hints[f.name])} = {getattr(values, f.name)!r}", "  ", " " * 6)
            para(docs.get(f.name, ""), "      ")
        if rest:
            para("also: " + ", ".join(rest), "  ")
    if source is None:
        para("A recipe's settings, and its family's own section (family): --recipe NAME --help")
    out.append("")
    para("Recipes (--recipe NAME, from yaml/, or a path to a YAML file): " + ", ".join(recipes()))
    if not full:
        out.append("")
        para("Every field of every section, with its documentation: --help-all")
    return "\n".join(out)
