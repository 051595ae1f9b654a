"""FP8 rollout (rollout.precision fp8): the transformer blocks' linear layers in float8 while it runs.

`Fp8Rollout` replaces, while the rollout runs, every `nn.Linear` inside the transformer's repeated blocks
(`fp8_layers`: all but the family's `fp8_keep_bf16` and widths not a multiple of 16) by a
`Float8Linear` (float8 e4m3 weight, one scale per output row; activations quantised per row; torch's
`_scaled_mm`), and puts the originals back after, so the trainer never sees FP8. `use` switches a step
between the two. Not torchao's float8 config: it refuses devices without CUDA FP8 and converts weights in
place.

How it works: docs/fp8_rollout.md#what-runs-in-fp8
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row (a padding row) quantises to zeros instead of dividing by zero.
MIN_AMAX = 1e-12


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8 e4m3, scale [M, 1] float32) with x ~= q * scale: each row scaled so
    that its largest magnitude maps to the format's largest value (448), then rounded to nearest."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)  # [M, 1]
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values q * scale of `quantise_rows`' output."""
    return q.float() * scale


def fp8_linear(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """x [..., K] @ W.T + b with W [N, K] given as float8 rows `weight_q` and their scales `weight_scale`
    [1, N]; x quantised per row here. The result in x's dtype, [..., N]. `fast_accum`: the GEMM keeps its
    sums in the tensor cores' own accumulator instead of promoting them to float32 at intervals (cuBLASLt's
    fast-accumulation mode on Hopper: faster, less exact over long rows; no effect on the CPU's emulation)."""
    shape = x.shape
    q, scale = quantise_rows(x.reshape(-1, shape[-1]))  # [M, K], [M, 1]
    # mat2 column-major ([N, K] row-major, transposed), as the FP8 GEMM requires.
    y = torch._scaled_mm(
        q,
        weight_q.t(),
        scale_a=scale,
        scale_b=weight_scale,
        bias=None if bias is None else bias.to(x.dtype),
        out_dtype=x.dtype,
        use_fast_accum=fast_accum,
    )
    return y.reshape(*shape[:-1], weight_q.shape[0])


class Float8Linear(nn.Module):
    """Stands in for one `nn.Linear` during an FP8 rollout: its weight as float8 rows with per-row scales
    (buffers, quantised by `load`), its bias as it is."""

    def __init__(self, linear: nn.Linear, fast_accum: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = fast_accum
        self.register_buffer("weight_q", None, persistent=False)  # [N, K] float8 e4m3
        self.register_buffer("weight_scale", None, persistent=False)  # [1, N] float32
        self.register_buffer("bias", None, persistent=False)  # [N], the layer's own bias tensor
        self.loaded = False

    @torch.no_grad()
    def load(self, linear: nn.Linear) -> None:
        """Quantise `linear`'s current weight (the gathered one under FSDP) and take its bias."""
        q, scale = quantise_rows(linear.weight.detach())
        self.weight_q, self.weight_scale = q, scale.reshape(1, -1)
        # A copy: under FSDP2 the gathered bias's storage is freed when the weights are resharded.
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.loaded = True

    def unload(self) -> None:
        self.weight_q = self.weight_scale = self.bias = None
        self.loaded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight_q is not None and self.weight_scale is not None  # run only while loaded
        return fp8_linear(x, self.weight_q, self.weight_scale, self.bias, self.fast_accum)


def fp8_layers(blocks: list[nn.Module], keep_bf16: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of every linear layer an FP8 rollout runs in FP8: each `nn.Linear`
    inside `blocks` except those whose name within its block is in `keep_bf16` (a peft LoRA layer's
    `base_layer` goes by the name of the layer it wraps), a LoRA's own A and B matrices, and those whose
    widths are not multiples of 16."""
    from peft.tuners.lora import LoraLayer

    lora_branches = {
        id(m)
        for block in blocks
        for layer in block.modules()
        if isinstance(layer, LoraLayer)
        for attr in LoraLayer.adapter_layer_names
        for m in getattr(layer, attr).modules()
    }
    out = []
    for block in blocks:
        for parent_name, parent in block.named_modules():
            for attr, child in parent.named_children():
                name = f"{parent_name}.{attr}" if parent_name else attr
                if (
                    isinstance(child, nn.Linear)
                    and id(child) not in lora_branches
                    and name.removesuffix(".base_layer") not in keep_bf16
                    and child.in_features % 16 == 0
                    and child.out_features % 16 == 0
                ):
                    out.append((parent, attr, child))
    return out


class Fp8Rollout:
    """The FP8 layers of a policy's blocks and their FP8 stand-ins, swapped in by `swapped`."""

    def __init__(self, blocks: list[nn.Module], keep_bf16: tuple[str, ...], fast_accum: bool = False):
        self.layers = fp8_layers(blocks, keep_bf16)
        self.stand_ins = [Float8Linear(linear, fast_accum) for _, _, linear in self.layers]
        self.active = False  # the stand-ins are in place

    def modules(self) -> list[nn.Module]:
        """The stand-ins: what only the rollout needs (their FP8 weights sleep during training)."""
        return list(self.stand_ins)

    def use(self, fp8: bool) -> None:
        """Put the stand-ins (`fp8`) or the original layers in place; inside `swapped` only, where the
        stand-ins hold their FP8 weights. Switching costs a few hundred attribute writes, no copy: an
        FP8 rollout of untrained steps only (rollout.fp8.steps untrained) switches at every step."""
        if fp8 == self.active:
            return
        for (parent, attr, linear), stand_in in zip(self.layers, self.stand_ins):
            setattr(parent, attr, stand_in if fp8 else linear)
        self.active = fp8

    @contextlib.contextmanager
    def swapped(self):
        """Quantise what needs it (a trainable weight every time, a frozen one the first time) and run with
        the stand-ins in place of the layers (`use` switches between them meanwhile); the layers are put
        back on exit. The quantisation happens here, once per rollout phase, never per step or call."""
        for (_, _, linear), stand_in in zip(self.layers, self.stand_ins):
            if linear.weight.requires_grad or not stand_in.loaded:
                stand_in.load(linear)
        self.use(True)
        try:
            yield
        finally:
            self.use(False)
            for (_, _, linear), stand_in in zip(self.layers, self.stand_ins):
                if linear.weight.requires_grad:  # quantised again next time: not held through training
                    stand_in.unload()
