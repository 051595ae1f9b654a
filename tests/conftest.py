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


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory) -> Path:
    """The tiny random-init Qwen3-Omni (thinker + talker + code2wav in one checkpoint, real transformers
    classes, tokenizer, image processor and Whisper feature extractor), built once per session."""
    from omnirl.models.tiny_omni import make_tiny_qwen3_omni

    return make_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "qwen3_omni")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> Path:
    """The tiny random-init Qwen2.5-VL checkpoint with tokenizer and image processor, built once."""
    from omnirl.models.tiny import make_tiny_qwen_vl

    return make_tiny_qwen_vl(tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory) -> Path:
    """The tiny random-init Qwen3-VL checkpoint with tokenizer and image processor, built once."""
    from omnirl.models.tiny import make_tiny_qwen_vl

    return make_tiny_qwen_vl(tmp_path_factory.mktemp("tiny") / "qwen3_vl", "qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_omni_k12(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni taught the MMK12 answer format (omnirl.testing.k12, ~15 s), built once."""
    from omnirl.testing.k12 import make_tiny_qwen3_omni_k12

    return make_tiny_qwen3_omni_k12(tmp_path_factory.mktemp("tiny") / "qwen3_omni_k12")


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory) -> Path:
    """The tiny random-init LTX-2.3 (video + audio; real diffusers/transformers classes), built once."""
    from omnirl.models.tiny_ltx2 import make_tiny_ltx2

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_ltx2(tmp_path_factory.mktemp("tiny") / "ltx2")


@pytest.fixture(scope="session")
def tiny_wan_ti2v(tmp_path_factory) -> Path:
    """The tiny random-init Wan2.2 in the TI2V-5B layout (one transformer, expand_timesteps), built once."""
    from omnirl.models.tiny import make_tiny_wan

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_wan(tmp_path_factory.mktemp("tiny") / "wan_ti2v", "ti2v")


@pytest.fixture(scope="session")
def tiny_wan_a14b(tmp_path_factory) -> Path:
    """The tiny random-init Wan2.2 in the T2V-A14B layout (two experts switched at boundary_ratio)."""
    from omnirl.models.tiny import make_tiny_wan

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_wan(tmp_path_factory.mktemp("tiny") / "wan_a14b", "a14b")


@pytest.fixture(scope="session")
def tiny_bagel(tmp_path_factory) -> Path:
    """The tiny random-init BAGEL, written in the official checkpoint layout, built once per session."""
    from omnirl.models.tiny import make_tiny_bagel

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny") / "bagel")


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> Path:
    """The tiny random-init FLUX.1-dev (a FluxPipeline checkpoint), built once per session."""
    from omnirl.models.flux.tiny import make_tiny_flux

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_flux(tmp_path_factory.mktemp("tiny") / "flux")
