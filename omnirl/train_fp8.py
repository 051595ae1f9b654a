"""FP8 in the update of a LoRA run (train.precision fp8): the frozen base's GEMMs in float8 e4m3, row-wise.

While an update runs, every frozen `nn.Linear` that the FP8 rollout runs in FP8 (`omnirl.rollout.fp8
.fp8_layers`: the blocks' linear layers but the family's `fp8_keep_bf16` ones, the LoRA branches and widths
that are not multiples of 16) is replaced by a `Float8FrozenLinear`. Its forward is the rollout's FP8 GEMM
(activations quantised per row, the weight per output row, `torch._scaled_mm`), so an FP8 rollout and the
update compute one function; its backward computes only the activation gradient, grad_x = grad_y @ W, in
FP8 too: grad_y quantised per row and the weight's second layout, W^T quantised per row (one scale per
input feature). The base is frozen, so it has no weight gradient, and both layouts are quantised once per
run and kept. The LoRA's own A and B matrices and everything outside the replaced layers stay in the
model's precision, and so do the weight gradients of the LoRA.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from omnirl.rollout.fp8 import FP8, fp8_layers, fp8_linear, quantise_rows


class _Fp8FrozenMatmul(torch.autograd.Function):
    """y = x @ W.T with W frozen: forward and the activation gradient both as row-wise FP8 GEMMs."""

    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale, fast_accum: bool):  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx.save_for_backward(wt_q, wt_scale)
        ctx.fast_accum = fast_accum
        return fp8_linear(x, w_q, w_scale, None, fast_accum)  # the FP8 rollout's own GEMM

    @staticmethod
    def backward(ctx, grad_y):  # pyright: ignore[reportIncompatibleMethodOverride]
        wt_q, wt_scale = ctx.saved_tensors
        # grad_x = grad_y @ W = grad_y @ (W^T)^T: the same GEMM with the rows of W^T as the weight.
        grad_x = fp8_linear(grad_y, wt_q, wt_scale, None, ctx.fast_accum)
        return grad_x, None, None, None, None, None


class Float8FrozenLinear(nn.Module):
    """Stands in for one frozen `nn.Linear` during an update: its weight as float8 in both layouts (rows of
    W for the forward, rows of W^T for the activation gradient), each with its per-row scales; its bias as
    it is (frozen: no gradient)."""

    def __init__(self, linear: nn.Linear, fast_accum: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = fast_accum
        with torch.no_grad():
            w = linear.weight.detach()
            w_q, w_scale = quantise_rows(w)  # [N, K], [N, 1]
            wt_q, wt_scale = quantise_rows(w.t().contiguous())  # [K, N], [K, 1]
        self.register_buffer("w_q", w_q, persistent=False)
        self.register_buffer("w_scale", w_scale.reshape(1, -1), persistent=False)
        self.register_buffer("wt_q", wt_q, persistent=False)
        self.register_buffer("wt_scale", wt_scale.reshape(1, -1), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Fp8FrozenMatmul.apply(x, self.w_q, self.w_scale, self.wt_q, self.wt_scale, self.fast_accum)
        assert isinstance(y, torch.Tensor)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Fp8Update:
    """The frozen FP8 layers of a LoRA policy's blocks and their stand-ins (quantised once, here), swapped
    in by `swapped` while an update runs."""

    def __init__(self, blocks: list[nn.Module], keep_bf16: tuple[str, ...], fast_accum: bool = False):
        self.layers = [
            (parent, attr, linear)
            for parent, attr, linear in fp8_layers(blocks, keep_bf16)
            if not linear.weight.requires_grad
        ]
        self.stand_ins = [Float8FrozenLinear(linear, fast_accum) for _, _, linear in self.layers]
        assert all(s.w_q.dtype == FP8 for s in self.stand_ins)

    def modules(self) -> list[nn.Module]:
        """The stand-ins: their FP8 weights only the update reads (they sleep through the rollout)."""
        return list(self.stand_ins)

    @contextlib.contextmanager
    def swapped(self):
        for (parent, attr, _), stand_in in zip(self.layers, self.stand_ins):
            setattr(parent, attr, stand_in)
        try:
            yield
        finally:
            for parent, attr, linear in self.layers:
                setattr(parent, attr, linear)
