"""Advantages and losses against hand / numpy computations."""

import math

import numpy as np
import pytest
import torch

from omnirl.algos.advantages import group_advantages
from omnirl.algos.losses import (
    LOSSES,
    DGPOInputs,
    NFTInputs,
    RowInputs,
    dgpo_loss,
    dgpo_margin,
    diffusion_nft_loss,
    flow_dppo_loss,
    flow_grpo_loss,
    flow_kl,
    get_loss,
)
from omnirl.config import AlgoConfig, DGPOConfig, DiffusionNFTConfig, FlowDPPOConfig
from omnirl.config_checks import check_values
from omnirl.errors import ConfigError
from omnirl.models.flow_sde import flow_step
from omnirl.recipe import config_for, load_recipe
from omnirl.step import combine, summarise


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


def test_group_advantages_unclamped_for_flow_dppo(tmp_path):
    """Flow-DPPO's references (UniRL, VeRL-Omni) clamp no advantage. One success in a group of 48: mean
    1/48, population std sqrt(47) / 48, so A = (47/48) / (sqrt(47)/48 + 1e-4) = 6.85 (clamped at the
    default adv_clip 5 it would be 5.00); the failures keep -(1/48) / std = -0.146. The DPPO recipes leave
    them unclamped."""
    rewards, groups = torch.tensor([1.0] + [0.0] * 47), torch.zeros(48, dtype=torch.long)
    adv, keep, metrics = group_advantages(rewards, groups, adv_clip=None, global_std=False)
    std = math.sqrt(47) / 48 + 1e-4
    assert adv[0].item() == pytest.approx((47 / 48) / std) and adv[0].item() == pytest.approx(
        6.8509, abs=1e-4
    )
    assert adv[1].item() == pytest.approx(-(1 / 48) / std) and metrics["adv/clip_frac"] == 0.0
    clamped, _, _ = group_advantages(rewards, groups, adv_clip=5.0, global_std=False)
    assert clamped[0].item() == 5.0
    for name in ("qwen_image_flowdppo_ocr", "qwen_image_tiny_flowdppo"):
        assert load_recipe(name)[0].algo.adv_clip is None, name
    nft = load_recipe("sd3_tiny_nft")[0]
    nft.algo.adv_clip = None  # NFT maps A to A / (2 adv_clip) + 0.5: it needs the bound
    nft.model.path = str(tmp_path)  # a folder that exists, whatever tiny models the tree holds
    with pytest.raises(ConfigError, match="algo.adv_clip null: algo.loss diffusion_nft needs a number"):
        check_values(nft)


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
    loss, metrics = flow_grpo_loss(
        RowInputs(logprob, old, adv, weights), AlgoConfig(clip_range=0.2), normaliser=6
    )
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
    loss, metrics = flow_grpo_loss(
        RowInputs(logprob, old, adv, weights, kl=kl), AlgoConfig(clip_range=0.2, kl_beta=0.5), 5
    )
    assert loss.item() == pytest.approx((sum(POLICY[:5]) + 0.5 * 1.5) / 5)
    assert metrics["loss/kl_sum"] == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([0.1] * 5 + [0.0], dtype=torch.float64))


def test_zero_weight_rows_contribute_nothing():
    logprob, old, adv = _rows()
    ones = torch.ones(6, dtype=torch.float64)
    ref, ref_metrics = flow_grpo_loss(RowInputs(logprob, old, adv, ones), AlgoConfig(clip_range=0.2), 6)
    ref.backward()
    ref_grad = logprob.grad.clone()
    # Append three padding rows (copies of real rows, with large values) of weight 0.
    pad_lp, pad_old, pad_adv = _rows(ratio=[3.0, 0.1, 1.0], adv=[50.0, -50.0, 7.0])
    lp = torch.cat([logprob.detach(), pad_lp.detach()]).requires_grad_()
    weights = torch.cat([ones, torch.zeros(3, dtype=torch.float64)])
    padded = RowInputs(lp, torch.cat([old, pad_old]), torch.cat([adv, pad_adv]), weights)
    loss, metrics = flow_grpo_loss(padded, AlgoConfig(clip_range=0.2), 6)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert metrics == pytest.approx(ref_metrics, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad[:6], ref_grad)
    assert (lp.grad[6:] == 0).all()


