"""Model adapters, by name. Each entry is an import path resolved only when asked for, so naming one
adapter never imports another family's dependencies."""

from __future__ import annotations

import importlib

from omnirl.config import ConfigError

ADAPTERS = {
    "sd3": "omnirl.models.sd3:SD3Adapter",
    "qwen_image": "omnirl.models.qwen_image:QwenImageAdapter",
    "qwen3_omni_thinker": "omnirl.models.qwen3_omni:Qwen3OmniThinkerAdapter",
    "qwen_vl": "omnirl.models.qwen_vl:QwenVLAdapter",
    "qwen_image_edit": "omnirl.models.qwen_image_edit:QwenImageEditAdapter",
    "wan": "omnirl.models.wan:WanAdapter",
}


def get_adapter(name: str) -> type:
    """The adapter class registered under `name` (see `ADAPTERS`)."""
    if name not in ADAPTERS:
        raise ConfigError(f"unknown adapter {name!r}; known: {', '.join(sorted(ADAPTERS))}")
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
