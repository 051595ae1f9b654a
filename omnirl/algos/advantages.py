"""Group-relative advantages (GRPO / Flow-GRPO), with the global-std variant and zero-spread filtering.

Our own code: the math is a few lines, and no library computes it over groups that live on one rank
with the statistics shared by an all-reduce.
"""

from __future__ import annotations

import math

import torch

from omnirl.distributed import all_reduce


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    adv_clip: float | None,
    global_std: bool,
    eps: float = 1e-4,
    std_normalise: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages of one RL step's samples on this rank, each relative to its group (its prompt).

    rewards: [N] float, group_ids: [N] long (any values; every member of a group is on this rank).
    Returns (advantages [N] in the dtype of `rewards`, keep [N] bool, metrics).

    Normalisation: A_i = clamp((r_i - mean_g) / (std + eps), -adv_clip, adv_clip) (not clamped when
    `adv_clip` is None: Flow-DPPO's references, UniRL and VeRL-Omni, clamp nothing), where mean_g is the
    mean of sample i's group and std is the population std (ddof 0) of that group, or, with
    `global_std`, of all rewards of the step over all ranks (count, sum and sum of squares are
    all-reduced). Statistics are computed in float64. With `std_normalise` False (Dr.GRPO) there is no
    division: A_i = clamp(r_i - mean_g, -adv_clip, adv_clip), since dividing by a group's std up-weights
    the prompts whose rewards barely differ (too easy or too hard); `global_std` must then be False.

    A group whose rewards are all equal (a single sample included) carries no learning signal: its
    samples get keep False and advantage exactly 0, and the trainer drops them. Its rewards still count
    in the global std and in the reward metrics.

    Metrics are global (all ranks) and identical on every rank, so every rank must call this once per
    step (it runs one small all-reduce, two with `global_std`; none without a process group):
    reward/mean, reward/std (population), adv/groups, adv/zero_std_groups, adv/kept_frac (fraction of
    samples kept), adv/clip_frac (fraction of kept samples whose advantage hit +-adv_clip).
    `rewards` must be on the device the process group communicates on (the rank's device).
    """
    assert rewards.dim() == 1 and group_ids.shape == rewards.shape, (rewards.shape, group_ids.shape)
    if adv_clip is not None and not adv_clip > 0:
        raise ValueError(f"algo.adv_clip must be > 0 or None (unclamped), got {adv_clip}")
    if global_std and not std_normalise:
        raise ValueError("algo.global_std needs algo.std_normalise: without it no std is taken")
    finite = torch.isfinite(rewards)
    if not finite.all():
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"non-finite rewards at sample indices {bad[:16]} of this rank's {len(rewards)}")

    r = rewards.detach().double()  # [N]
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # inv [N], counts [G]
    num_groups = counts.numel()
    group_mean = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / counts
    dev = r - group_mean[inv]  # [N]
    # Exact equality, not std < tol: a tolerance would silently drop groups of tiny but real spread.
    inf = torch.full((num_groups,), float("inf"), dtype=r.dtype, device=r.device)
    lo = inf.scatter_reduce(0, inv, r, "amin")
    hi = (-inf).scatter_reduce(0, inv, r, "amax")
    zero_spread = lo == hi  # [G]
    keep = ~zero_spread[inv]  # [N]

    if not std_normalise:
        denom = torch.ones_like(r)
    elif global_std:
        n, s, sq = all_reduce(torch.stack([r.new_tensor(len(r)), r.sum(), (r * r).sum()])).unbind()
        denom = ((sq / n - (s / n) ** 2).clamp_min(0)).sqrt() + eps  # scalar
    else:
        group_var = torch.zeros_like(group_mean).index_add_(0, inv, dev * dev) / counts
        denom = group_var.sqrt()[inv] + eps  # [N]
    adv = dev / denom
    bound = math.inf if adv_clip is None else adv_clip
    clipped = (adv.abs() > bound) & keep
    adv = torch.where(keep, adv.clamp(-bound, bound), 0.0)

    stats = torch.stack(
        [
            r.new_tensor(len(r)),
            r.sum(),
            (r * r).sum(),
            r.new_tensor(num_groups),
            zero_spread.sum().double(),
            keep.sum().double(),
            clipped.sum().double(),
        ]
    )
    n, s, sq, groups, zero_groups, kept, n_clipped = all_reduce(stats).tolist()
    mean = s / n if n else float("nan")  # no samples at all: a step whose every sample was non-finite
    metrics = {
        "reward/mean": mean,
        "reward/std": max(sq / n - mean * mean, 0.0) ** 0.5 if n else float("nan"),
        "adv/groups": groups,
        "adv/zero_std_groups": zero_groups,
        "adv/kept_frac": kept / n if n else 0.0,
        "adv/clip_frac": n_clipped / max(kept, 1.0),
    }
    return adv.to(rewards.dtype), keep, metrics
