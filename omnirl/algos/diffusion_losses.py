"""The losses of diffusion models (kind "diffusion" in omnirl.algos.losses.LOSSES): flow_grpo, grpo_guard,
flow_dppo, diffusion_nft and dgpo, each called as `loss(inputs, algo, normaliser)` and normalised as
omnirl.algos.losses states; and what their ops compute for them (flow_kl, dgpo_margin).
"""

from __future__ import annotations

import torch

from omnirl.algos.loss_records import DGPOInputs, NFTInputs, RowInputs, host_metrics
from omnirl.config import AlgoConfig


def flow_grpo_loss(
    inputs: RowInputs, algo: AlgoConfig, normaliser: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO clipped policy loss over M rows, each one (sample, trained denoising step) pair.

    inputs: logprob, old_logprob, advantages, weights, and optionally kl (per-row KL to the reference
    policy, `flow_kl`, with gradient) and is_weight (rollout-correction weights c_i, 1 without: an FP8
    rollout); algo: clip_range (eps) and kl_beta.

    r_i = exp(logprob_i - old_logprob_i), policy_i = max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)),
    loss = (sum_i w_i c_i policy_i + kl_beta * sum_i w_i kl_i) / normaliser,
    with `normaliser` the global number of real pairs of the mini-batch (see omnirl.algos.losses).

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
    sums = _ratio_sums(w, policy, ratio, log_ratio, (ratio - 1).abs() > clip_range)
    return _row_loss(sums, w, kl, algo.kl_beta, normaliser)


def _ratio_sums(
    w: torch.Tensor, policy: torch.Tensor, ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The metric sums every ratio-based loss reports over its weighted rows: the policy term, the ratio,
    the rows its clip (or mask) takes out, the approximate KL 0.5 (logprob - old_logprob)^2, the count."""
    return {
        "loss/policy_sum": (w * policy).sum(),
        "loss/ratio_sum": (w * ratio).sum(),
        "loss/clip_count": (w * clipped).sum(),
        "loss/approx_kl_sum": (w * 0.5 * log_ratio**2).sum(),
        "loss/count": w.sum(),
    }


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
    clipped = (ratio - 1).abs() > clip_range
    sums = _ratio_sums(w, policy, ratio, logprob - inputs.old_logprob.detach(), clipped)
    sums["loss/ratio_bias_sum"] = (w * bias.detach()).sum()
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
        **_ratio_sums(w, policy, ratio, log_ratio, mask),
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
    return loss / normaliser, host_metrics(sums)
