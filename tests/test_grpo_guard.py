"""GRPO-Guard against its reference's definition, and its tiny recipe end to end."""

import pytest
import torch

from omnirl.algos.losses import RowInputs, flow_kl, grpo_guard_loss
from omnirl.config import AlgoConfig


def reference_guard_loss(logp, old_logp, mean, old_mean, std_dev_t, sqrt_dt, adv, clip, beta, kl):
    """The reference training script's GRPO-Guard policy loss over one micro-batch of one denoising step,
    written out from its definition: sigma and sqrt_dt are the batch means, the bias is the mean over
    latent dims of the squared mean shift over 2 (sqrt_dt sigma)^2, the ratio is exp((log-ratio + bias)
    sqrt_dt sigma), the clipped objective is averaged over the batch and divided by sqrt_dt^2."""
    sigma, sdt = std_dev_t.mean(), sqrt_dt.mean()
    bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, mean.dim()))) / (2 * (sdt * sigma) ** 2)
    ratio = torch.exp((logp - old_logp + bias) * (sdt * sigma))
    policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)).mean() / sdt**2
    return policy + beta * kl.mean()


@pytest.mark.parametrize("clip", [1e-4, 0.2])
def test_grpo_guard_equals_its_reference(clip):
    """Loss and gradients (through the log-prob and the step mean) equal the reference's on a micro-batch of
    one denoising step; with the rows' weights and the global normaliser, as every row loss."""
    gen = torch.Generator().manual_seed(0)
    m, latent = 6, (4, 3, 3)
    mean_ref = torch.randn(m, *latent, generator=gen)
    old_mean = mean_ref + 0.05 * torch.randn(m, *latent, generator=gen)
    mean = (old_mean + 0.02 * torch.randn(m, *latent, generator=gen)).requires_grad_()
    logp = (torch.randn(m, generator=gen) * 0.01).requires_grad_()
    old_logp = torch.randn(m, generator=gen) * 0.01
    adv = torch.randn(m, generator=gen)
    sigma, next_sigma, noise_level = 0.6, 0.45, 0.7
    dt = abs(next_sigma - sigma)
    std_dev_t = torch.full((m,), noise_level * (sigma / (1 - sigma)) ** 0.5)
    std = std_dev_t * dt**0.5  # the step's standard deviation
    kl = flow_kl(mean, mean_ref, std_dev_t)  # flow_grpo's KL term, the reference's too
    algo = AlgoConfig(clip_range=clip, kl_beta=0.04)

    ours_loss, metrics = grpo_guard_loss(
        RowInputs(
            logp, old_logp, adv, torch.ones(m), kl=kl, divergence=flow_kl(mean, old_mean, std), std=std,
            dt=torch.full((m,), dt),
        ),
        algo,
        float(m),
    )  # fmt: skip
    ours = torch.autograd.grad(ours_loss, [logp, mean], retain_graph=True)
    ref_loss = reference_guard_loss(
        logp, old_logp, mean, old_mean, std_dev_t, torch.full((m,), dt**0.5), adv, clip, 0.04, kl
    )
    ref = torch.autograd.grad(ref_loss, [logp, mean])
    torch.testing.assert_close(ours_loss, ref_loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert metrics["loss/ratio_bias_sum"] > 0 and metrics["loss/count"] == m


def test_grpo_guard_ratio_is_centred():
    """Where the plain ratio's mean is below 1 (the bias of a shifted mean), RatioNorm's is back near 1."""
    gen = torch.Generator().manual_seed(1)
    m, d = 4000, 64
    std = torch.full((m,), 0.1)
    old_mean = torch.zeros(m, d)
    mean = old_mean + 0.03  # the policy moved its step mean
    x = old_mean + std[:, None] * torch.randn(m, d, generator=gen)  # the rollout's samples

    def logp(mu):
        return (-((x - mu) ** 2) / (2 * std[:, None] ** 2)).mean(dim=1)  # flow_grpo's mean over dims

    log_ratio = logp(mean) - logp(old_mean)
    plain = torch.exp(log_ratio)
    bias = flow_kl(mean, old_mean, std)
    normed = torch.exp((log_ratio + bias) * std)
    assert plain.mean() < 0.97
    assert abs(normed.mean().item() - 1) < 1e-3


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_the_tiny_grpo_guard_recipe_trains(tiny_sd3, tmp_path, monkeypatch):
    """The tiny recipe runs: the rollout records its step means, the update logs the bias, and the parity
    gate passes."""
    from omnirl.metrics import read_metrics
    from tests.test_health import ROOT, SMALL_RUN, train_main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out), "--run.steps", "2", *SMALL_RUN]
    assert train_main(["--recipe", "sd3_tiny_grpo_guard", *args, "--sampling.num_steps", "3"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["train/updates"] for r in rows] == [1, 1]
    assert rows[0]["loss/ratio_bias"] < 1e-12  # the first update's policy is the rollout's
    assert rows[1]["loss/ratio_bias"] > 0 and rows[1]["health/parity_gap"] < 1e-5
