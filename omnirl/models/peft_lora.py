"""The reference policy of a LoRA run: the same module with its peft LoRA layers switched off. Diffusion
adapters (diffusers transformers, one or several experts) and omni adapters (transformers language models)
both inject peft layers, so one switch serves every family; the LoRA merged into copies of the weights it
adapts, for a rollout (`lora_merged`) and for a vLLM push; and the LoRA config as every export writes
it."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.tensor import DTensor


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly FSDP2-sharded) parameter, detached (collective for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def mergeable(layer: nn.Module) -> bool:
    """Whether `layer` is a peft LoRA linear layer whose output is exactly base(x) + sum scale B A x over
    its active adapters, so one GEMM on W + sum scale B A computes it: plain LoRA (no DoRA or other
    variant, no LoRA bias), dropout off (p 0 or eval mode), on, not merged already."""
    if not isinstance(layer, LoraLinear) or layer.disable_adapters or layer.merged:
        return False
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    return bool(active) and all(
        a not in layer.lora_variant
        and not layer.lora_bias.get(a, False)
        and (not layer.training or not isinstance(drop := layer.lora_dropout[a], nn.Dropout) or drop.p == 0)
        for a in active
    )


def merged_weight(layer: Any) -> torch.Tensor:
    """W + sum over the active adapters of scale B A of a peft LoRA linear layer, summed in float32 and
    rounded once to W's dtype, in a new tensor where W is (a sharded parameter's full tensor: collective
    for a DTensor)."""
    base = layer.get_base_layer()
    w = _full(base.weight).to(torch.float32, copy=True)
    for a in layer.active_adapters:
        if a in layer.lora_A:
            delta = _full(layer.lora_B[a].weight).float() @ _full(layer.lora_A[a].weight).float()
            w += layer.scaling[a] * (delta.T if layer.fan_in_fan_out else delta)
    return w.to(base.weight.dtype)


class _MergedForward:
    """A LoRA linear's forward on its merged weight. One object per layer for the layer's life, its tensors
    replaced per rollout: a compiled caller's guards hold the object, so a new one would recompile."""

    def __init__(self):
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert self.weight is not None  # set by lora_merged
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def lora_merged(model: nn.Module):
    """Run every mergeable peft LoRA linear layer of `model` (`mergeable`) as one GEMM on a merged copy of
    its weight (`merged_weight`), as a serving engine runs a LoRA, instead of peft's base GEMM plus the
    adapter's two GEMMs, scaling and add; restored on exit. The trainer's parameters are not written: the
    copies (the adapted weights' bytes once more) live until the exit. Take it after the weights are
    where the forwards read them (inside `fsdp.gathered_weights`): the copies are of the weights then.
    Yields the bytes of the copies."""
    layers: list[Any] = [m for m in model.modules() if mergeable(m)]  # peft LoRA linears, read by name
    total = 0
    for layer in layers:
        forward = layer.__dict__.setdefault("_merged_forward", _MergedForward())
        bias = layer.get_base_layer().bias
        forward.weight, forward.bias = merged_weight(layer), None if bias is None else _full(bias)
        total += forward.weight.numel() * forward.weight.element_size()
        # An instance attribute shadows the class's forward until deleted (as omnirl.rollout.compiled).
        layer.forward = forward
    try:
        yield total
    finally:
        for layer in layers:
            del layer.forward
            layer._merged_forward.weight = layer._merged_forward.bias = None


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
