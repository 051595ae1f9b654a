from pathlib import Path

import pytest
import torch

from omnirl.testing import TINY_MODELS


def tiny_fixture(name: str):
    """The session fixture `tiny_<name>`: the tiny checkpoint `name` of `TINY_MODELS` (a family's own,
    read off the registry, or a reward model's), built once per session in a temporary folder."""

    @pytest.fixture(scope="session", name=f"tiny_{name}")
    def fixture(tmp_path_factory) -> Path:
        torch.set_num_threads(2)  # the CI machine has 2 cores, shared
        return Path(TINY_MODELS[name](tmp_path_factory.mktemp("tiny") / name))

    fixture.__doc__ = f"The tiny checkpoint {name!r} (omnirl.testing.TINY_MODELS), built once per session."
    return fixture


for _name in TINY_MODELS:
    globals()[f"tiny_{_name}"] = tiny_fixture(_name)
