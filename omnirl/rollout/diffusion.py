"""DiffusionEngine: runs requests through an adapter's denoising loop in batches, returns Trajectories.

The engine calls the very module the optimizer updates (no weight copy); under FSDP2 the weights are
gathered once for the whole rollout phase (`distributed.gathered_weights`), so ranks may run different
numbers of batches. Each finished batch is handed to `on_batch` at once, so reward scoring (in the
reward pool's threads) overlaps the denoising of the next batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnirl.distributed import gathered_weights
from omnirl.models.base import DiffusionAdapter, Request, Trajectory


class DiffusionEngine:
    def __init__(self, adapter: DiffusionAdapter, max_num_seqs: int):
        if max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs must be >= 1, got {max_num_seqs}")
        self.adapter = adapter
        self.max_num_seqs = max_num_seqs

    def batches(self, requests: list[Request]) -> list[list[int]]:
        """Indices of requests per forward batch: equal compatibility keys only, at most max_num_seqs."""
        by_key: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            by_key.setdefault(self.adapter.compat_key(r), []).append(i)
        out = []
        for idx in by_key.values():
            out += [idx[i : i + self.max_num_seqs] for i in range(0, len(idx), self.max_num_seqs)]
        return out

    @torch.no_grad()
    def generate(
        self,
        requests: list[Request],
        on_batch: Callable[[list[Trajectory]], None] | None = None,
    ) -> list[Trajectory]:
        """Trajectories in the order of `requests`."""
        results: list[Trajectory | None] = [None] * len(requests)
        with gathered_weights(self.adapter.transformer):
            for idx in self.batches(requests):
                trajs = self.adapter.rollout([requests[i] for i in idx])
                for i, t in zip(idx, trajs):
                    results[i] = t
                if on_batch is not None:
                    on_batch(trajs)
        assert all(t is not None for t in results)
        return results
