"""Model adapters, by name. Each entry is an import path resolved only when asked for, so naming one
adapter never imports another family's dependencies."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from omnirl.config import ConfigError
from omnirl.weights import check_weight_files

if TYPE_CHECKING:
    import torch

    from omnirl.config import Config

ADAPTERS = {
    "sd3": "omnirl.models.sd3:SD3Adapter",
    "qwen_image": "omnirl.models.qwen_image:QwenImageAdapter",
    "qwen3_omni_thinker": "omnirl.models.qwen3_omni:Qwen3OmniThinkerAdapter",
    "qwen_vl": "omnirl.models.qwen_vl:QwenVLAdapter",
    "qwen_image_edit": "omnirl.models.qwen_image_edit:QwenImageEditAdapter",
    "wan": "omnirl.models.wan:WanAdapter",
    "ltx2": "omnirl.models.ltx2:LTX2Adapter",
    "bagel": "omnirl.models.bagel:BagelAdapter",
    "flux": "omnirl.models.flux.adapter:FluxAdapter",
    "flux2_klein": "omnirl.models.flux.klein:Flux2KleinAdapter",
}


def build_adapter(cfg: Config, device: torch.device):
    """The adapter of cfg.model.adapter on `device`, its models loaded as model.weights says: read from
    model.path, or built from the configs there with random weights (`random_init.random_weights`)."""
    adapter_cls = get_adapter(cfg.model.adapter)
    if cfg.model.weights == "pretrained":
        check_weight_files(cfg.model.path)  # a damaged file is named before any component loads
        return adapter_cls(cfg, device)
    from omnirl.models.random_init import random_weights

    with random_weights(cfg, device):
        return adapter_cls(cfg, device)


def get_adapter(name: str) -> type:
    """The adapter class registered under `name` (see `ADAPTERS`)."""
    if name not in ADAPTERS:
        raise ConfigError(f"unknown adapter {name!r}; known: {', '.join(sorted(ADAPTERS))}")
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def diffusion_adapter_for(model_path: str) -> type:
    """The diffusion adapter whose pipeline the diffusers checkpoint at `model_path` holds (its
    model_index.json's class); a ConfigError when there is none."""
    from diffusers import DiffusionPipeline

    try:
        index = cast(dict, DiffusionPipeline.load_config(model_path))  # (typed as maybe a tuple)
        pipeline = index.get("_class_name")
    except OSError as e:
        raise ConfigError(
            f"{model_path!r} is neither a local diffusers checkpoint (a directory with model_index.json) nor "
            f"a loadable hub id: {e}"
        ) from None
    for name in ADAPTERS:
        adapter = get_adapter(name)
        if adapter.kind == "diffusion" and adapter.pipeline_cls.__name__ == pipeline:
            return adapter
    raise ConfigError(f"{model_path!r} holds a {pipeline}, which no diffusion adapter of omnirl trains")
