"""Rollout correction: the gap between the rollout engine's log-probs and the trainer's.

`correction_weights` gives each token (or trained denoising step) its truncated (tis) or masked (mis)
importance weight pi_old / pi_rollout, per token or per sequence (`algo.correction_level`); with
`algo.old_logprob rollout` (bypass) nothing is weighted. `consistency_metrics` measures the gap on every
step over real tokens only, and `position_gaps` per span of response positions (`position_spans`), so a
gap that only some positions have is not averaged away. Our own code: a few lines of tensor math over
the masks and the global statistics we log.

How it works: docs/algorithms.md#rollout-correction
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from omnirl.distributed import all_reduce


def correction_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["tis", "mis"],
    level: Literal["token", "sequence"],
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_old / pi_rollout, truncated (tis) or masked (mis) at `threshold` C > 1.

    old_logprob: [B, T] recomputed by the trainer, rollout_logprob: [B, T] recorded by the rollout,
    mask: [B, T] 1 (True) on real response tokens. Pass this rank's real rows (before micro-batch padding);
    padding positions must hold finite values. Returns (weights [B, T] detached, 0 at padding, metrics).

    tis: w = min(rho, C); mis: w = rho if 1/C <= rho <= C else 0. rho is the token's ratio (level token)
    or the response's, exp(sum_t log rho_t) (level sequence).

    Metrics (sums over real tokens; divide by "correction/count"): correction/weight_sum,
    correction/clip_count (tokens whose weight was truncated (tis) or masked (mis)), correction/count.
    """
    assert old_logprob.shape == rollout_logprob.shape == mask.shape and mask.dim() == 2, (
        old_logprob.shape,
        rollout_logprob.shape,
        mask.shape,
    )
    if not threshold > 1:
        raise ValueError(f"algo.correction_threshold must be > 1, got {threshold}")
    m = mask.bool()
    # float64: a sequence's summed log-ratio over thousands of tokens must not lose the small per-token gaps.
    log_rho = torch.where(m, old_logprob.detach().double() - rollout_logprob.detach().double(), 0.0)
    if level == "sequence":
        log_rho = torch.where(m, log_rho.sum(dim=1, keepdim=True), 0.0)  # [B, T]
    else:
        assert level == "token", level
    log_c = math.log(threshold)
    if mode == "tis":
        outside = log_rho > log_c
        weights = torch.exp(log_rho.clamp(max=log_c))
    else:
        assert mode == "mis", mode
        outside = log_rho.abs() > log_c
        # exp only of kept log-ratios: a dropped sequence's ratio may overflow.
        weights = torch.where(outside, 0.0, torch.exp(torch.where(outside, 0.0, log_rho)))
    weights = torch.where(m, weights, 0.0)
    sums = torch.stack([weights.sum(), (outside & m).sum().double(), m.sum().double()]).tolist()
    metrics = dict(zip(["correction/weight_sum", "correction/clip_count", "correction/count"], sums))
    return weights.to(old_logprob.dtype), metrics


