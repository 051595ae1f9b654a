"""The flow-matching step: SDE log-prob is a Gaussian log-density, noise 0 is the ODE step, CPS as defined."""

import math

import pytest
import torch

from omnirl.models.flow_sde import flow_step

torch.manual_seed(0)
B, SHAPE = 3, (4, 6, 6)
SIGMAS = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.0])


def inputs():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(B, *SHAPE, generator=g)
    x = torch.randn(B, *SHAPE, generator=g)
    noise = torch.randn(B, *SHAPE, generator=g)
    step = torch.tensor([0, 1, 3])  # rows at different steps, the first at sigma == 1
    return v, x, noise, SIGMAS[step], SIGMAS[step + 1]


def test_sde_logprob_is_independent_gaussian_density():
    v, x, noise, s, sn = inputs()
    a = 0.7
    out = flow_step(v, x, s, sn, float(SIGMAS[1]), a, "sde", noise=noise)
    for i in range(B):
        si, sni = s[i].item(), sn[i].item()
        dt = sni - si
        std_dev_t = a * math.sqrt(si / (1 - (SIGMAS[1].item() if si == 1 else si)))
        mean = (
            x[i] * (1 + std_dev_t**2 / (2 * si) * dt) + v[i] * (1 + std_dev_t**2 * (1 - si) / (2 * si)) * dt
        )
        std = std_dev_t * math.sqrt(-dt)
        ref = torch.distributions.Normal(mean.double(), std).log_prob(out.prev_sample[i].double()).mean()
        assert torch.allclose(out.prev_sample[i], mean + std * noise[i], atol=1e-6)
        assert abs(out.logprob[i].item() - ref.item()) < 1e-5
        assert abs(out.std[i].item() - std) < 1e-6


def test_scoring_a_stored_sample_gives_the_same_logprob():
    v, x, noise, s, sn = inputs()
    out = flow_step(v, x, s, sn, float(SIGMAS[1]), 0.7, "sde", noise=noise)
    again = flow_step(v, x, s, sn, float(SIGMAS[1]), 0.7, "sde", prev_sample=out.prev_sample)
    assert torch.equal(out.logprob, again.logprob)
    # a sample far from the mean is less likely
    worse = flow_step(v, x, s, sn, float(SIGMAS[1]), 0.7, "sde", prev_sample=out.prev_sample + 1)
    assert (worse.logprob < out.logprob).all()


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_level_zero_is_the_ode_step(sde_type):
    v, x, noise, s, sn = inputs()
    out = flow_step(v, x, s, sn, float(SIGMAS[1]), 0.0, sde_type, noise=noise)
    ode = x + (sn - s).reshape(-1, 1, 1, 1) * v
    assert torch.equal(out.prev_sample, ode)
    assert torch.equal(flow_step(v, x, s, sn, 0.9, 0.7, "ode", noise=noise).prev_sample, ode)
    assert torch.equal(out.logprob, torch.zeros(B))


def test_small_noise_sde_is_close_to_ode():
    v, x, noise, s, sn = inputs()
    ode = flow_step(v, x, s, sn, 0.9, 0.0, "sde").prev_sample
    near = flow_step(v, x, s, sn, 0.9, 1e-4, "sde", noise=noise).prev_sample
    assert (near - ode).abs().max() < 1e-3


def test_cps_step_as_defined():
    v, x, noise, s, sn = inputs()
    a = 0.5
    out = flow_step(v, x, s, sn, 0.9, a, "cps", noise=noise)
    for i in range(B):
        si, sni = s[i].item(), sn[i].item()
        std = sni * math.sin(a * math.pi / 2)
        x0, x1 = x[i] - si * v[i], x[i] + (1 - si) * v[i]
        mean = (1 - sni) * x0 + math.sqrt(sni**2 - std**2) * x1
        assert torch.allclose(out.prev_sample[i], mean + std * noise[i], atol=1e-6)
        assert abs(out.logprob[i].item() + ((out.prev_sample[i] - mean) ** 2).mean().item()) < 1e-6


def test_unknown_sde_type():
    v, x, noise, s, sn = inputs()
    with pytest.raises(ValueError, match="sde_type"):
        flow_step(v, x, s, sn, 0.9, 0.7, "euler")


def test_dance_sde_logprob_is_independent_gaussian_density():
    v, x, noise, s, sn = inputs()
    eta = 1.2
    out = flow_step(v, x, s, sn, float(SIGMAS[1]), eta, "dance_sde", noise=noise)
    for i in range(B):
        si, sni = s[i].item(), sn[i].item()
        x0_hat = x[i] - si * v[i]
        score = -(x[i] - (1 - si) * x0_hat) / si**2
        mean = x[i] + (sni - si) * v[i] - 0.5 * eta**2 * score * (sni - si)
        std = eta * math.sqrt(si - sni)
        ref = torch.distributions.Normal(mean.double(), std).log_prob(out.prev_sample[i].double()).mean()
        assert torch.allclose(out.prev_sample[i], mean + std * noise[i], atol=1e-5)
        assert abs(out.logprob[i].item() - ref.item()) < 1e-5
        assert abs(out.std[i].item() - std) < 1e-6
    assert torch.isfinite(out.logprob).all()  # row 0 sits at sigma == 1
    # Scoring the stored sample gives the same log-prob; noise level 0 is the ODE step.
    again = flow_step(v, x, s, sn, float(SIGMAS[1]), eta, "dance_sde", prev_sample=out.prev_sample)
    assert torch.allclose(again.logprob, out.logprob, atol=1e-6)
    ode = flow_step(v, x, s, sn, float(SIGMAS[1]), 0.0, "dance_sde", noise=noise)
    assert torch.equal(ode.prev_sample, x + (sn - s).reshape(-1, 1, 1, 1) * v)
