from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> Path:
    """The tiny random-init SD3 checkpoint (real diffusers/transformers classes), built once per session."""
    from omnirl.models.tiny import make_tiny_sd3

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3")