def test_micro_batches_with_global_normaliser_sum_to_one_batch():
    logprob, old, adv = _rows()
    kl = torch.linspace(0.0, 1.0, 6, dtype=torch.float64)
    ones = torch.ones(6, dtype=torch.float64)
    algo = AlgoConfig(clip_range=0.2, kl_beta=0.1)
    whole, _ = flow_grpo_loss(RowInputs(logprob, old, adv, ones, kl=kl), algo, normaliser=6)
    whole.backward()
    whole_grad = logprob.grad.clone()
    logprob.grad = None
    # Two micro-batches of 4 and 2 real rows, the second padded to 4 with zero-weight rows.
    pad = torch.arange(4) % 2
    first, _ = flow_grpo_loss(RowInputs(logprob[:4], old[:4], adv[:4], ones[:4], kl=kl[:4]), algo, 6)
    idx = torch.cat([torch.tensor([4, 5]), pad[:2]])
    w = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    second, _ = flow_grpo_loss(RowInputs(logprob[idx], old[idx], adv[idx], w, kl=kl[idx]), algo, 6)
    (first + second).backward()
    torch.testing.assert_close(first + second, whole)
    torch.testing.assert_close(logprob.grad, whole_grad)
    # ... and the loss is the mean over pairs.
    assert whole.item() == pytest.approx((sum(POLICY) + 0.1 * kl.sum().item()) / 6)


def test_get_loss():
    assert get_loss("flow_grpo") is flow_grpo_loss
    assert get_loss("flow_dppo", "diffusion") is flow_dppo_loss
    assert get_loss("diffusion_nft", "diffusion") is diffusion_nft_loss
    assert get_loss("dgpo", "diffusion") is dgpo_loss
    assert {"flow_grpo", "flow_dppo", "diffusion_nft", "dgpo", "grpo", "gspo"} <= set(LOSSES)
    with pytest.raises(
        ValueError, match="unknown algo.loss 'ppo'; known losses: dgpo, diffusion_nft, flow_dppo"
    ):
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


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_kl_forms_by_hand(sde_type):
    """flow_grpo's KL term divides by 2 s_t^2, s_t = a sqrt(sigma / (1 - sigma)) before sqrt(|dt|); the
    exact Gaussian KL by the step's variance s_t^2 |dt|. One SDE step from sigma 0.5 to 0.25, a = 0.7:
    s_t = 0.7 sqrt(0.5 / 0.5) = 0.7, std = 0.7 * sqrt(0.25) = 0.35; means 0.1 apart in every dim:
    flow_grpo 0.01 / (2 * 0.49), exact 0.01 / (2 * 0.1225), 1 / |dt| = 4 times more. CPS: std =
    0.25 sin(0.35 pi), and both forms are the one Gaussian KL."""
    x = torch.zeros(2, 3, 2, 2)
    out = flow_step(x, x, torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25]), 0.9, 0.7, sde_type)
    mean_ref = out.mean - 0.1
    grpo_form, exact = flow_kl(out.mean, mean_ref, out.std_dev_t), flow_kl(out.mean, mean_ref, out.std)
    if sde_type == "sde":
        torch.testing.assert_close(out.std_dev_t, torch.tensor([0.7, 0.7]))
        torch.testing.assert_close(out.std, torch.tensor([0.35, 0.35]))
        torch.testing.assert_close(grpo_form, torch.full((2,), 0.01 / 0.98))
        torch.testing.assert_close(exact, torch.full((2,), 0.01 / 0.245))
    else:
        std = 0.25 * math.sin(0.35 * math.pi)
        torch.testing.assert_close(out.std, torch.full((2,), std))
        torch.testing.assert_close(grpo_form, exact)
        torch.testing.assert_close(exact, torch.full((2,), 0.01 / (2 * std**2)))
    assert config_for("sd3").algo.kl_form == "flow_grpo"  # published kl_beta values mean what they say


