"""RL losses: LOSSES maps a name to a `LossSpec` ("module:function" and what its callers need to know);
each loss is called as `loss(inputs, algo, normaliser)` and returns (loss, metrics).

Every loss divides by the GLOBAL (all-ranks) count of the mini-batch's rows or tokens (`normaliser`),
rows of weight 0 padding short ranks, so the losses of all micro-batches on all ranks sum to the
mini-batch mean that FSDP's summed gradients need. Metrics are detached sums and counts, never means,
so the trainer can add them over micro-batches and ranks before dividing. Our own code: the clipped
policy-gradient objectives are a few lines each, and the normalisation is ours to get right.

How it works: docs/extending.md#how-to-add-a-loss (the token losses:
docs/algorithms.md#the-token-losses-grpo-dapo-drgrpo-gspo)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnirl.config import AlgoConfig
from omnirl.errors import ConfigError


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: what it trains and what its callers compute for it, so no caller branches on
    a loss's name. The function is called as `fn(inputs, algo, normaliser)` with the input record of its
    rows (`RowInputs`, `NFTInputs`, `TokenInputs`), the run's `AlgoConfig` and the global normaliser."""

    kind: str  # the kind of model it trains: an adapter class's `kind`
    fn: str  # "module:function", the loss
    ops: str = ""  # "module:Class": the ops of a loss whose training rows are not its kind's (omnirl.ops)
    logprobs: bool = True  # it reads the rollout's log-probs (old_logprob, correction, a stochastic step)
    divergence: bool = False  # it reads RowInputs.divergence (so the rollout records each step's mean)
    check: str = ""  # "module:function" refusing the AlgoConfig settings it cannot run with (ConfigError)
    # A loss's own settings are the AlgoConfig section of its name here (algo.flow_dppo, algo.diffusion_nft,
    # algo.dgpo), with their ranges (omnirl.config).


LOSSES = {
    "flow_grpo": LossSpec("diffusion", "omnirl.algos.losses:flow_grpo_loss"),
    "flow_dppo": LossSpec("diffusion", "omnirl.algos.losses:flow_dppo_loss", divergence=True),
    "grpo_guard": LossSpec("diffusion", "omnirl.algos.losses:grpo_guard_loss", divergence=True),
    "diffusion_nft": LossSpec(
        "diffusion",
        "omnirl.algos.losses:diffusion_nft_loss",
        ops="omnirl.ops.nft:NFTOps",
        logprobs=False,
        check="omnirl.algos.losses:check_nft",
    ),
    "dgpo": LossSpec(
        "diffusion",
        "omnirl.algos.losses:dgpo_loss",
        ops="omnirl.ops.dgpo:DGPOOps",
        logprobs=False,
        check="omnirl.algos.losses:check_dgpo",
    ),
    "grpo": LossSpec("omni", "omnirl.algos.losses:grpo_loss"),
    "gspo": LossSpec("omni", "omnirl.algos.losses:gspo_loss", check="omnirl.algos.losses:check_gspo"),
}


def loss_spec(name: str, kind: str | None = None) -> LossSpec:
    """The LOSSES entry of `name`; with `kind`, a loss of another kind of model is a ConfigError naming the
    losses that kind can train with."""
    if name not in LOSSES:
        raise ConfigError(f"unknown algo.loss {name!r}; known losses: {', '.join(sorted(LOSSES))}")
    spec = LOSSES[name]
    if kind is not None and spec.kind != kind:
        fits = sorted(n for n, s in LOSSES.items() if s.kind == kind)
        raise ConfigError(
            f"algo.loss {name!r} trains {spec.kind} models; {kind} models train with {', '.join(fits)}"
        )
    return spec


def _resolve(path: str) -> Callable:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def get_loss(name: str, kind: str | None = None) -> Callable:
    """The loss function registered under `name` in LOSSES, imported on first use (`loss_spec` checks the
    name and the kind)."""
    return _resolve(loss_spec(name, kind).fn)


