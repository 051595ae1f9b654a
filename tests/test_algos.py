"""Advantages and losses against hand / numpy computations."""

import math

import numpy as np
import pytest
import torch

from omnirl.algos.advantages import group_advantages
from omnirl.algos.losses import LOSSES, flow_grpo_loss, flow_kl, get_loss


def _numpy_advantages(rewards, groups, adv_clip, global_std, eps=1e-4):
    rewards, groups = np.asarray(rewards, dtype=np.float64), np.asarray(groups)
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        m = groups == g
        std = rewards.std() if global_std else rewards[m].std()  # numpy's default is ddof 0
        adv[m] = (rewards[m] - rewards[m].mean()) / (std + eps)
    return np.clip(adv, -adv_clip, adv_clip)


@pytest.mark.parametrize("global_std", [False, True])
def test_group_advantages_match_numpy(global_std):
    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(5).repeat_interleave(4)[torch.randperm(20, generator=gen)] * 7  # interleaved ids
    rewards = torch.randn(20, generator=gen) * torch.tensor([0.1, 3.0, 1.0, 10.0, 0.5])[groups // 7] + 2.0
    adv, keep, metrics = group_advantages(rewards, groups, adv_clip=100.0, global_std=global_std)
    expected = _numpy_advantages(rewards.numpy(), groups.numpy(), 100.0, global_std)
    assert adv.dtype == rewards.dtype and keep.all()
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward/mean"] == pytest.approx(rewards.double().mean().item())
    assert metrics["reward/std"] == pytest.approx(rewards.double().std(correction=0).item())
    assert metrics["adv/groups"] == 5 and metrics["adv/zero_std_groups"] == 0
    assert metrics["adv/kept_frac"] == 1.0 and metrics["adv/clip_frac"] == 0.0


def test_group_advantages_hand_values():
    # One group [1, 2, 3, 6]: mean 3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5).
    adv, _, _ = group_advantages(
        torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.zeros(4, dtype=torch.long), 5.0, False
    )
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (math.sqrt(3.5) + 1e-4)
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("global_std", [False, True])
def test_group_advantages_clamped(global_std):
    # Seven zeros and a one: the one's advantage is (7/8) / (sqrt(7)/8) = sqrt(7) ~ 2.65 with its group's
    # std; with the global std (~1.50) the [0, 5] group's are +-1.67.
    rewards = torch.tensor([0.0] * 7 + [1.0] + [0.0, 5.0])
    groups = torch.tensor([0] * 8 + [1, 1])
    adv, keep, metrics = group_advantages(rewards, groups, adv_clip=1.5, global_std=global_std)
    expected = _numpy_advantages(rewards.numpy(), groups.numpy(), 1.5, global_std)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert adv.abs().max() == 1.5 and keep.all()
    assert metrics["adv/clip_frac"] == pytest.approx((np.abs(expected) == 1.5).sum() / 10)
    assert metrics["adv/clip_frac"] > 0


def test_zero_spread_groups_dropped_and_counted():
    # Group 3 is 0.1 three times (its float mean need not be exactly 0.1); group 9 has a single sample.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0, 4.0, 7.0])
    groups = torch.tensor([3, 3, 3, 5, 5, 9, 5])
    for global_std in (False, True):
        adv, keep, metrics = group_advantages(rewards, groups, adv_clip=5.0, global_std=global_std)
        assert keep.tolist() == [False, False, False, True, True, False, True]
        assert (adv[~keep] == 0).all()
        assert metrics["adv/groups"] == 3 and metrics["adv/zero_std_groups"] == 2
        assert metrics["adv/kept_frac"] == pytest.approx(3 / 7)
        # Dropped groups still count in the reward statistics and in the global std.
        assert metrics["reward/mean"] == pytest.approx(rewards.double().mean().item())
        expected = _numpy_advantages(rewards.numpy(), groups.numpy(), 5.0, global_std)
        np.testing.assert_allclose(adv[keep].numpy(), expected[keep.numpy()], rtol=1e-5)


def test_all_groups_zero_spread():
    adv, keep, metrics = group_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), 5.0, True)
    assert not keep.any() and (adv == 0).all()
    assert metrics["adv/kept_frac"] == 0.0 and metrics["adv/zero_std_groups"] == 2
    assert metrics["reward/std"] == 0.0 and metrics["adv/clip_frac"] == 0.0


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match=r"non-finite rewards at sample indices \[1\]"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.long), 5.0, False)
    with pytest.raises(ValueError, match="adv_clip"):
        group_advantages(torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long), 0.0, False)


# Rows: (advantage, ratio) in and out of the clip range [0.8, 1.2], for both signs of the advantage.
ADV = [2.0, 2.0, 2.0, -2.0, -2.0, -2.0]
RATIO = [1.1, 1.5, 0.5, 1.1, 1.5, 0.5]
# max(-A r, -A clip(r)) by hand, and whether the unclipped term is the active one (gradient -A r).
POLICY = [-2.2, -2.4, -1.0, 2.2, 3.0, 1.6]
ACTIVE = [True, False, True, True, True, False]


