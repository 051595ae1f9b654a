"""RL losses: LOSSES maps a name to "module:function"; each loss returns (loss, metrics).

Our own code: the clipped policy-gradient objectives of Flow-GRPO and its relatives are a few lines
each, and the normalisation by the global pair count (DESIGN.md section 4) is ours to get right.

Normalisation shared by every loss here: the trainer passes the GLOBAL (all-ranks) count of the
mini-batch's rows as `normaliser`, and rows of weight 0 pad short ranks so that every rank runs the
same number of micro-batches. The losses of all micro-batches on all ranks then sum to the mean over
the mini-batch, which is what FSDP's summed (not averaged) gradients need.

Metrics are detached floats and sums, never means, so the trainer can add them over micro-batches,
all-reduce them over ranks, and divide: e.g. clip fraction = sum("loss/clip_count") / sum("loss/count").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

LOSSES = {
    "flow_grpo": "omnirl.algos.losses:flow_grpo_loss",
}


def get_loss(name: str) -> Callable:
    """The loss function registered under `name` in LOSSES, imported on first use."""
    if name not in LOSSES:
        raise ValueError(f"unknown algo.loss {name!r}; known losses: {', '.join(sorted(LOSSES))}")
    module, attr = LOSSES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def flow_grpo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_range: float,
    normaliser: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO clipped policy loss over M rows, each one (sample, trained denoising step) pair.

    logprob: [M] the current policy's log-prob of the stored transition (the only input with gradient);
    old_logprob: [M] the behaviour policy's; advantages: [M] the sample's advantage; weights: [M] 1 for
    real rows, 0 for padding rows (padding rows must hold finite values: 0 * inf is NaN);
    kl: [M] optional per-row KL to the reference policy (see `flow_kl`), with gradient.

    r_i = exp(logprob_i - old_logprob_i), policy_i = max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)),
    loss = (sum_i w_i policy_i + kl_beta * sum_i w_i kl_i) / normaliser,
    with `normaliser` the global number of real pairs of the mini-batch (see the module docstring).

    Metrics (sums over real rows; divide by the summed "loss/count"): loss/policy_sum, loss/ratio_sum,
    loss/clip_count (rows with |r - 1| > eps), loss/approx_kl_sum (0.5 (logprob - old_logprob)^2, the
    drift from the behaviour policy), loss/kl_sum (only when `kl` is given), loss/count (sum of weights).
    """
    assert logprob.dim() == 1 and old_logprob.shape == advantages.shape == weights.shape == logprob.shape
    assert normaliser > 0, normaliser
    assert kl is not None or kl_beta == 0, "kl_beta > 0 needs the kl term"
    w = weights.detach().to(logprob.dtype)
    adv = advantages.detach().to(logprob.dtype)
    log_ratio = logprob - old_logprob.detach()
    ratio = torch.exp(log_ratio)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))  # [M]
    policy_sum = (w * policy).sum()
    loss = policy_sum
    sums = {
        "loss/policy_sum": policy_sum,
        "loss/ratio_sum": (w * ratio).sum(),
        "loss/clip_count": (w * ((ratio - 1).abs() > clip_range)).sum(),
        "loss/approx_kl_sum": (w * 0.5 * log_ratio**2).sum(),
        "loss/count": w.sum(),
    }
    if kl is not None:
        kl_sum = (w * kl).sum()
        loss = loss + kl_beta * kl_sum
        sums["loss/kl_sum"] = kl_sum
    # One device->host copy for all metrics instead of one sync per .item().
    values = torch.stack(list(sums.values())).detach().float().tolist()
    return loss / normaliser, dict(zip(sums, values))


def flow_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL per row between the step Gaussians of the policy and the reference: [M].

    mean, mean_ref: [M, *latent] the means of the two Gaussians of one denoising step, std: [M] their
    shared standard deviation (`StepOut.std`). KL(N(m, s^2) || N(m_ref, s^2)) per dim is
    (m - m_ref)^2 / (2 s^2); we average it over the latent dims, as the log-prob is averaged.
    Rows with std 0 (deterministic ODE steps) get 0. The gradient flows through `mean` only.
    """
    sq = ((mean.float() - mean_ref.detach().float()) ** 2).flatten(1).mean(dim=1)  # [M]
    std = std.float()
    nonzero = std > 0
    return torch.where(nonzero, sq / (2 * torch.where(nonzero, std, 1.0) ** 2), 0.0)
