"""Model families, by name: `ADAPTERS` is the one registry. A family is its folder
`omnirl/models/<name>/` (adapter.py, tiny.py, public_config.py, README.md) plus its line here; the tiny
checkpoints (`tiny_models`) and the config-only full-size ones (`random_checkpoints`) are read off the
folders of the families registered. Each entry is an import path resolved only when asked for, so naming
one family never imports another family's dependencies."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, cast

from omnirl.errors import ConfigError
from omnirl.weights import check_weight_files

if TYPE_CHECKING:
    import torch

    from omnirl.config import Config

ADAPTERS = {
    "sd3": "omnirl.models.sd3.adapter:SD3Adapter",
    "qwen_image": "omnirl.models.qwen_image.adapter:QwenImageAdapter",
    "qwen3_omni_thinker": "omnirl.models.qwen3_omni_thinker.adapter:Qwen3OmniThinkerAdapter",
    "qwen_vl": "omnirl.models.qwen_vl.adapter:QwenVLAdapter",
    "qwen_image_edit": "omnirl.models.qwen_image_edit.adapter:QwenImageEditAdapter",
    "wan": "omnirl.models.wan.adapter:WanAdapter",
    "ltx2": "omnirl.models.ltx2.adapter:LTX2Adapter",
    "bagel": "omnirl.models.bagel.adapter:BagelAdapter",
    "flux": "omnirl.models.flux.adapter:FluxAdapter",
    "flux2_klein": "omnirl.models.flux2_klein.adapter:Flux2KleinAdapter",
}

# The modules of a family's folder beside its adapter: tiny.py names its tiny checkpoints in `TINY`,
# public_config.py its config-only full-size ones in `RANDOM` (each: name -> a function of the output
# folder; the family's name, or `<family>_<layout>` for another layout of it).
PARTS = ("adapter", "tiny", "public_config")


def family_part(family: str, part: str) -> ModuleType:
    """The module `part` (one of `PARTS`) of the folder of `family`."""
    return importlib.import_module(f"omnirl.models.{family}.{part}")


def tiny_models() -> dict[str, Callable]:
    """Every registered family's tiny checkpoints, by name: the `TINY` of each family's tiny.py."""
    return {name: make for family in ADAPTERS for name, make in family_part(family, "tiny").TINY.items()}


def random_checkpoints() -> dict[str, Callable]:
    """Every config-only checkpoint of the public configs, by name: the `RANDOM` of each family's
    public_config.py (the family's name, or `<family>_<layout>`)."""
    return {
        name: write
        for family in ADAPTERS
        for name, write in family_part(family, "public_config").RANDOM.items()
    }


def write_random_checkpoint(model: str, out: Path, qwen_bpe: str | Path | None = None) -> None:
    """The config-only checkpoint `model` (a name of `random_checkpoints`) in `out`, with the byte-level
    tokenizers of `omnirl.models.tokenizers`; `qwen_bpe`: the path of Qwen's `qwen.tiktoken`, for the real
    tokenizer of the Qwen-Image families (`qwen_bpe_tokenizer`)."""
    if qwen_bpe and model not in ("qwen_image", "qwen_image_edit"):
        raise ValueError(f"the Qwen BPE tokenizer is for the Qwen-Image families, not {model!r}")
    writers = random_checkpoints()
    if model not in writers:
        raise ValueError(f"--random-init has no configs for {model!r}")
    out.mkdir(parents=True, exist_ok=True)
    if qwen_bpe:
        writers[model](out, qwen_bpe=qwen_bpe)
    else:
        writers[model](out)


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
        # (BAGEL's official layout is no diffusers pipeline: it has no pipeline_cls)
        if adapter.kind == "diffusion" and getattr(adapter, "pipeline_cls", type).__name__ == pipeline:
            return adapter
    raise ConfigError(f"{model_path!r} holds a {pipeline}, which no diffusion adapter of omnirl trains")