def check_loss(algo: AlgoConfig) -> None:
    """The algo settings that algo.loss cannot run with, as a ConfigError: a loss without log-probs and
    recomputed old log-probs, and what the loss's own `check` refuses."""
    spec = loss_spec(algo.loss)
    if not spec.logprobs and algo.old_logprob == "recompute":
        raise ConfigError(f"algo.old_logprob recompute: algo.loss {algo.loss} uses no log-probs")
    if spec.check:
        _resolve(spec.check)(algo)


def check_nft(algo: AlgoConfig) -> None:
    if algo.adv_clip is None:
        raise ConfigError(
            "algo.adv_clip null: algo.loss diffusion_nft needs a number (its optimality probability is "
            "A / (2 adv_clip) + 0.5)"
        )


def check_dgpo(algo: AlgoConfig) -> None:
    dgpo = algo.dgpo
    if dgpo.clip_kl and not dgpo.trust_region:
        raise ConfigError("algo.dgpo.clip_kl needs algo.dgpo.trust_region: it clips by its ratio")
    if dgpo.timesteps > dgpo.max_step + 1:
        raise ConfigError(
            f"algo.dgpo.timesteps ({dgpo.timesteps}) must be at most algo.dgpo.max_step + 1 "
            f"({dgpo.max_step + 1}): the times are drawn without replacement from steps 0 .. max_step"
        )


def check_gspo(algo: AlgoConfig) -> None:
    # GSPO's objective weighs every response the same; token_mean (and dr_grpo's token sum) weigh a
    # response by its length, which is another objective under GSPO's name.
    if algo.aggregation != "seq_mean":
        raise ConfigError(
            f"algo.loss 'gspo' is sequence-level: algo.aggregation must be 'seq_mean', got "
            f"{algo.aggregation!r} (which weighs responses by their length)"
        )


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