def test_dance_sde_kl_is_the_gaussian_kl_by_hand():
    """Under dance_sde the KL term is VeRL-Omni's for its dance step: mean((mu - mu_ref)^2) / (2 s^2) with
    s the step's whole std eta sqrt(sigma - sigma_next) (the std_dev_t its dance step returns), so both
    forms are the Gaussian KL. One step from sigma 0.5 to 0.25, eta 1.2: s = 1.2 * 0.5 = 0.6; means 0.1
    apart: 0.01 / (2 * 0.36) = 0.013889 (dividing by eta^2 alone would give 0.01 / 2.88, 4x less)."""
    x = torch.zeros(2, 3, 2, 2)
    out = flow_step(x, x, torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25]), 0.9, 1.2, "dance_sde")
    mean_ref = out.mean - 0.1
    torch.testing.assert_close(out.std, torch.tensor([0.6, 0.6]))
    for form in (out.std_dev_t, out.std):
        torch.testing.assert_close(flow_kl(out.mean, mean_ref, form), torch.full((2,), 0.01 / 0.72))


# DPPO rows: (A, ratio, divergence D) around tau = 1e-5. A row is masked when D >= tau and its ratio moved
# with its advantage (A > 0, r > 1 or A < 0, r < 1).
DPPO_ADV = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0, 0.0]
DPPO_RATIO = [1.5, 1.5, 0.5, 0.5, 0.5, 1.5, 2.0]
DPPO_D = [2e-5, 1e-6, 2e-5, 1e-5, 5e-6, 3e-5, 1.0]
DPPO_MASK = [True, False, False, True, False, False, False]


def test_flow_dppo_loss_and_mask_by_hand():
    lp, old, adv = _rows(ratio=DPPO_RATIO, adv=DPPO_ADV)
    divergence = torch.tensor(DPPO_D, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1.0] * 6 + [0.0], dtype=torch.float64)  # the last row pads
    loss, m = flow_dppo_loss(
        RowInputs(lp, old, adv, weights, divergence=divergence),
        AlgoConfig(flow_dppo=FlowDPPOConfig(tau=1e-5)),
        6,
    )
    # -A r of the unmasked real rows, summed, over 6: rows 1, 2, 4, 5.
    unmasked = [-a * r for a, r, msk in zip(DPPO_ADV[:6], DPPO_RATIO[:6], DPPO_MASK[:6]) if not msk]
    assert unmasked == [-3.0, -1.0, 0.5, 1.5]
    assert loss.item() == pytest.approx(sum(unmasked) / 6)
    loss.backward()
    expected = [0.0 if msk else -a * r / 6 for a, r, msk in zip(DPPO_ADV, DPPO_RATIO, DPPO_MASK)]
    expected[6] = 0.0
    torch.testing.assert_close(lp.grad, torch.tensor(expected, dtype=torch.float64))
    assert divergence.grad is None  # the mask carries no gradient
    assert m["loss/count"] == 6 and m["loss/clip_count"] == 2 == m["dppo/mask_count"]
    assert m["dppo/mask_pos_count"] == 1 and m["dppo/mask_neg_count"] == 1
    assert m["dppo/kl_new_old_sum"] == pytest.approx(sum(DPPO_D[:6]))
    assert m["dppo/kl_new_old_max"] == pytest.approx(3e-5)  # the padding row's D = 1 does not count
    assert m["loss/ratio_sum"] == pytest.approx(sum(DPPO_RATIO[:6]))
    # Over micro-batches and ranks: maxima combine by max, sums add; then the logged means and fractions.
    assert combine("dppo/kl_new_old_max", 3e-5, 1e-5) == 3e-5 and combine("loss/count", 6.0, 2.0) == 8.0
    logged = summarise({**m, "train/skipped_nonfinite": 0.0}, 1)
    assert logged["loss/clip_frac"] == pytest.approx(2 / 6) and logged["dppo/mask_pos_frac"] == pytest.approx(
        1 / 6
    )
    assert logged["dppo/kl_new_old"] == pytest.approx(sum(DPPO_D[:6]) / 6)
    assert logged["dppo/kl_new_old_max"] == pytest.approx(3e-5) and logged["loss/kl"] == 0.0


