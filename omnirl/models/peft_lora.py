"""The reference policy of a LoRA run: the same module with its peft LoRA layers switched off. Diffusion
adapters (diffusers transformers, one or several experts) and omni adapters (transformers language models)
both inject peft layers, so one switch serves every family; and the LoRA config as every export writes
it."""

from __future__ import annotations

import contextlib
import copy
from typing import cast

from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Run `model` with every peft LoRA layer off (peft's `enable_adapters(False)`), restored on exit.

    Layers are switched one by one: adapters injected with `peft.inject_adapter_in_model` (the omni models)
    leave the transformers model without a PeftModel's `disable_adapters()`, and a module of experts
    has none either."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "lora_disabled on a model without LoRA layers"
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


@contextlib.contextmanager
def adapter_active(modules: list[nn.Module], name: str):
    """Run the peft LoRA layers inside `modules` with adapter `name` alone (a layer without it runs its
    base weight), restored on exit: a reward's own LoRA over the policy's blocks (omnirl.rewards.dina_lrm).

    Only the routing is switched (the layer's active adapters). peft's `set_adapter` would also flip
    `requires_grad` on every adapter's parameters, which the optimizer's and FSDP2's parameters share."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, LoraLayer)]
    before = [layer.active_adapters for layer in layers]
    for layer in layers:
        layer._active_adapter = [name] if name in layer.lora_A else []
    try:
        yield
    finally:
        for layer, active in zip(layers, before):
            layer._active_adapter = active


def sorted_sets(config):
    """A copy of a peft config with its set fields (target_modules, ...) as sorted lists. peft and diffusers
    write a set in its iteration order, which changes with the process's hash seed, so an exported LoRA's
    bytes would differ between identical runs."""
    out = copy.copy(config)
    for name, value in vars(out).items():
        if isinstance(value, set):
            setattr(out, name, sorted(value))
    return out


def peft_config(model: nn.Module) -> dict[str, LoraConfig]:
    """The LoRA configs peft set on `model` (inject_adapter_in_model / get_peft_model), by adapter name."""
    # torch types every module attribute as Tensor | Module; peft's is a plain dict.
    return cast("dict[str, LoraConfig]", model.peft_config)
