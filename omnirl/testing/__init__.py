"""What the tests, the tiny recipes and the measuring scripts build, and nothing in the training path
imports: the tiny reward models (`rewards`), the tiny Qwen3-Omni taught the MMK12 answer format (`k12`),
and `TINY_MODELS`, every tiny checkpoint by the name `scripts/make_tiny_models.py --only` takes. The top
floor of the package: it may import any module of omnirl, and no module of omnirl imports it."""

from __future__ import annotations

from omnirl.models.flux.tiny import make_tiny_flux
from omnirl.models.tiny import (
    make_tiny_bagel,
    make_tiny_qwen_image,
    make_tiny_qwen_image_edit,
    make_tiny_sd3,
    make_tiny_wan,
)
from omnirl.models.tiny_ltx2 import make_tiny_ltx2
from omnirl.models.tiny_omni import make_tiny_qwen3_omni, make_tiny_qwen_vl
from omnirl.testing.k12 import make_tiny_qwen3_omni_k12
from omnirl.testing.rewards import make_tiny_clap, make_tiny_dina_lrm, make_tiny_pickscore

TINY_MODELS = {
    "sd3": make_tiny_sd3,
    "qwen_image": make_tiny_qwen_image,
    "qwen_image_edit": make_tiny_qwen_image_edit,
    "wan22_ti2v": make_tiny_wan,
    "wan22_a14b": lambda out_dir: make_tiny_wan(out_dir, "a14b"),
    "ltx2": make_tiny_ltx2,
    "qwen3_omni": make_tiny_qwen3_omni,
    "qwen2_5_vl": make_tiny_qwen_vl,
    "qwen3_vl": lambda out_dir: make_tiny_qwen_vl(out_dir, "qwen3_vl"),
    "qwen3_omni_k12": make_tiny_qwen3_omni_k12,
    "pickscore": make_tiny_pickscore,
    "dina_lrm": make_tiny_dina_lrm,
    "clap": make_tiny_clap,
    "bagel": make_tiny_bagel,
    "flux": make_tiny_flux,
}
