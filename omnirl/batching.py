"""How a step's work is cut, the same way for every kind of model.

- `make_requests`: this rank's requests of a step, seeds from (seed, step, global request index).
- `global_positions`: the update's shuffle of every rank's rows, the same on any number of ranks;
  `shuffled_rows`: this rank's rows of the kept samples, in that shuffle's order.
- `split_mini_batches`: the mini-batches of that shuffle.
- `equalise`: as many micro-batches on every rank, short ranks padding with zero-weight rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnirl import distributed as D
from omnirl.config import Config
from omnirl.data.edit import open_inputs
from omnirl.data.prompts import PromptRow, step_prompt_indices
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.models.base import P, Request


def make_requests(
    cfg: Config,
    rows: list[PromptRow],
    step: int,
    dist: D.DistInfo,
    params: P,
    negative_prompt: str = "",
) -> tuple[list[Request[P]], list[PromptRow]]:
    """This rank's requests of a step: a contiguous share of the step's prompts, `group_size` each.

    The global request index (and so the seed) depends only on the step and the prompt's position in
    the step, never on the rank: a run on another number of ranks draws the same samples.
    """
    per_step, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if per_step % dist.world_size:
        raise ConfigError(
            f"rollout.prompts_per_step ({per_step}) must divide by the number of ranks ({dist.world_size})"
        )
    share = per_step // dist.world_size
    indices = step_prompt_indices(len(rows), step, per_step, cfg.run.seed)
    requests: list[Request[P]] = []
    req_rows: list[PromptRow] = []
    for pos in range(dist.rank * share, (dist.rank + 1) * share):
        row = rows[indices[pos]]
        inputs = open_inputs(row.inputs)  # read once per step: the group's requests share its images
        for j in range(group):
            index = pos * group + j
            requests.append(
                Request(
                    prompt=row.prompt,
                    group_id=pos,
                    index=index,
                    seed=derive_seed(cfg.run.seed, step, index),
                    params=params,
                    negative_prompt=negative_prompt,
                    # Negative indices are no request's: the group's seed is its own, never a sample's.
                    group_seed=derive_seed(cfg.run.seed, step, -1 - pos),
                    metadata=row.metadata,
                    inputs=inputs,
                )
            )
            req_rows.append(row)
    return requests, req_rows


def equalise(micro_batches: list[list], pad_row: Any) -> list[list]:
    """Every rank runs the same (all-reduced max) number of micro-batches, short ranks padding with
    one-row micro-batches of `pad_row` (weight 0), so FSDP collectives line up and no rank's gradient is
    biased."""
    n = torch.tensor([len(micro_batches)])
    D.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    return micro_batches + [[pad_row] for _ in range(int(n) - len(micro_batches))]


def split_mini_batches(rows: list, count: int) -> list[list]:
    """Mini-batch m holds the rows whose place in the step's shuffle (`position`) is in [m / count,
    (m + 1) / count), on every rank: so the mini-batches hold the same rows on any number of ranks."""
    out: list[list] = [[] for _ in range(count)]
    for r in rows:
        out[int(r.position * count)].append(r)
    return out


def global_positions(gen: torch.Generator, total: int) -> list[float]:
    """The update's shuffle: for each of the step's `total` rows over all ranks (numbered by global request
    index, and trained step), its place in a random permutation drawn from `gen`, as a fraction in [0, 1).
    `gen` is seeded from (seed, step) alone, so every rank, on any number of ranks, draws the same places:
    a row's mini-batch does not depend on the rank it is on."""
    perm = torch.randperm(total, generator=gen)
    where = torch.empty(total, dtype=torch.float64)
    where[perm] = torch.arange(total, dtype=torch.float64) / total
    return where.tolist()


def shuffled_rows(
    trajs: list, keep: torch.Tensor, gen: torch.Generator, samples: int, per_sample: int, make: Callable
) -> list:
    """This rank's training rows of the kept samples (`keep`: [len(trajs)] bool), `per_sample` rows each
    (a diffusion sample's trained steps, 1 for a response), made as `make(traj, k, position)`: each at its
    `position` in the shuffle of the step's `samples` x `per_sample` rows over all ranks (`global_positions`,
    numbered by global request index, then k), sorted by it."""
    where = global_positions(gen, samples * per_sample)
    rows = [
        make(t, k, where[t.request.index * per_sample + k])
        for t, kept in zip(trajs, keep.tolist())
        if kept
        for k in range(per_sample)
    ]
    return sorted(rows, key=lambda row: row.position)