def _rows(ratio=RATIO, adv=ADV):
    old = torch.linspace(-1.0, 1.0, len(ratio), dtype=torch.float64)
    logprob = (old + torch.tensor(ratio, dtype=torch.float64).log()).requires_grad_()
    return logprob, old, torch.tensor(adv, dtype=torch.float64)


def test_flow_grpo_loss_hand_values_and_gradient():
    logprob, old, adv = _rows()
    old.requires_grad_()
    adv.requires_grad_()
    weights = torch.ones(6, dtype=torch.float64, requires_grad=True)
    loss, metrics = flow_grpo_loss(logprob, old, adv, weights, clip_range=0.2, normaliser=6)
    assert loss.item() == pytest.approx(sum(POLICY) / 6)
    loss.backward()
    # d(-A r)/d logprob = -A r where the unclipped term is active, 0 where the clipped one is.
    expected_grad = [-a * r / 6 if act else 0.0 for a, r, act in zip(ADV, RATIO, ACTIVE)]
    torch.testing.assert_close(logprob.grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert old.grad is None and adv.grad is None and weights.grad is None
    assert metrics == pytest.approx(
        {
            "loss/policy_sum": sum(POLICY),
            "loss/ratio_sum": sum(RATIO),
            "loss/clip_count": 4,
            "loss/approx_kl_sum": sum(0.5 * math.log(r) ** 2 for r in RATIO),
            "loss/count": 6,
        }
    )
    assert all(type(v) is float for v in metrics.values())


def test_flow_grpo_loss_kl_term():
    logprob, old, adv = _rows()
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.float64)
    loss, metrics = flow_grpo_loss(logprob, old, adv, weights, 0.2, normaliser=5, kl=kl, kl_beta=0.5)
    assert loss.item() == pytest.approx((sum(POLICY[:5]) + 0.5 * 1.5) / 5)
    assert metrics["loss/kl_sum"] == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([0.1] * 5 + [0.0], dtype=torch.float64))


def test_zero_weight_rows_contribute_nothing():
    logprob, old, adv = _rows()
    ones = torch.ones(6, dtype=torch.float64)
    ref, ref_metrics = flow_grpo_loss(logprob, old, adv, ones, 0.2, normaliser=6)
    ref.backward()
    ref_grad = logprob.grad.clone()
    # Append three padding rows (copies of real rows, with large values) of weight 0.
    pad_lp, pad_old, pad_adv = _rows(ratio=[3.0, 0.1, 1.0], adv=[50.0, -50.0, 7.0])
    lp = torch.cat([logprob.detach(), pad_lp.detach()]).requires_grad_()
    weights = torch.cat([ones, torch.zeros(3, dtype=torch.float64)])
    loss, metrics = flow_grpo_loss(lp, torch.cat([old, pad_old]), torch.cat([adv, pad_adv]), weights, 0.2, 6)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert metrics == pytest.approx(ref_metrics, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad[:6], ref_grad)
    assert (lp.grad[6:] == 0).all()


def test_micro_batches_with_global_normaliser_sum_to_one_batch():
    logprob, old, adv = _rows()
    kl = torch.linspace(0.0, 1.0, 6, dtype=torch.float64)
    ones = torch.ones(6, dtype=torch.float64)
    whole, _ = flow_grpo_loss(logprob, old, adv, ones, 0.2, normaliser=6, kl=kl, kl_beta=0.1)
    whole.backward()
    whole_grad = logprob.grad.clone()
    logprob.grad = None
    # Two micro-batches of 4 and 2 real rows, the second padded to 4 with zero-weight rows.
    pad = torch.arange(4) % 2
    first, _ = flow_grpo_loss(logprob[:4], old[:4], adv[:4], ones[:4], 0.2, 6, kl=kl[:4], kl_beta=0.1)
    idx = torch.cat([torch.tensor([4, 5]), pad[:2]])
    w = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    second, _ = flow_grpo_loss(logprob[idx], old[idx], adv[idx], w, 0.2, 6, kl=kl[idx], kl_beta=0.1)
    (first + second).backward()
    torch.testing.assert_close(first + second, whole)
    torch.testing.assert_close(logprob.grad, whole_grad)
    # ... and the loss is the mean over pairs.
    assert whole.item() == pytest.approx((sum(POLICY) + 0.1 * kl.sum().item()) / 6)


def test_get_loss():
    assert get_loss("flow_grpo") is flow_grpo_loss
    assert {"flow_grpo", "grpo", "gspo"} <= set(LOSSES)
    with pytest.raises(ValueError, match="unknown algo.loss 'ppo'; known losses: flow_grpo"):
        get_loss("ppo")


def test_flow_kl_hand_value():
    mean = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [1.0, 1.0]], [[0.5, 0.0], [0.0, 0.0]]])
    ref = torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    std = torch.tensor([2.0, 0.0, 0.5])
    mean.requires_grad_()
    kl = flow_kl(mean, ref, std)
    # Row 0: mean(1, 4, 9, 16) / (2 * 4) = 7.5 / 8; row 1: std 0 -> 0; row 2: (0.25 / 4) / (2 * 0.25).
    torch.testing.assert_close(kl, torch.tensor([7.5 / 8, 0.0, 0.125]))
    kl.sum().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[1] == 0).all()