def test_diffusion_nft_loss_by_hand():
    """Two rows of 2 latent dims. Row 0: t 0.5, target (1, -1), v_old 0, v (2, 0), beta 0.5, A 2.5 of clip 5:
    v+ = (1, 0), v- = (-1, 0); x0 errors e+ = 0.5 ((1, -1) - (1, 0)) = (0, -0.5): mean e^2 0.125 over mean|e|
    0.25 = 0.5; e- = 0.5 ((1, -1) - (-1, 0)) = (1, -0.5): 0.625 / 0.75 = 5/6; r = 2.5 / 10 + 0.5 = 0.75;
    policy = 5 / 0.5 * (0.75 * 0.5 + 0.25 * 5/6) = 35/6. Row 1: t 1, target (0, 2), v = v_old = (0, 1),
    A -5: r 0, v+ = v- = v: e = (0, 1): 0.5 / 0.5 = 1, policy = 10 * 1 = 10."""
    v = torch.tensor([[2.0, 0.0], [0.0, 1.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 0.0], [0.0, 1.0]])
    target = torch.tensor([[1.0, -1.0], [0.0, 2.0]])
    t, adv, w = torch.tensor([0.5, 1.0]), torch.tensor([2.5, -5.0]), torch.ones(2)
    nft = AlgoConfig(diffusion_nft=DiffusionNFTConfig(beta=0.5), adv_clip=5.0)
    loss, m = diffusion_nft_loss(NFTInputs(v, v_old, target, t, adv, w), nft, normaliser=2)
    assert loss.item() == pytest.approx((35 / 6 + 10) / 2)
    assert m["nft/positive_sum"] == pytest.approx(0.5 + 1.0) and m["nft/negative_sum"] == pytest.approx(
        5 / 6 + 1
    )
    assert m["nft/old_deviate_sum"] == pytest.approx((4 + 0) / 2) and m["loss/count"] == 2
    loss.backward()
    # Row 1 (r = 0): 10 * mean(e-^2) / 0.5 with e- = t (target - (1 + beta) v_old + beta v), de-/dv = +0.5:
    # the gradient is 10 * (2 e / 2) * 0.5 / 0.5 = (0, 10), over the normaliser 2.
    torch.testing.assert_close(v.grad[1], torch.tensor([0.0, 5.0]))
    # Row 0: de+/dv = -t beta = -0.25, de-/dv = +0.25. Dim 0: e+ = 0 and e- = 1: 10 * 0.25 * (1 * 0.25 / 0.75)
    # = 5/6; dim 1: e+ = e- = -0.5: 10 * (0.75 * (-0.5 * -0.25 / 0.25) + 0.25 * (-0.5 * 0.25 / 0.75)) = 10/3;
    # over the normaliser 2. Both push v (2, 0) towards the target (1, -1).
    torch.testing.assert_close(v.grad[0], torch.tensor([5 / 12, 5 / 3]))
    # With v_old = v everywhere the loss is the plain regression of v on the target, whatever r.
    same, _ = diffusion_nft_loss(NFTInputs(v_old, v_old, target, t, adv, w), nft, 2)
    plain = [(5 / 0.5) * ((0.5**2 * (1 + 1) / 2) / (0.5 * 1)), 10 * ((0.0 + 1.0) / 2) / 0.5]
    assert same.item() == pytest.approx(sum(plain) / 2)