def consistency_metrics(
    actor_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How closely the trainer's token log-probs match the rollout's, over the real tokens of all ranks.

    actor_logprob, rollout_logprob, mask: any equal shapes ([B, T] or flat), mask 1 (True) on real tokens;
    the actor's log-probs must come from the policy the rollout used (the recomputed old log-probs, or
    in bypass mode the first mini-batch's forward, before its optimizer step).

    Collective: every rank calls it once per step (two SUM and one MAX all-reduce; none without a
    process group) and gets the same global values:
    consistency/prob_pearson (Pearson correlation of the token probabilities exp(logprob); nan when
    fewer than two tokens or one side is constant), consistency/logprob_abs_diff_mean and _max,
    consistency/prob_abs_diff_mean and _max, consistency/tokens (nan means and maxima with no tokens).

    The Pearson is computed from values centred on their global means (a second all-reduce), and a side
    is constant when its global minimum equals its maximum: raw moments (n sum p^2 - (sum p)^2) leave a
    rounding residue of ~1e-8 where the variance is exactly 0, which gave a meaningless finite value.
    """
    assert actor_logprob.shape == rollout_logprob.shape == mask.shape, (
        actor_logprob.shape,
        rollout_logprob.shape,
        mask.shape,
    )
    m = mask.bool()
    a = actor_logprob.detach().double()[m]  # [N] real tokens only
    r = rollout_logprob.detach().double()[m]
    pa, pr = a.exp(), r.exp()
    dlog, dprob = (a - r).abs(), (pa - pr).abs()
    sums = all_reduce(
        torch.stack([a.new_tensor(float(a.numel())), pa.sum(), pr.sum(), dlog.sum(), dprob.sum()])
    )
    n, sa, sr, s_dlog, s_dprob = sums.tolist()
    ca, cr = pa - sa / max(n, 1.0), pr - sr / max(n, 1.0)  # centred on the global means
    saa, srr, sar = all_reduce(torch.stack([(ca * ca).sum(), (cr * cr).sum(), (ca * cr).sum()])).tolist()
    # -inf stands for "no tokens on this rank": it never wins the MAX (minima enter negated).
    if a.numel():
        maxima = torch.stack([dlog.max(), dprob.max(), pa.max(), -pa.min(), pr.max(), -pr.min()])
    else:
        maxima = a.new_full((6,), -math.inf)
    maxima = all_reduce(maxima, op=dist.ReduceOp.MAX).tolist()
    max_dlog, max_dprob = (v if v > -math.inf else math.nan for v in maxima[:2])
    constant = maxima[2] == -maxima[3] or maxima[4] == -maxima[5]
    var = saa * srr
    pearson = sar / math.sqrt(var) if n >= 2 and not constant and var > 0 else math.nan
    return {
        "consistency/prob_pearson": pearson,
        "consistency/logprob_abs_diff_mean": s_dlog / n if n else math.nan,
        "consistency/logprob_abs_diff_max": max_dlog,
        "consistency/prob_abs_diff_mean": s_dprob / n if n else math.nan,
        "consistency/prob_abs_diff_max": max_dprob,
        "consistency/tokens": n,
    }


def position_spans(size: int) -> list[tuple[int, int]]:
    """The [lo, hi) spans of response positions below `size` that `position_gaps` pools: 0, 1, 2-3, 4-7,
    ..., each as long as all before it, so the tail (which fewer responses reach) pools more positions."""
    spans, lo = [(0, 1)], 1
    while lo < size:
        spans.append((lo, min(2 * lo, size)))
        lo *= 2
    return spans


def position_gaps(
    actor_logprob: torch.Tensor, rollout_logprob: torch.Tensor, positions: torch.Tensor, size: int
) -> dict[str, float]:
    """The trainer-vs-rollout log-prob gap per span of response positions (`position_spans(size)`), over
    the real tokens of all ranks.

    actor_logprob, rollout_logprob, positions: [N] the real tokens, each with its position in its response
    (0 the first response token, below `size`). Collective: every rank calls it once per step (one SUM
    all-reduce) and gets, for every span that holds tokens, consistency/posLO_HI/logprob_abs_diff_mean (over
    the span's tokens), worst_position (the position of the span whose mean gap over the responses that
    reach it is the largest) and worst_position_gap (that mean)."""
    assert actor_logprob.shape == rollout_logprob.shape == positions.shape, (
        actor_logprob.shape,
        positions.shape,
    )
    sums = torch.zeros(
        2, size, dtype=torch.float64, device=actor_logprob.device
    )  # [2, P]: sum of |diff|, count
    diff = (actor_logprob.detach().double() - rollout_logprob.detach().double()).abs()
    sums[0].index_add_(0, positions, diff)
    sums[1].index_add_(0, positions, torch.ones_like(diff))
    sums = all_reduce(sums).cpu()
    out: dict[str, float] = {}
    for lo, hi in position_spans(size):
        total, count = sums[0, lo:hi], sums[1, lo:hi]
        if count.sum() == 0:
            continue
        means = total / count.clamp(min=1)  # a position no response reached: 0
        worst = int(means.argmax())
        key = f"consistency/pos{lo}_{hi - 1}"
        out[f"{key}/logprob_abs_diff_mean"] = (total.sum() / count.sum()).item()
        out[f"{key}/worst_position"] = float(lo + worst)
        out[f"{key}/worst_position_gap"] = means[worst].item()
    return out
