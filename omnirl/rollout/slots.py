"""The native engine's decode state (`omnirl.rollout.generate.GenerationEngine`): one row per slot.

`SlotLayer` is one decoder layer's KV cache as a transformers cache layer whose decode step writes each
slot's token at the slot's own column; `Slots` holds those layers and every per-slot tensor, with views
of its first rows (`prefix`: what a step on fewer slots runs on) and the move of slots to other slots
(`move`: how busy slots reach the lowest ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One decoder layer's KV cache, one row per slot: `keys` / `values` are [S, H, C, D] buffers allocated
    once per `generate` call. A decode step writes each slot's new token at that slot's own column
    (`column` [S, 1, 1, 1], shared by all layers) and attends to the buffer's first `window` columns under
    a mask, so every shape is fixed from step to step (the step can be captured in a CUDA graph, one per
    window and slot count)."""

    keys: torch.Tensor  # never None here, unlike a DynamicLayer's before its first update
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.window = keys.shape[2]  # the columns a step attends to (set per step by the engine)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        index = self.column.expand(-1, key_states.shape[1], 1, key_states.shape[3])  # [S, H, 1, D]
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys[:, :, : self.window], self.values[:, :, : self.window]

    def get_seq_length(self) -> int:
        return self.window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window, 0


@dataclass
class Slots:
    """The device state of S slots; a free slot has `done` set. Every tensor keeps its storage for the whole
    call (steps update them in place), which is what a captured CUDA graph replays on."""

    cache: Cache  # of SlotLayer
    column: torch.Tensor  # [S, 1, 1, 1] long, the column the next token's KV goes to (= length, clamped)
    length: torch.Tensor  # [S] long, tokens in the slot's cache
    last: torch.Tensor  # [S] long, the token to feed next
    pos: torch.Tensor  # [S], the M-RoPE position of that token
    n_gen: torch.Tensor  # [S] long, tokens recorded so far
    done: torch.Tensor  # [S] bool
    max_new: torch.Tensor  # [S] long
    temperature: torch.Tensor  # [S] float32
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] long
    stops: torch.Tensor  # [S, T] long, stop / EOS ids, padded with -1
    noise: torch.Tensor  # [S, W] float32, the request's uniforms, one per token
    tokens: torch.Tensor  # [S, W + 1] long; column n_gen is scratch for finished rows
    logprobs: torch.Tensor  # [S, W + 1] float32

    ROWS = ("column", "length", "last", "pos", "n_gen", "done", "max_new", "temperature", "top_p", "top_k")
    ROWS += ("stops", "noise", "tokens", "logprobs")

    def prefix(self, rows: int) -> Slots:
        """The first `rows` slots: views of the same storage (a step on them updates these slots in place)."""
        layers: list[Any] = self.cache.layers
        column = self.column[:rows]
        cache = Cache(layers=[SlotLayer(la.keys[:rows], la.values[:rows], column) for la in layers])
        return Slots(cache, **{name: getattr(self, name)[:rows] for name in self.ROWS})

    def move(self, sources: list[int], targets: list[int], device: torch.device) -> None:
        """Each slot of `sources` copied into the slot of `targets` at its place (its KV rows in every
        layer and its state); the sources are then free (`done`)."""
        src, dst = (torch.tensor(x, device=device) for x in (sources, targets))
        layers: list[Any] = self.cache.layers
        tensors = [t for la in layers for t in (la.keys, la.values)]
        for t in [*tensors, *(getattr(self, name) for name in self.ROWS)]:
            t.index_copy_(0, dst, t.index_select(0, src))
        self.done.index_fill_(0, src, True)
