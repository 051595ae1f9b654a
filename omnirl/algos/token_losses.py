"""The token losses of text-output (omni) models (kind "omni" in omnirl.algos.losses.LOSSES): grpo (with
DAPO's clip-higher and Dr.GRPO's aggregation as settings) and gspo, each called as
`loss(inputs, algo, normaliser)` and normalised as omnirl.algos.losses states.

How they work: docs/algorithms.md#the-token-losses-grpo-dapo-drgrpo-gspo
"""

from __future__ import annotations

import torch

from omnirl.algos.loss_records import TokenInputs, host_metrics
from omnirl.config import AlgoConfig

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
    return (agg * per_token).sum() / normaliser, host_metrics(sums)
