"""The input records of the losses (omnirl.algos.losses): one frozen record per kind of training row,
holding every tensor a loss of those rows may read, and `host_metrics`, the metric sums every loss returns
as floats."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowInputs:
    """The input record of the losses over M rows that are each one (sample, trained denoising step) pair
    (flow_grpo, flow_dppo). Padding rows must hold finite values: 0 * inf is NaN."""

    logprob: torch.Tensor  # [M] the current policy's log-prob of the stored transition (the only gradient)
    old_logprob: torch.Tensor  # [M] the behaviour policy's
    advantages: torch.Tensor  # [M] the sample's advantage
    weights: torch.Tensor  # [M] 1 for real rows, 0 for padding rows
    kl: torch.Tensor | None = None  # [M] per-row KL to the reference policy (`flow_kl`), with gradient
    is_weight: torch.Tensor | None = None  # [M] rollout-correction weights c_i (omnirl.algos.correction)
    divergence: torch.Tensor | None = None  # [M] the exact KL to the behaviour policy (LossSpec.divergence)
    std: torch.Tensor | None = None  # [M] the step's standard deviation (grpo_guard's ratio scale)
    dt: torch.Tensor | None = None  # [M] the step's |sigma_next - sigma| (grpo_guard's re-weighting)


@dataclass(frozen=True)
class NFTInputs:
    """The input record of diffusion_nft over M rows that are each (clean sample x0, time t, noise eps)."""

    velocity: torch.Tensor  # [M, *latent] v_theta(x_t, t) at the forward-noised x_t (the only gradient)
    old_velocity: torch.Tensor  # [M, *latent] the old (rollout) policy's at the same x_t
    target: torch.Tensor  # [M, *latent] the flow-matching velocity eps - x0
    t: torch.Tensor  # [M] in (0, 1]
    advantages: torch.Tensor  # [M], already clamped to +-algo.adv_clip (advantages.group_advantages)
    weights: torch.Tensor  # [M] 1 for real rows, 0 for padding
    ref_velocity: torch.Tensor | None = None  # [M, *latent] the reference policy's, for the KL term


@dataclass(frozen=True)
class DGPOInputs:
    """The input record of dgpo over M rows that are each (clean sample x0, time t, noise eps)."""

    velocity: torch.Tensor  # [M, *latent] v_theta(x_t, t) at the forward-noised x_t (the only gradient)
    target: torch.Tensor  # [M, *latent] the flow-matching velocity eps - x0
    advantages: torch.Tensor  # [M], already clamped to +-algo.adv_clip (advantages.group_advantages)
    group_weight: torch.Tensor  # [M] its (group, time)'s weight: sigmoid of the summed `dgpo_margin`s
    weights: torch.Tensor  # [M] 1 for real rows, 0 for padding
    ref_velocity: torch.Tensor | None = None  # [M, *latent] the reference policy's, for the KL term
    ema_velocity: torch.Tensor | None = None  # [M, *latent] the EMA copy's, for algo.dgpo.trust_region


@dataclass(frozen=True)
class TokenInputs:
    """The input record of the token losses (grpo, gspo) over B responses of up to T tokens. Padding
    positions and rows must hold finite values."""

    logprob: torch.Tensor  # [B, T] the current policy's log-prob of each response token (the only gradient)
    old_logprob: torch.Tensor  # [B, T] the behaviour policy's
    advantages: torch.Tensor  # [B] one per response
    mask: torch.Tensor  # [B, T] 1 (True) on real response tokens, 0 on padding
    weights: torch.Tensor  # [B] 1 for real rows, 0 for the padding rows of short ranks
    max_length: int = 0  # the generation limit: dr_grpo's constant divisor
    ref_logprob: torch.Tensor | None = None  # [B, T] the reference policy's, for the KL term
    is_weight: torch.Tensor | None = None  # [B, T] rollout-correction weights (policy term only)


def host_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metric sums as floats: one device->host copy for all of them instead of one sync per .item()."""
    values = torch.stack(list(sums.values())).detach().float().tolist()
    return dict(zip(sums, values))