def flow_grpo_loss(
    inputs: RowInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO clipped policy loss over M rows, each one (sample, trained denoising step) pair.

    inputs: logprob, old_logprob, advantages, weights, and optionally kl (per-row KL to the reference
    policy, `flow_kl`, with gradient) and is_weight (rollout-correction weights c_i, 1 without: an FP8
    rollout); algo: clip_range (eps) and kl_beta.

    r_i = exp(logprob_i - old_logprob_i), policy_i = max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)),
    loss = (sum_i w_i c_i policy_i + kl_beta * sum_i w_i kl_i) / normaliser,
    with `normaliser` the global number of real pairs of the mini-batch (see the module docstring).

    Metrics (sums over real rows; divide by the summed "loss/count"): loss/policy_sum, loss/ratio_sum,
    loss/clip_count (rows with |r - 1| > eps), loss/approx_kl_sum (0.5 (logprob - old_logprob)^2, the
    drift from the behaviour policy), loss/kl_sum (only when `kl` is given), loss/count (sum of weights).
    """
    logprob, clip_range, kl, is_weight = inputs.logprob, algo.clip_range, inputs.kl, inputs.is_weight
    w, adv = _check_rows(inputs, normaliser, algo.kl_beta)
    log_ratio = logprob - inputs.old_logprob.detach()
    ratio = torch.exp(log_ratio)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))  # [M]
    if is_weight is not None:
        policy = policy * is_weight.detach().to(policy.dtype)
    sums = {
        "loss/policy_sum": (w * policy).sum(),
        "loss/ratio_sum": (w * ratio).sum(),
        "loss/clip_count": (w * ((ratio - 1).abs() > clip_range)).sum(),
        "loss/approx_kl_sum": (w * 0.5 * log_ratio**2).sum(),
        "loss/count": w.sum(),
    }
    return _row_loss(sums, w, kl, algo.kl_beta, normaliser)


def grpo_guard_loss(
    inputs: RowInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-Guard (Wang et al. 2025, "Mitigating Implicit Over-Optimization in Flow Matching via Regulated
    Clipping"): Flow-GRPO's clipped objective with its ratio normalised and its gradient re-weighted
    per denoising step, as the reference training scripts define them.

    inputs: as `flow_grpo_loss`, and divergence (the bias b_i = mean over latent dims of
    (mu_theta - mu_old)^2 / (2 s_i^2), `flow_kl` of the two step means with the step's std, WITH its
    gradient), std (s_i = std_dev_t sqrt(|dt|), the step's standard deviation) and dt (|dt|).

    RatioNorm: r_i = exp((logprob_i - old_logprob_i + b_i) s_i). The Gaussian log-ratio of one step is
    -b_i plus a term of mean 0 and standard deviation ~|mu_theta - mu_old| / s_i: adding b_i back centres
    it on 0 (the ratio's mean on 1), and the factor s_i makes its spread the same at every step.
    Gradient re-weighting: policy_i = max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)) / |dt_i|.
    loss = (sum_i w_i c_i policy_i + kl_beta * sum_i w_i kl_i) / normaliser.

    The reference computes s and dt as means over its micro-batch, which holds one denoising step (its
    rows share them); here each row uses its own step's, which is the same on such a batch and keeps a
    micro-batch of mixed steps exact. Metrics: those of flow_grpo_loss, and loss/ratio_bias_sum (sum of b_i).
    """
    assert inputs.divergence is not None and inputs.std is not None and inputs.dt is not None
    logprob, clip_range, kl, is_weight = inputs.logprob, algo.clip_range, inputs.kl, inputs.is_weight
    w, adv = _check_rows(inputs, normaliser, algo.kl_beta)
    scale = inputs.std.detach().to(logprob.dtype)
    bias = inputs.divergence.to(logprob.dtype)
    log_ratio = (logprob - inputs.old_logprob.detach() + bias) * scale
    ratio = torch.exp(log_ratio)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))  # [M]
    dt = inputs.dt.detach().to(logprob.dtype)
    policy = policy / torch.where(dt > 0, dt, 1.0)
    if is_weight is not None:
        policy = policy * is_weight.detach().to(policy.dtype)
    sums = {
        "loss/policy_sum": (w * policy).sum(),
        "loss/ratio_sum": (w * ratio).sum(),
        "loss/clip_count": (w * ((ratio - 1).abs() > clip_range)).sum(),
        "loss/approx_kl_sum": (w * 0.5 * (logprob - inputs.old_logprob.detach()) ** 2).sum(),
        "loss/ratio_bias_sum": (w * bias.detach()).sum(),
        "loss/count": w.sum(),
    }
    return _row_loss(sums, w, kl, algo.kl_beta, normaliser)


