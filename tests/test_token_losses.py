"""Token-level losses (GRPO/DAPO, GSPO), Dr.GRPO advantages, rollout correction and the actor-vs-rollout
consistency metrics, against values and gradients computed by hand."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omnirl.algos.advantages import group_advantages
from omnirl.algos.correction import consistency_metrics, correction_weights
from omnirl.algos.losses import LOSSES, TokenInputs, get_loss, grpo_loss, gspo_loss
from omnirl.config import AlgoConfig

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
# GRPO rows: A = +1 with ratios [1.25, 1.5, 0.7]; A = -2 with ratios [1.1, 0.5] and a padding token.
ADV = torch.tensor([1.0, -2.0], dtype=F64)
RATIO = [[1.25, 1.5, 0.7], [1.1, 0.5, 1.0]]
# max(-A r, -A clip(r, 0.8, 1.28)) per real token, by hand, and its derivative in logprob:
# -A r where the unclipped term is active, 0 where the clipped one is.
POLICY = [[-1.25, -1.28, -0.7], [2.2, 1.6, 0.0]]
DPOLICY = [[-1.25, 0.0, -0.7], [2.2, 0.0, 0.0]]


def grpo_rows(ratio=RATIO):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, 7.0]], dtype=F64)
    logprob = (old + torch.tensor(ratio, dtype=F64).log()).requires_grad_()
    return logprob, old


def algo(eps_low, eps_high, aggregation, kl_beta=0.0):
    """The AlgoConfig of a token loss: clip range eps_low / eps_high (clip-higher), aggregation and KL."""
    return AlgoConfig(clip_range=eps_low, clip_range_high=eps_high, aggregation=aggregation, kl_beta=kl_beta)


def test_registry():
    assert get_loss("grpo") is grpo_loss and get_loss("gspo") is gspo_loss
    assert {"grpo", "gspo"} <= set(LOSSES)


def test_grpo_clip_higher_token_mean_by_hand():
    logprob, old = grpo_rows()
    ones = torch.ones(2, dtype=F64)
    loss, metrics = grpo_loss(
        TokenInputs(logprob, old, ADV, MASK, ones), algo(0.2, 0.28, "token_mean"), normaliser=5
    )
    assert loss.item() == pytest.approx((-1.25 - 1.28 - 0.7 + 2.2 + 1.6) / 5)
    loss.backward()
    torch.testing.assert_close(logprob.grad, torch.tensor(DPOLICY, dtype=F64) / 5)
    real = [r for row, m in zip(RATIO, MASK.tolist()) for r, k in zip(row, m) if k]
    assert metrics == pytest.approx(
        {
            "loss/policy_sum": 0.57,
            "loss/ratio_sum": sum(real),
            "loss/clip_count": 3,  # 1.5 above 1.28; 0.7 and 0.5 below 0.8
            "loss/approx_kl_sum": sum(0.5 * math.log(r) ** 2 for r in real),
            "loss/count": 5,
        }
    )
    # Clip-higher is what lets the A > 0 token at ratio 1.25 keep its gradient: a symmetric 0.2 clips it.
    logprob.grad = None
    sym, _ = grpo_loss(TokenInputs(logprob, old, ADV, MASK, ones), algo(0.2, 0.2, "token_mean"), normaliser=5)
    sym.backward()
    assert sym.item() == pytest.approx((-1.2 - 1.2 - 0.7 + 2.2 + 1.6) / 5)
    assert logprob.grad[0, 0] == 0 and logprob.grad[0, 2] == pytest.approx(-0.7 / 5)


def test_grpo_seq_mean_and_dr_grpo_by_hand():
    logprob, old = grpo_rows()
    ones = torch.ones(2, dtype=F64)
    loss, _ = grpo_loss(TokenInputs(logprob, old, ADV, MASK, ones), algo(0.2, 0.28, "seq_mean"), normaliser=2)
    assert loss.item() == pytest.approx(((-1.25 - 1.28 - 0.7) / 3 + (2.2 + 1.6) / 2) / 2)
    loss.backward()
    lengths = torch.tensor([[3.0], [2.0]], dtype=F64)
    torch.testing.assert_close(logprob.grad, torch.tensor(DPOLICY, dtype=F64) / lengths / 2)
    logprob.grad = None
    # Dr.GRPO: token sums over the constant max length 4, averaged over the 2 responses.
    inputs = TokenInputs(logprob, old, ADV, MASK, ones, max_length=4)
    loss, metrics = grpo_loss(inputs, algo(0.2, 0.28, "dr_grpo"), normaliser=2)
    assert loss.item() == pytest.approx(0.57 / (4 * 2))
    loss.backward()
    torch.testing.assert_close(logprob.grad, torch.tensor(DPOLICY, dtype=F64) / 8)
    assert metrics["loss/count"] == 5


def gspo_rows():
    # Token log-ratios: row 0 mean 0.1 (s = e^0.1, far outside the clip range), row 1 mean 1e-4 (inside
    # [1 - 3e-4, 1 + 4e-4]), row 2 mean -0.3 (below it, but with A > 0 the unclipped term is active).
    log_ratio = torch.tensor([[0.3, -0.1, 0.1], [3e-4, -1e-4, 0.0], [-0.2, -0.4, -0.3]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, 5.0], [-0.7, -0.2, -3.0]], dtype=F64)
    logprob = (old + log_ratio).requires_grad_()
    return logprob, old, mask, torch.tensor([1.0, -2.0, 0.5], dtype=F64)


def test_gspo_by_hand():
    logprob, old, mask, adv = gspo_rows()
    ones = torch.ones(3, dtype=F64)
    s0, s1, s2 = math.exp(0.1), math.exp(1e-4), math.exp(-0.3)
    loss, metrics = gspo_loss(
        TokenInputs(logprob, old, adv, mask, ones), algo(3e-4, 4e-4, "seq_mean"), normaliser=3
    )
    # Row 0: -A clip(s0) = -1.0004; row 1: -A s1 = 2 s1; row 2: max(-0.5 s2, -0.5 * 0.9997) = -0.5 s2.
    assert loss.item() == pytest.approx((-1.0004 + 2 * s1 - 0.5 * s2) / 3)
    loss.backward()
    # d/dlogprob_t of the per-token form is -A s_i (times the aggregation weight 1 / (|y_i| N)): the
    # clipped row gets none; the others the same value at each of their tokens.
    expected = [[0.0] * 3, [2 * s1 / (2 * 3)] * 2 + [0.0], [-0.5 * s2 / (3 * 3)] * 3]
    torch.testing.assert_close(logprob.grad, torch.tensor(expected, dtype=F64))
    # Every token of a response carries the sequence ratio and is clipped with it.
    assert metrics["loss/ratio_sum"] == pytest.approx(3 * s0 + 2 * s1 + 3 * s2)
    assert metrics["loss/clip_count"] == 6 and metrics["loss/count"] == 8


def test_gspo_gradient_equals_the_sequence_objective():
    logprob, old, mask, adv = gspo_rows()
    ones = torch.ones(3, dtype=F64)
    loss, _ = gspo_loss(
        TokenInputs(logprob, old, adv, mask, ones), algo(3e-4, 4e-4, "seq_mean"), normaliser=3
    )
    (grad_token_form,) = torch.autograd.grad(loss, logprob)
    # The paper's sequence-level objective written directly: s_i = exp(masked mean of the log-ratios).
    m = mask.to(F64)
    s = torch.exp(((logprob - old) * m).sum(1) / m.sum(1))
    seq = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4)).sum() / 3
    (grad_seq,) = torch.autograd.grad(seq, logprob)
    torch.testing.assert_close(loss, seq)
    torch.testing.assert_close(grad_token_form, grad_seq)
    # With token_mean the per-token gradient is -A s_i / N_tokens: s_it's derivative is s_i itself.
    logprob.grad = None
    loss, _ = gspo_loss(
        TokenInputs(logprob, old, adv, mask, ones), algo(3e-4, 4e-4, "token_mean"), normaliser=8
    )
    loss.backward()
    assert logprob.grad[2, 0].item() == pytest.approx(-0.5 * math.exp(-0.3) / 8)


def test_kl_k3_term_by_hand():
    logprob, old = grpo_rows()
    ones = torch.ones(2, dtype=F64)
    d = torch.tensor([[0.5, -0.3, 0.0], [1.0, -1.0, 99.0]], dtype=F64)  # ref - logprob (99: padding)
    ref = logprob.detach() + d
    base, _ = grpo_loss(TokenInputs(logprob, old, ADV, MASK, ones), algo(0.2, 0.28, "token_mean"), 5)
    inputs = TokenInputs(logprob, old, ADV, MASK, ones, ref_logprob=ref)
    loss, metrics = grpo_loss(inputs, algo(0.2, 0.28, "token_mean", kl_beta=0.1), 5)
    k3 = [math.exp(x) - x - 1 for x in (0.5, -0.3, 0.0, 1.0, -1.0)]
    assert metrics["loss/kl_sum"] == pytest.approx(sum(k3))
    assert loss.item() == pytest.approx(base.item() + 0.1 * sum(k3) / 5)
    loss.backward()
    # d k3 / d logprob = 1 - exp(ref - logprob).
    dkl = torch.where(MASK, 1 - d.exp(), 0.0)
    torch.testing.assert_close(logprob.grad, (torch.tensor(DPOLICY, dtype=F64) + 0.1 * dkl) / 5)


def test_padding_rows_and_tokens_contribute_nothing():
    for loss_fn in (grpo_loss, gspo_loss):
        logprob, old = grpo_rows()
        ones = torch.ones(2, dtype=F64)
        ref_lp = logprob.detach() - 0.1
        kl = algo(0.2, 0.28, "seq_mean", kl_beta=0.1)
        ref, ref_metrics = loss_fn(TokenInputs(logprob, old, ADV, MASK, ones, ref_logprob=ref_lp), kl, 2)
        (ref_grad,) = torch.autograd.grad(ref, logprob)
        # Wild values at the padding token, plus a whole padding row of weight 0 (a short rank's filler).
        lp = torch.cat([logprob.detach(), torch.tensor([[30.0, -30.0, 5.0]], dtype=F64)])
        lp[1, 2] = 40.0
        lp.requires_grad_()
        old2 = torch.cat([old, torch.tensor([[-30.0, 30.0, -5.0]], dtype=F64)])
        old2[1, 2] = -40.0
        mask = torch.cat([MASK, torch.tensor([[True, True, False]])])
        weights = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
        adv = torch.cat([ADV, torch.tensor([100.0], dtype=F64)])
        ref2 = torch.cat([ref_lp, torch.full((1, 3), -50.0, dtype=F64)])
        loss, metrics = loss_fn(TokenInputs(lp, old2, adv, mask, weights, ref_logprob=ref2), kl, 2)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
        assert metrics == pytest.approx(ref_metrics, abs=1e-12)
        loss.backward()
        torch.testing.assert_close(lp.grad[:2], ref_grad)
        assert (lp.grad[2] == 0).all() and lp.grad[1, 2] == 0


@pytest.mark.parametrize("loss_fn", [grpo_loss, gspo_loss])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "dr_grpo"])
def test_micro_batches_with_the_global_normaliser_sum_to_one_batch(loss_fn, aggregation):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 5
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    logprob = (old + torch.randn(B, T, generator=gen, dtype=F64) * 0.2).requires_grad_()
    ref = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.1
    adv = torch.randn(B, generator=gen, dtype=F64)
    is_weight = torch.rand(B, T, generator=gen, dtype=F64) + 0.5
    normaliser = float(mask.sum()) if aggregation == "token_mean" else float(B)
    max_length = T if aggregation == "dr_grpo" else 0

    def loss(rows, weights):
        # gspo's clip ranges are ~1e-4: GRPO-sized ones here, so that both terms of the max are exercised.
        i = torch.tensor(rows)
        w = torch.tensor(weights, dtype=F64)
        extra = {"ref_logprob": ref[i], "is_weight": is_weight[i]}
        inputs = TokenInputs(logprob[i], old[i], adv[i], mask[i], w, max_length, **extra)
        return loss_fn(inputs, algo(0.2, 0.28, aggregation, kl_beta=0.05), normaliser)[0]

    whole = loss(list(range(B)), [1.0] * B)
    (whole_grad,) = torch.autograd.grad(whole, logprob)
    # Micro-batches of 4 and 2 rows, the second padded with two zero-weight copies of rows 0 and 1.
    total = loss([0, 1, 2, 3], [1, 1, 1, 1]) + loss([4, 5, 0, 1], [1, 1, 0, 0])
    (micro_grad,) = torch.autograd.grad(total, logprob)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(micro_grad, whole_grad)


def test_correction_weights_the_policy_term_only():
    logprob, old = grpo_rows()
    ones = torch.ones(2, dtype=F64)
    is_weight = torch.tensor([[2.0, 0.5, 0.0], [1.5, 3.0, 0.0]], dtype=F64)
    d = torch.full((2, 3), 0.5, dtype=F64)
    inputs = TokenInputs(logprob, old, ADV, MASK, ones, ref_logprob=logprob.detach() + d, is_weight=is_weight)
    loss, metrics = grpo_loss(inputs, algo(0.2, 0.28, "token_mean", kl_beta=0.1), 5)
    weighted = [[-2.5, -0.64, 0.0], [3.3, 4.8, 0.0]]
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss.item() == pytest.approx((sum(map(sum, weighted)) + 0.1 * 5 * k3) / 5)
    assert metrics["loss/policy_sum"] == pytest.approx(sum(map(sum, weighted)))


# Trainer-vs-rollout token ratios pi_old / pi_rollout with C = 2 (the third token of row 1 is padding).
RHO = [[3.0, 0.25, 1.5], [0.4, 1.2, 1e6]]


def rho_rows():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -0.1]], dtype=F64)
    return rollout + torch.tensor(RHO, dtype=F64).log(), rollout


@pytest.mark.parametrize(
    "mode, level, weights, clipped",
    [
        ("tis", "token", [[2.0, 0.25, 1.5], [0.4, 1.2, 0.0]], 1),
        ("mis", "token", [[0.0, 0.0, 1.5], [0.0, 1.2, 0.0]], 3),
        # Sequence ratios: 3 * 0.25 * 1.5 = 1.125 and 0.4 * 1.2 = 0.48 (below 1/2: masked by mis).
        ("tis", "sequence", [[1.125] * 3, [0.48, 0.48, 0.0]], 0),
        ("mis", "sequence", [[1.125] * 3, [0.0, 0.0, 0.0]], 2),
    ],
)
def test_correction_weights_by_hand(mode, level, weights, clipped):
    old, rollout = rho_rows()
    w, metrics = correction_weights(old, rollout, MASK, mode, level, threshold=2.0)
    torch.testing.assert_close(w, torch.tensor(weights, dtype=F64))
    assert metrics == pytest.approx(
        {
            "correction/weight_sum": sum(map(sum, weights)),
            "correction/clip_count": clipped,
            "correction/count": 5,
        }
    )


def test_correction_bad_threshold():
    old, rollout = rho_rows()
    with pytest.raises(ValueError, match="correction_threshold must be > 1"):
        correction_weights(old, rollout, MASK, "tis", "token", threshold=1.0)


def test_consistency_metrics_against_numpy():
    gen = torch.Generator().manual_seed(0)
    rollout = torch.log_softmax(torch.randn(4, 7, 50, generator=gen, dtype=F64), -1)[..., 0]  # [4, 7]
    actor = rollout + torch.randn(4, 7, generator=gen, dtype=F64) * 0.05
    mask = torch.arange(7)[None] < torch.tensor([7, 3, 5, 1])[:, None]
    actor[~mask] = 50.0  # padding: would dominate every statistic if it were counted
    m = consistency_metrics(actor, rollout, mask)
    a, r = actor[mask].numpy(), rollout[mask].numpy()
    assert m["consistency/tokens"] == 16
    assert m["consistency/prob_pearson"] == pytest.approx(np.corrcoef(np.exp(a), np.exp(r))[0, 1], abs=1e-12)
    assert m["consistency/logprob_abs_diff_mean"] == pytest.approx(np.abs(a - r).mean())
    assert m["consistency/logprob_abs_diff_max"] == pytest.approx(np.abs(a - r).max())
    assert m["consistency/prob_abs_diff_mean"] == pytest.approx(np.abs(np.exp(a) - np.exp(r)).mean())
    assert m["consistency/prob_abs_diff_max"] == pytest.approx(np.abs(np.exp(a) - np.exp(r)).max())
    same = consistency_metrics(rollout, rollout, mask)
    assert same["consistency/prob_pearson"] == pytest.approx(1.0, abs=1e-12)
    assert same["consistency/logprob_abs_diff_max"] == 0 and same["consistency/prob_abs_diff_max"] == 0
    empty = consistency_metrics(rollout, rollout, torch.zeros_like(mask))
    assert empty["consistency/tokens"] == 0 and math.isnan(empty["consistency/prob_pearson"])
    assert math.isnan(empty["consistency/logprob_abs_diff_max"])


def _consistency_rank(rank: int, init: str, rows, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    actor, rollout, mask = rows[rank]
    torch.save(consistency_metrics(actor, rollout, mask), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_consistency_metrics_are_global_over_ranks(tmp_path):
    gen = torch.Generator().manual_seed(1)
    rollout = -torch.rand(6, 4, generator=gen, dtype=F64) * 4
    actor = rollout + torch.randn(6, 4, generator=gen, dtype=F64) * 0.1
    mask = torch.rand(6, 4, generator=gen) < 0.7
    # Rank 0 gets rows 0-3; rank 1 rows 4-5 with the largest gap, so MAX (not SUM) must bring it over.
    actor[5, 0] = rollout[5, 0] + 2.0
    mask[5, 0] = True
    rows = [(actor[:4], rollout[:4], mask[:4]), (actor[4:], rollout[4:], mask[4:])]
    # fork: two gloo ranks without re-importing torch in fresh interpreters (seconds each on a busy CPU).
    mp.start_processes(
        _consistency_rank, args=(f"file://{tmp_path}/pg", rows, str(tmp_path)), nprocs=2, start_method="fork"
    )
    whole = consistency_metrics(actor, rollout, mask)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == pytest.approx(whole)
    assert whole["consistency/logprob_abs_diff_max"] == pytest.approx(2.0)


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, keep, _ = group_advantages(rewards, groups, adv_clip=2.5, global_std=False, std_normalise=False)
    # Group 0: mean 3 -> [-2, -1, 0, 3] (3 clamped to 2.5); group 1: mean 0.25 -> [-0.25, 0.25].
    torch.testing.assert_close(adv, torch.tensor([-2.0, -1.0, 0.0, 2.5, -0.25, 0.25]))
    assert keep.all()
    with pytest.raises(ValueError, match="global_std needs algo.std_normalise"):
        group_advantages(rewards, groups, 2.5, global_std=True, std_normalise=False)


def test_consistency_pearson_from_centred_values_by_hand():
    """Probabilities (0.1, 0.2, 0.3) against (0.1, 0.3, 0.2): centred (-0.1, 0, 0.1) and (-0.1, 0.1, 0),
    covariance 0.01, variances 0.02 each: Pearson 0.5. A side whose values are all equal has no Pearson
    (nan), where raw moments left a rounding residue: sum(p)^2 - n sum(p^2) of 0.1 three times is 1e-18,
    not 0, in float64."""
    mask = torch.ones(3, dtype=torch.bool)
    actor, rollout = (
        torch.tensor([0.1, 0.2, 0.3], dtype=F64).log(),
        torch.tensor([0.1, 0.3, 0.2], dtype=F64).log(),
    )
    assert consistency_metrics(actor, rollout, mask)["consistency/prob_pearson"] == pytest.approx(
        0.5, abs=1e-12
    )
    constant = torch.full((3,), 0.1, dtype=F64).log()
    p = constant.exp()
    assert 3 * (p * p).sum().item() - p.sum().item() ** 2 != 0  # the residue the raw moments would divide by
    m = consistency_metrics(constant, rollout, mask)
    assert math.isnan(m["consistency/prob_pearson"]) and m["consistency/tokens"] == 3
    assert math.isnan(consistency_metrics(rollout, constant, mask)["consistency/prob_pearson"])


def test_gspo_with_a_length_weighted_aggregation_is_refused():
    from omnirl.algos.losses import check_loss
    from omnirl.errors import ConfigError
    from omnirl.recipe import config_for

    cfg = config_for("qwen3_omni_thinker")
    cfg.algo.loss = "gspo"
    for aggregation in ("token_mean", "dr_grpo"):
        cfg.algo.aggregation = aggregation
        with pytest.raises(
            ConfigError, match=f"algo.loss 'gspo' is sequence-level: algo.aggregation .*'{aggregation}'"
        ):
            check_loss(cfg.algo)
    cfg.algo.aggregation = "seq_mean"
    check_loss(cfg.algo)
    cfg.algo.loss, cfg.algo.aggregation = "grpo", "token_mean"
    check_loss(cfg.algo)
