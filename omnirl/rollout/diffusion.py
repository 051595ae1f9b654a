"""DiffusionEngine: packs requests into compatible batches and runs each as one denoising loop.

The `RequestPacker` groups requests by the adapter's compatibility key under `max_num_seqs` and
`max_num_batched_tokens`; the adapter's `rollout` runs a batch as one transformer forward per denoising
step (CFG rows included, unless `fused_cfg` is off) with one generator per request, so the packed
result equals the serial one to fp32 rounding. Each finished batch is handed to `on_batch` at once, so
reward scoring (in the reward pool's threads) overlaps the denoising of the next batch.

The engine calls the very module the optimizer updates (no weight copy); under FSDP2 the weights are
gathered once for the whole rollout phase (`distributed.gathered_weights`), so ranks may run different
numbers of batches.

`compile` compiles the transformer's repeated blocks (`adapter.fsdp_units()`) for the rollout only:
each block's `forward` is swapped for its compiled version while `generate` runs and restored after, so
the trainer's forward/backward stays eager. We do not call diffusers' `compile_repeated_blocks`: it
compiles for good (training included, FSDP2's hooks traced inside), finds blocks by class name, which
`fully_shard` renames (FSDPQwenImageTransformerBlock), and SD3 defines no `_repeated_blocks`. Shapes are
static (`dynamic=False`, the batch dim included), so each new batch size would compile again: batches
are filled (not balanced) and padded up to a few bucket sizes (`bucket_size`) with dummy requests whose
outputs are dropped. A dummy row draws its noise from its own generator, never from a real request's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from omnirl.distributed import gathered_weights
from omnirl.models.base import DiffusionAdapter, Request, Trajectory
from omnirl.rollout.packer import RequestPacker

# The torch.compile backend of `compile`. Tests use "eager": dynamo decides (re)compiles from its
# guards before any backend runs, and inductor's CPU code generation is slow (benchmarks/RESULTS.md).
COMPILE_BACKEND = "inductor"
# Compiled entries all sit on the one `forward` code object of a block class: one per (block variant,
# batch bucket, latent / text shape). SD3.5 has three variants (dual attention, plain, last block
# without context output) and max_num_seqs 256 nineteen batch buckets (`bucket_size`); dynamo's default
# limit of 8 would drop to eager silently after the eighth.
RECOMPILE_LIMIT = 128


def bucket_size(n: int, capacity: int) -> int:
    """The bucket a batch of `n` requests is padded to, at most `capacity`: the next power of two up to 8,
    then the next multiple of 8, 16, 32, ... (an eighth of the power of two below n, at least 8), so a
    batch is padded by at most ~1/8 (a power of two pads 33 to 64, i.e. wastes nearly half) and the
    number of shapes to compile grows only logarithmically: 1, 2, 4, 8, 16, 24, ..., 64, 80, ..., 128."""
    if n <= 8:
        size = 1 << (n - 1).bit_length()
    else:
        step = max(8, 1 << (n.bit_length() - 4))
        size = -(-n // step) * step
    return min(size, capacity)


class DiffusionEngine:
    def __init__(
        self,
        adapter: DiffusionAdapter,
        max_num_seqs: int,
        max_num_batched_tokens: int = 0,
        fused_cfg: bool = True,
        compile: bool = False,
    ):
        self.adapter = adapter
        self.fused_cfg = fused_cfg
        self.packer = RequestPacker(max_num_seqs, max_num_batched_tokens, adapter.compat_key, self.tokens)
        # Padding to bucket sizes is what keeps a compiled rollout from recompiling; eager needs none.
        self.pad = compile
        self.compiled: list[tuple[torch.nn.Module, Callable]] = []
        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = [
                (block, torch.compile(block.forward, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND))
                for block in adapter.fsdp_units()
            ]

    def tokens(self, request: Request) -> int:
        """Transformer tokens of a request in one forward: its CFG row counts too when fused."""
        rows = 2 if self.fused_cfg and request.params.guidance_scale > 1 else 1
        return rows * self.adapter.num_tokens(request)

    def padding(self, batch: list[Request]) -> list[Request]:
        """Dummy requests that pad `batch` to its bucket size (none unless `pad`)."""
        if not self.pad:
            return []
        capacity = self.packer.capacity(max(self.tokens(r) for r in batch))  # the bucket stays in budget
        # Copies of the shortest request (the packer sorts by tokens), so shapes and keys match; index -1
        # marks them. The adapter builds a generator per row, so a dummy draws from its own generator
        # object (seeded like batch[0]'s) and no real request's noise moves.
        dummy = dataclasses.replace(batch[0], index=-1, group_id=-1, metadata={})
        return [dummy] * (bucket_size(len(batch), capacity) - len(batch))

    @torch.no_grad()
    def generate(
        self,
        requests: list[Request],
        on_batch: Callable[[list[Trajectory]], None] | None = None,
    ) -> list[Trajectory]:
        """Trajectories in the order of `requests`; `on_batch` gets each finished batch's (real) ones."""
        results: list[Trajectory | None] = [None] * len(requests)
        self.adapter.fused_cfg = self.fused_cfg
        for block, fn in self.compiled:
            block.forward = fn  # an instance attribute shadows the class's forward until deleted below
        try:
            with gathered_weights(self.adapter.policy):
                for idx in self.packer.pack(requests, fill=self.pad):
                    batch = [requests[i] for i in idx]
                    trajs = self.adapter.rollout(batch + self.padding(batch))[: len(batch)]
                    for i, t in zip(idx, trajs):
                        results[i] = t
                    if on_batch is not None:
                        on_batch(trajs)
        finally:
            for block, _ in self.compiled:
                del block.forward
        assert all(t is not None for t in results)
        return results