def _reference_dgpo(model_v, ref_v, target_v, adv, group_ids, beta, group_size):
    """DGPO's loss at one time as its reference computes it (Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py,
    `compute_group_dgpo_loss_allreduce` on one process): each group's weight is the sigmoid of the sum
    over its rows of A beta (dsm - dsm_ref) / group_size, detached, and the loss the batch mean of
    weight * A * dsm."""
    batch = model_v.shape[0]
    dsm = (target_v - model_v).square().reshape(batch, -1).mean(dim=1)
    ref_dsm = (target_v - ref_v).square().reshape(batch, -1).mean(dim=1)
    term = adv * beta * (dsm.detach() - ref_dsm.detach()) / group_size
    sums = torch.zeros(int(group_ids.max()) + 1, dtype=term.dtype).scatter_add_(0, group_ids, term)
    weights = torch.sigmoid(sums)[group_ids]
    return (weights.detach() * adv * dsm).mean()


@pytest.mark.parametrize("kl_beta", [0.0, 0.02])
def test_dgpo_loss_equals_its_reference_over_micro_batches(kl_beta):
    """Three groups of 4 rows, split over two micro-batches plus a padding row: the group weights from the
    margins summed over all of a group's rows, the loss summed over micro-batches, and its gradient equal
    the reference's batch mean (plus its KL term kl_beta * mean (v - v_ref)^2 when kl_beta > 0)."""
    gen = torch.Generator().manual_seed(0)
    groups, size, shape, beta = 3, 4, (2, 4, 4), 100.0
    n = groups * size
    group_ids = torch.arange(groups).repeat_interleave(size)
    target = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    ref_v = target + 0.3 * torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    base = ref_v + 0.05 * torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64).clamp(-5, 5)

    ref_v_grad = base.clone().requires_grad_(True)
    expected = _reference_dgpo(ref_v_grad, ref_v, target, adv, group_ids, beta, size)
    if kl_beta:
        expected = expected + kl_beta * (ref_v_grad - ref_v).square().reshape(n, -1).mean(dim=1).mean()
    expected.backward()

    ours_v = base.clone().requires_grad_(True)
    margins = dgpo_margin(ours_v, ref_v, target, adv, beta, size)
    weight = torch.sigmoid(torch.zeros(groups, dtype=torch.float64).index_add(0, group_ids, margins.double()))
    algo = AlgoConfig(loss="dgpo", kl_beta=kl_beta)
    order = torch.randperm(n, generator=gen)  # micro-batches that split every group
    total = torch.zeros((), dtype=torch.float64)
    for idx in (order[:5], order[5:]):
        inputs = DGPOInputs(
            ours_v[idx],
            target[idx],
            adv[idx],
            weight[group_ids[idx]],
            torch.ones(len(idx)),
            ref_velocity=ref_v[idx],
        )
        loss, metrics = dgpo_loss(inputs, algo, float(n))
        loss.backward()
        total = total + loss.detach()
        assert metrics["loss/count"] == len(idx)
    # A padding row (weight 0) adds nothing, to the loss or the gradient.
    pad = DGPOInputs(ours_v[:1], target[:1], adv[:1], weight[:1], torch.zeros(1), ref_velocity=ref_v[:1])
    pad_loss, _ = dgpo_loss(pad, algo, float(n))
    pad_loss.backward()
    assert pad_loss.item() == 0
    assert torch.allclose(total.float(), expected.detach().float(), rtol=1e-6, atol=1e-9), (total, expected)
    assert ours_v.grad is not None and ref_v_grad.grad is not None
    assert torch.allclose(ours_v.grad, ref_v_grad.grad, rtol=1e-5, atol=1e-10)
    assert 0 < weight.min() < weight.max() < 1  # the groups' weights differ: the sums are per group


def test_dgpo_refuses_more_times_than_steps():
    from omnirl.algos.losses import check_dgpo

    with pytest.raises(ConfigError, match="algo.dgpo.timesteps"):
        check_dgpo(AlgoConfig(loss="dgpo", dgpo=DGPOConfig(timesteps=8, max_step=6)))
