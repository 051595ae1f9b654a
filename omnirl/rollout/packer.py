"""RequestPacker: groups rollout requests into the largest compatible batches of one transformer forward.

`RequestPacker.pack` groups requests by their compatibility key (`adapter.compat_key`) over the whole
queue, so an incompatible request never blocks later ones, and cuts each key's requests into batches of
at most `max_num_seqs` requests and `max_num_batched_tokens` padded tokens: balanced by default, filled
with `fill=True` (a rollout padded to bucket sizes), deterministic. Our own code: no library packs
diffusion requests.

How it works: docs/rollout.md#packed-diffusion-rollout
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any


class RequestPacker:
    """Packs a queue of requests into batches; `pack` returns indices into the queue per batch."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        key_fn: Callable[[Any], Hashable],
        tokens_fn: Callable[[Any], int],
    ):
        if max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 0:
            raise ValueError(
                f"rollout.max_num_batched_tokens must be >= 0 (0 = no budget), got {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.key_fn = key_fn
        self.tokens_fn = tokens_fn

    def capacity(self, tokens: int) -> int:
        """The most requests of `tokens` tokens each (CFG rows included) that one batch may hold."""
        if not self.max_num_batched_tokens:
            return self.max_num_seqs
        return min(self.max_num_seqs, self.max_num_batched_tokens // tokens)

    def pack(self, requests: Sequence[Any], fill: bool = False) -> list[list[int]]:
        """Batches of indices into `requests`: every index exactly once, one key per batch, budgets held.

        `fill`: fill each batch to its capacity before starting the next instead of balancing them
        (for batches that are padded to bucket sizes anyway)."""
        tokens = [self.tokens_fn(r) for r in requests]
        for i, t in enumerate(tokens):
            if self.max_num_batched_tokens and t > self.max_num_batched_tokens:
                raise ValueError(
                    f"request {i} needs {t} tokens in one forward (CFG rows included), more than "
                    f"rollout.max_num_batched_tokens={self.max_num_batched_tokens}: raise the budget"
                )
        groups: dict[Hashable, list[int]] = {}  # insertion order = order of first appearance
        for i, r in enumerate(requests):
            groups.setdefault(self.key_fn(r), []).append(i)
        batches: list[list[int]] = []
        for idx in groups.values():
            idx = sorted(idx, key=lambda i: (tokens[i], i))
            batches += self._split(idx, tokens, fill)
        return batches

    def _split(self, idx: list[int], tokens: list[int], fill: bool) -> list[list[int]]:
        """Split one key's requests, sorted by tokens, into contiguous batches that fit the budgets."""

        def fits(batch: list[int]) -> bool:
            return len(batch) <= self.capacity(tokens[batch[-1]])  # the last one is the longest

        # Greedy filling of a sorted list gives the fewest contiguous batches.
        greedy: list[list[int]] = []
        for i in idx:
            if greedy and fits(greedy[-1] + [i]):
                greedy[-1].append(i)
            else:
                greedy.append([i])
        if fill:
            return greedy
        # As many batches of even sizes (the first ones, holding the shorter requests, one larger). With
        # equal lengths this always fits; with mixed ones it may not, and balance never costs a forward.
        k = len(greedy)
        size, extra = divmod(len(idx), k)
        bounds = [j * size + min(j, extra) for j in range(k + 1)]
        even = [idx[bounds[j] : bounds[j + 1]] for j in range(k)]
        return even if all(fits(b) for b in even) else greedy