def _check_rows(inputs: RowInputs, normaliser: float, kl_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape checks shared by the row losses; returns the weights and advantages, detached, in the
    log-prob's dtype."""
    logprob = inputs.logprob
    assert logprob.dim() == 1, logprob.shape
    assert inputs.old_logprob.shape == inputs.advantages.shape == inputs.weights.shape == logprob.shape
    assert normaliser > 0, normaliser
    assert inputs.kl is not None or kl_beta == 0, "kl_beta > 0 needs the kl term"
    return inputs.weights.detach().to(logprob.dtype), inputs.advantages.detach().to(logprob.dtype)


def flow_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL-like divergence per row between the step Gaussians of the policy and another policy: [M].

    mean, mean_ref: [M, *latent] the means of the two Gaussians of one denoising step, std: [M] the scale
    it is measured in: mean over latent dims of (m - m_ref)^2 / (2 std^2). With the step's standard
    deviation (`StepOut.std`) it is the exact KL(N(m, s^2) || N(m_ref, s^2)) averaged over the latent
    dims, as the log-prob is; with `StepOut.std_dev_t` (the SDE's coefficient before sqrt(|dt|); the
    std itself for CPS and dance_sde) it is flow_grpo's KL term (algo.kl_form). Rows with std 0
    (deterministic ODE steps) get 0. The gradient flows through `mean` only.
    """
    sq = ((mean.float() - mean_ref.detach().float()) ** 2).flatten(1).mean(dim=1)  # [M]
    std = std.float()
    nonzero = std > 0
    return torch.where(nonzero, sq / (2 * torch.where(nonzero, std, 1.0) ** 2), 0.0)


def flow_dppo_loss(
    inputs: RowInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-DPPO over M rows, each one (sample, trained denoising step) pair: the ratio objective with a
    divergence mask in place of the ratio clip.

    inputs: as `flow_grpo_loss`, and divergence: [M] D, the exact KL between the step Gaussians of the
    current and the behaviour policy (`flow_kl` of the two means with the step's std; detached here: the
    mask carries no gradient); algo: flow_dppo.tau (tau, its threshold) and kl_beta.

    r_i = exp(logprob_i - old_logprob_i); row i is masked when it has left the trust region (D_i >= tau)
    and its ratio moved the way its advantage pushes (A_i > 0 and r_i > 1, or A_i < 0 and r_i < 1);
    loss = (sum_i w_i c_i where(mask_i, 0, -A_i r_i) + kl_beta * sum_i w_i kl_i) / normaliser, with
    `normaliser` the global number of real pairs of the mini-batch. A is used as it comes (not clamped
    again).

    Metrics (sums over real rows; divide by the summed "loss/count"): loss/policy_sum, loss/ratio_sum,
    loss/clip_count (the masked rows), loss/approx_kl_sum, loss/count, dppo/kl_new_old_sum (D),
    dppo/kl_new_old_max (the largest D of a real row: combined by max, not summed), dppo/mask_count and
    its split dppo/mask_pos_count (A > 0) / dppo/mask_neg_count (A < 0), loss/kl_sum (with `kl`).
    """
    logprob, tau, kl, is_weight = inputs.logprob, algo.flow_dppo.tau, inputs.kl, inputs.is_weight
    w, adv = _check_rows(inputs, normaliser, algo.kl_beta)
    divergence = inputs.divergence
    assert divergence is not None and divergence.shape == logprob.shape, "flow_dppo needs the divergence"
    d = divergence.detach().to(logprob.dtype)
    log_ratio = logprob - inputs.old_logprob.detach()
    ratio = torch.exp(log_ratio)
    pos = (adv > 0) & (ratio > 1)
    neg = (adv < 0) & (ratio < 1)
    outside = d >= tau
    mask = outside & (pos | neg)  # [M]
    policy = torch.where(mask, 0.0, -adv * ratio)  # [M]
    if is_weight is not None:
        policy = policy * is_weight.detach().to(policy.dtype)
    real = w > 0
    sums = {
        "loss/policy_sum": (w * policy).sum(),
        "loss/ratio_sum": (w * ratio).sum(),
        "loss/clip_count": (w * mask).sum(),
        "loss/approx_kl_sum": (w * 0.5 * log_ratio**2).sum(),
        "loss/count": w.sum(),
        "dppo/kl_new_old_sum": (w * d).sum(),
        "dppo/kl_new_old_max": torch.where(real, d, 0.0).max(),
        "dppo/mask_count": (w * mask).sum(),
        "dppo/mask_pos_count": (w * (mask & pos)).sum(),
        "dppo/mask_neg_count": (w * (mask & neg)).sum(),
    }
    return _row_loss(sums, w, kl, algo.kl_beta, normaliser)


def diffusion_nft_loss(
    inputs: NFTInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT (arXiv 2509.16117) over M rows, each one (clean sample x0, time t, noise eps): the
    policy is trained on the forward process, by flow matching, with no log-prob and no trajectory.

    inputs (`NFTInputs`): velocity v_theta(x_t, t) at the forward-noised x_t = (1 - t) x0 + t eps,
    old_velocity, target eps - x0, t, advantages (clamped to +-adv_clip), weights, and ref_velocity for the
    KL term (kl_beta > 0); algo: diffusion_nft.beta (beta), adv_clip and kl_beta.

    The implicit positive and negative policies mix the old velocity with the current one by beta:
    v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v; the optimality probability of a
    sample is its normalised reward r = clamp(A / (2 adv_clip) + 0.5, 0, 1). v+ is regressed on the
    target with weight r, v- with 1 - r. As in the paper's implementation, each regression is the x0
    prediction error e = x_t - t v_pm - x0 = t (target - v_pm) with the adaptive weight 1 / mean|e|
    (detached, at least 1e-5): l_pm = mean(e^2) / sg(mean|e|), means over latent dims; and the sum is
    scaled by adv_clip / beta, the reference's scale (so its learning rate and gradient clip carry over):
    policy_i = adv_clip / beta * (r_i l+_i + (1 - r_i) l-_i).
    loss = (sum_i w_i policy_i + kl_beta * sum_i w_i mean((v_i - v_ref_i)^2)) / normaliser, with
    `normaliser` the global number of real rows of the mini-batch.

    Metrics (sums over real rows; divide by the summed "loss/count"): loss/policy_sum, loss/count,
    nft/positive_sum (l+), nft/negative_sum (l-), nft/old_deviate_sum (mean (v - v_old)^2), loss/kl_sum
    (with ref_velocity).
    """
    velocity, t, advantages, ref_velocity = inputs.velocity, inputs.t, inputs.advantages, inputs.ref_velocity
    beta, adv_clip, kl_beta = algo.diffusion_nft.beta, algo.adv_clip, algo.kl_beta
    assert velocity.shape == inputs.old_velocity.shape == inputs.target.shape, velocity.shape
    assert velocity.dim() >= 2, velocity.shape
    assert t.shape == advantages.shape == inputs.weights.shape == velocity.shape[:1], (
        t.shape,
        advantages.shape,
    )
    assert adv_clip is not None, "diffusion_nft needs algo.adv_clip (check_nft)"
    assert normaliser > 0 and beta > 0 and adv_clip > 0, (normaliser, beta, adv_clip)
    assert ref_velocity is not None or kl_beta == 0, "kl_beta > 0 needs ref_velocity"
    v = velocity.float()
    v_old = inputs.old_velocity.detach().float()
    v_target = inputs.target.detach().float()
    tt = t.detach().float().reshape(-1, *([1] * (v.dim() - 1)))
    w = inputs.weights.detach().float()
    r = (advantages.detach().float() / (2 * adv_clip) + 0.5).clamp(0, 1)  # [M]
    dims = tuple(range(1, v.dim()))

    def regression(prediction: torch.Tensor) -> torch.Tensor:
        err = tt * (v_target - prediction)  # the x0 prediction error
        scale = err.detach().abs().mean(dim=dims).clamp_min(1e-5)
        return (err**2).mean(dim=dims) / scale  # [M]

    positive = regression((1 - beta) * v_old + beta * v)
    negative = regression((1 + beta) * v_old - beta * v)
    policy = adv_clip / beta * (r * positive + (1 - r) * negative)  # [M]
    sums = {
        "loss/policy_sum": (w * policy).sum(),
        "loss/count": w.sum(),
        "nft/positive_sum": (w * positive).sum(),
        "nft/negative_sum": (w * negative).sum(),
        "nft/old_deviate_sum": (w * ((v - v_old) ** 2).mean(dim=dims)).sum(),
    }
    kl = None if ref_velocity is None else ((v - ref_velocity.detach().float()) ** 2).mean(dim=dims)  # [M]
    return _row_loss(sums, w, kl, kl_beta, normaliser)


def dgpo_margin(
    velocity: torch.Tensor,
    ref_velocity: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    group_size: int,
) -> torch.Tensor:
    """[M] each row's share of its group's preference margin, A beta (dsm - dsm_ref) / group_size, with
    dsm = mean((target - v)^2) over latent dims of the policy's velocity and dsm_ref the reference
    policy's (DGPO, arXiv 2510.08425: the reference's `compute_group_dgpo_loss_allreduce`). No gradient.
    A (group, time)'s weight is the sigmoid of the sum of its rows' margins, all of them (every rank's,
    every micro-batch's): the gradient factor of -log sigmoid(-margin), the group preference likelihood
    DGPO maximises."""
    dims = tuple(range(1, velocity.dim()))
    dsm = (target.float() - velocity.detach().float()).pow(2).mean(dim=dims)
    dsm_ref = (target.float() - ref_velocity.detach().float()).pow(2).mean(dim=dims)
    return advantages.float() * beta * (dsm - dsm_ref) / group_size


def dgpo_loss(
    inputs: DGPOInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """DGPO (arXiv 2510.08425, Luo-Yihong/DGPO) over M rows, each one (clean sample x0, time t, noise eps):
    a group preference learned directly by flow matching on the forward process, with no log-prob, so the
    rollout may sample with an ODE.

    inputs (`DGPOInputs`): velocity v_theta(x_t, t) at x_t = (1 - t) x0 + t eps (eps shared by the rows of
    a group at a time), target eps - x0, advantages (clamped to +-adv_clip), the weight w_g of each row's
    (group, time) (sigmoid of the group's summed `dgpo_margin`s A_j beta (dsm_j - dsm_ref_j) /
    group_size, detached), weights, and ref_velocity for the KL term (kl_beta > 0).

    policy_i = w_g(i) A_i dsm_i, dsm_i = mean((target - v)^2) over latent dims: its gradient is the group
    preference likelihood's. loss = (sum_i w_i policy_i + kl_beta * sum_i w_i mean((v_i - v_ref_i)^2)) /
    normaliser, with `normaliser` the global number of real rows of the mini-batch (the reference's mean
    over rows, and its KL term with beta = kl_beta).

    With algo.dgpo.trust_region (the reference's clip_dsm), ema_velocity is the EMA copy's velocity: the
    ratio r_i = exp(dsm_ema_i - dsm_i) and a row is clipped where A_i > 0 and r_i > 1 + clip_range, or
    A_i <= 0 and r_i < 1 - clip_range; a clipped row's dsm_i enters policy_i detached (its value, no
    gradient), and with algo.dgpo.clip_kl its KL term too.

    Metrics (sums over real rows; divide by the summed "loss/count"): loss/policy_sum, loss/count,
    dgpo/dsm_sum, dgpo/group_weight_sum, loss/kl_sum (with ref_velocity), loss/clip_count (with the trust
    region).
    """
    v, adv, ref_velocity = inputs.velocity.float(), inputs.advantages.detach().float(), inputs.ref_velocity
    assert v.shape == inputs.target.shape and v.dim() >= 2, v.shape
    assert adv.shape == inputs.group_weight.shape == inputs.weights.shape == v.shape[:1], adv.shape
    assert normaliser > 0, normaliser
    assert ref_velocity is not None or algo.kl_beta == 0, "kl_beta > 0 needs ref_velocity"
    dims = tuple(range(1, v.dim()))
    w = inputs.weights.detach().float()
    group_weight = inputs.group_weight.detach().float()
    target = inputs.target.detach().float()
    dsm = (target - v).pow(2).mean(dim=dims)  # [M]
    clipped = torch.zeros_like(dsm, dtype=torch.bool)
    if algo.dgpo.trust_region:
        assert inputs.ema_velocity is not None, "algo.dgpo.trust_region needs ema_velocity"
        dsm_ema = (target - inputs.ema_velocity.detach().float()).pow(2).mean(dim=dims)  # [M]
        ratio = torch.exp(dsm_ema - dsm.detach())
        clipped = torch.where(adv > 0, ratio > 1 + algo.clip_range, ratio < 1 - algo.clip_range)
    policy = group_weight * adv * torch.where(clipped, dsm.detach(), dsm)  # [M]
    sums = {
        "loss/policy_sum": (w * policy).sum(),
        "loss/count": w.sum(),
        "dgpo/dsm_sum": (w * dsm.detach()).sum(),
        "dgpo/group_weight_sum": (w * group_weight).sum(),
    }
    if algo.dgpo.trust_region:
        sums["loss/clip_count"] = (w * clipped.float()).sum()
    kl = None if ref_velocity is None else ((v - ref_velocity.detach().float()) ** 2).mean(dim=dims)  # [M]
    if kl is not None and algo.dgpo.clip_kl:
        kl = torch.where(clipped, kl.detach(), kl)
    return _row_loss(sums, w, kl, algo.kl_beta, normaliser)


def _row_loss(
    sums: dict[str, torch.Tensor],
    w: torch.Tensor,
    kl: torch.Tensor | None,
    kl_beta: float,
    normaliser: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The end the row losses share: the loss is sums["loss/policy_sum"] plus kl_beta times the
    w-weighted sum of `kl` when it is given (recorded as loss/kl_sum), over the global normaliser."""
    loss = sums["loss/policy_sum"]
    if kl is not None:
        kl_sum = (w * kl).sum()
        loss = loss + kl_beta * kl_sum
        sums["loss/kl_sum"] = kl_sum
    return loss / normaliser, _host_metrics(sums)


def _host_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metric sums as floats: one device->host copy for all of them instead of one sync per .item()."""
    values = torch.stack(list(sums.values())).detach().float().tolist()
    return dict(zip(sums, values))


# exp() of a log-ratio past this overflows float32 long before it means anything; bounding it keeps a
# wild token (e.g. a padding position that slipped through) finite instead of NaN-ing the whole batch.
_MAX_LOG_RATIO = 20.0


def grpo_loss(
    inputs: TokenInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO / DAPO token-level clipped policy loss over B responses of up to T tokens.

    inputs (`TokenInputs`): logprob, old_logprob, advantages, mask, weights, max_length, and ref_logprob
    for the KL term (needed when kl_beta > 0) and is_weight, rollout-correction weights
    (omnirl.algos.correction) that multiply the policy term only; algo: clip_range (eps_low),
    clip_range_high (eps_high; null: eps_low), aggregation and kl_beta.

    Per token: r = exp(logprob - old_logprob), policy = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    (clip-higher: eps_high > eps_low lets low-probability tokens grow, DAPO), times is_weight; plus
    kl_beta * k3, k3 = exp(ref - logprob) - (ref - logprob) - 1 (the low-variance KL estimator, >= 0,
    clamped to 10). Aggregation over the mini-batch, with w_i the row weight and m_it the mask:
      token_mean: loss = sum_i w_i sum_t m_it l_it / normaliser, normaliser = global real token count;
      seq_mean:   loss = sum_i w_i (sum_t m_it l_it / sum_t m_it) / normaliser, normaliser = global
                  response count (each response weighs the same, whatever its length);
      dr_grpo:    loss = sum_i w_i sum_t m_it l_it / (max_length * normaliser), normaliser = global
                  response count and max_length the generation limit (Dr.GRPO: a constant, so that
                  neither long nor short responses are favoured by the normalisation).
    Summed over micro-batches and ranks, these are the mini-batch means.

    Metrics (sums over real tokens, weighted by w; divide by the summed "loss/count", the token count):
    loss/policy_sum, loss/ratio_sum, loss/clip_count (tokens with r outside [1 - eps_low, 1 + eps_high]),
    loss/approx_kl_sum (0.5 (logprob - old_logprob)^2), loss/kl_sum (only with ref_logprob), loss/count.
    """
    logprob, m = inputs.logprob, _check_token_inputs(inputs)
    token_log_ratio = torch.where(m, logprob - inputs.old_logprob.detach(), 0.0)  # [B, T]
    log_ratio = token_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _token_objective(log_ratio, token_log_ratio, inputs, m, algo, normaliser)


def gspo_loss(
    inputs: TokenInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: the clipped policy loss on the length-normalised sequence importance ratio.

    Inputs, KL term, aggregation and metrics as `grpo_loss` (the recipe's clip ranges are ~1e-4, e.g.
    eps_low 3e-4, eps_high 4e-4, since a sequence ratio moves far less than a token's).

    s_i = exp(sum_t m_it (logprob_it - old_logprob_it) / sum_t m_it), and the loss is written in the
    per-token form of the GSPO paper, s_it = sg[s_i] exp(logprob_it - sg[logprob_it]): its value is s_i
    at every token, and d s_it / d logprob_it = s_i. With seq_mean aggregation (the paper's objective)
    the gradient is then exactly that of max(-A_i s_i, -A_i clip(s_i)) per response; every token of a
    response is clipped, or not, together.
    """
    logprob, m = inputs.logprob, _check_token_inputs(inputs)
    token_log_ratio = torch.where(m, logprob - inputs.old_logprob.detach(), 0.0)  # [B, T]
    seq_log_ratio = token_log_ratio.sum(dim=1) / m.sum(dim=1).clamp_min(1)  # [B]
    seq_log_ratio = seq_log_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = seq_log_ratio[:, None] + (logprob - logprob.detach())  # [B, T], value log s_i
    return _token_objective(log_ratio, token_log_ratio, inputs, m, algo, normaliser)


def _check_token_inputs(inputs: TokenInputs) -> torch.Tensor:
    """Shape checks shared by the token losses; returns the mask as bool [B, T]."""
    shape, old, mask = inputs.logprob.shape, inputs.old_logprob.shape, inputs.mask.shape
    assert len(shape) == 2 and old == mask == shape, (shape, old, mask)
    rows = (inputs.advantages.shape, inputs.weights.shape)
    assert rows[0] == rows[1] == shape[:1], rows
    for extra in (inputs.ref_logprob, inputs.is_weight):
        assert extra is None or extra.shape == shape, extra.shape
    return inputs.mask.bool()


def _token_objective(
    log_ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    inputs: TokenInputs,
    m: torch.Tensor,
    algo: AlgoConfig,
    normaliser: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped objective, KL and aggregation shared by grpo_loss and gspo_loss (see grpo_loss)."""
    logprob, ref_logprob, is_weight, max_length = (
        inputs.logprob,
        inputs.ref_logprob,
        inputs.is_weight,
        inputs.max_length,
    )
    eps_low, kl_beta, aggregation = algo.clip_range, algo.kl_beta, algo.aggregation
    eps_high = eps_low if algo.clip_range_high is None else algo.clip_range_high
    assert normaliser > 0, normaliser
    assert ref_logprob is not None or kl_beta == 0, "kl_beta > 0 needs ref_logprob"
    assert aggregation != "dr_grpo" or max_length > 0, "dr_grpo needs max_length"
    dtype = logprob.dtype
    adv = inputs.advantages.detach().to(dtype)[:, None]  # [B, 1]
    ratio = torch.exp(log_ratio)  # [B, T]
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))  # [B, T]
    if is_weight is not None:
        policy = policy * is_weight.detach().to(dtype)
    per_token = policy
    # Token weights of the aggregation: w_i m_it, divided by the response length (seq_mean) or by the
    # constant max_length (dr_grpo); the division by the global normaliser comes last.
    tok = inputs.weights.detach().to(dtype)[:, None] * m.to(dtype)  # [B, T]
    if aggregation == "token_mean":
        agg = tok
    elif aggregation == "seq_mean":
        agg = tok / m.sum(dim=1, keepdim=True).clamp_min(1)
    elif aggregation == "dr_grpo":
        agg = tok / max_length
    else:
        raise AssertionError(f"unknown aggregation {aggregation!r}")
    sums = {
        "loss/policy_sum": (tok * policy).sum(),
        "loss/ratio_sum": (tok * ratio).sum(),
        "loss/clip_count": (tok * ((ratio < 1 - eps_low) | (ratio > 1 + eps_high))).sum(),
        "loss/approx_kl_sum": (tok * 0.5 * token_log_ratio**2).sum(),
        "loss/count": tok.sum(),
    }
    if ref_logprob is not None:
        d = torch.where(m, ref_logprob.detach() - logprob, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = (torch.exp(d) - d - 1).clamp(max=10.0)  # [B, T]
        per_token = per_token + kl_beta * kl
        sums["loss/kl_sum"] = (tok * kl).sum()
    return (agg * per_token).sum() / normaliser, _host_metrics(sums)
