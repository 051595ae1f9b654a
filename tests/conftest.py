from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> Path:
    """The tiny random-init SD3 checkpoint (real diffusers/transformers classes), built once per session."""
    from omnirl.models.tiny import make_tiny_sd3

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3")


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> Path:
    """The tiny random-init Qwen-Image checkpoint (real diffusers/transformers classes), built once."""
    from omnirl.models.tiny import make_tiny_qwen_image

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_qwen_image(tmp_path_factory.mktemp("tiny") / "qwen_image")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit(tmp_path_factory) -> Path:
    """The tiny random-init Qwen-Image-Edit checkpoint (real diffusers/transformers classes), built once per
    session."""
    from omnirl.models.tiny import make_tiny_qwen_image_edit

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny") / "qwen_image_edit")
