"""The native decode step's MoE experts with their top-k ids as uint8 (GenerationEngine's
`narrow_expert_ids`). transformers' grouped_mm experts implementation sorts the ids once per layer and
step to dispatch the rows, a radix sort over every bit of the ids' dtype: uint8 ids sort in 2 passes where
int64 ids take 16. The forwards are swapped in for the decode step only (`compiled.swapped`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class _NarrowIdsForward:
    """An experts module's own forward, given its top-k ids as uint8. One object per module for its life
    (a compiled caller's guards hold it)."""

    def __init__(self, module: nn.Module):
        self.forward = type(module).forward.__get__(module)

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.forward(hidden, top_k_index.to(torch.uint8), top_k_weights)


def _narrowable(m: nn.Module) -> bool:
    """A transformers MoE experts module running its grouped_mm implementation with at most 256 experts,
    no biases (whose rows the ids index) and no expert parallelism: its ids may be uint8."""
    return (
        getattr(getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"
        and getattr(m, "num_experts", 257) <= 256
        and getattr(m, "has_bias", True) is False
        and getattr(m, "_is_expert_parallel", True) is False
    )


def narrowed_expert_forwards(layers: Iterable[nn.Module]) -> list[tuple[nn.Module, _NarrowIdsForward]]:
    """(experts module, its forward on uint8 ids) for every narrowable experts module of `layers`."""
    return [
        (m, m.__dict__.setdefault("_narrow_ids_forward", _NarrowIdsForward(m)))
        for layer in layers
        for m in layer.modules()
        if _narrowable(m)
    ]
