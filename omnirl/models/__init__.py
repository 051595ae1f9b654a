"""Model adapters, by name. Each entry is an import path resolved only when asked for, so naming one
adapter never imports another family's dependencies."""

from __future__ import annotations

import importlib

ADAPTERS = {
    "sd3": "omnirl.models.sd3:SD3Adapter",
}


def get_adapter(name: str) -> type:
    """The adapter class registered under `name` (see `ADAPTERS`)."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown adapter {name!r}; known: {', '.join(sorted(ADAPTERS))}")
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
