"""A family is its folder plus one line of `ADAPTERS`: every registered family has each part there (its
adapter, tiny builder, public config and README.md), and the names of its checkpoints are its own."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from omnirl.models import ADAPTERS, PARTS, get_adapter, random_checkpoints, tiny_models
from omnirl.testing import FIXTURES, TINY_MODELS

MODELS = Path(__file__).resolve().parent.parent / "omnirl" / "models"


def missing_parts(family: str, root: Path = MODELS) -> list[str]:
    """What the folder of `family` under `root` lacks: a part module (`PARTS`), README.md, the adapter
    registered from its folder, a tiny checkpoint, or a name not the family's own."""
    folder = root / family
    out = [f"{part}.py" for part in PARTS if not (folder / f"{part}.py").is_file()]
    if not (folder / "README.md").is_file() or not (folder / "README.md").read_text().strip():
        out.append("README.md")
    if not ADAPTERS.get(family, "").startswith(f"omnirl.models.{family}.adapter:"):
        out.append("its ADAPTERS entry in adapter.py")
    if out:
        return out
    tiny = importlib.import_module(f"omnirl.models.{family}.tiny").TINY
    random = importlib.import_module(f"omnirl.models.{family}.public_config").RANDOM
    if not tiny:
        out.append("a tiny checkpoint in TINY")
    own = [n for n in [*tiny, *random] if n != family and not n.startswith(f"{family}_")]
    out += [f"the name {n!r} (not {family!r} nor {family}_<layout>)" for n in own]
    return out


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_a_registered_family_has_every_part(family):
    assert missing_parts(family) == []
    assert get_adapter(family).__module__ == f"omnirl.models.{family}.adapter"


def test_a_family_without_a_part_is_found(tmp_path):
    (tmp_path / "sd3").mkdir()
    (tmp_path / "sd3" / "adapter.py").write_text("")
    assert missing_parts("sd3", tmp_path) == ["tiny.py", "public_config.py", "README.md"]


def test_the_checkpoints_are_read_off_the_registry():
    """Each tiny and config-only checkpoint name is one family's; the test fixtures and
    scripts/make_tiny_models.py build the families' and the test-support ones (omnirl.testing)."""
    tiny, random = tiny_models(), random_checkpoints()
    owners = {
        name: [f for f in ADAPTERS if name == f or name.startswith(f"{f}_")] for name in [*tiny, *random]
    }
    assert all(owners.values()), owners
    assert TINY_MODELS == {**tiny, **FIXTURES} and not set(tiny) & set(FIXTURES)


def test_every_folder_is_registered():
    folders = {p.parent.name for p in MODELS.glob("*/adapter.py")}
    assert folders == set(ADAPTERS)
