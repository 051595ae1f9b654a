"""The flow-matching step: SDE log-prob is a Gaussian log-density, noise 0 is the ODE step, CPS as defined."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from omnirl.config_checks import check_values
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import (
    WindowedSampler,
    compressed_schedule,
    dpm2_coefficients,
    flow_step,
    sliding_window,
    window,
)
from omnirl.ops.diffusion import DiffusionOps, sampling_params
from omnirl.recipe import config_for

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


def window_requests(n: int, size: int, window_range, steps: int = 10, **params) -> list[Request]:
    p = SamplingParams(8, 8, steps, 1.0, 0.7, "sde", size, window_range, **params)
    return [Request("p", i, i, derive_seed(5, 0, i), p) for i in range(n)]


def run_sampler(requests, steps: int):
    """A denoising loop with a made-up velocity (v = 0.3 x + 0.1): the sampler's own rules, no model."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    sampler = WindowedSampler(requests, (2, 3), sigmas, "cpu")
    x = sampler.initial_latents
    for i in range(steps):
        v = 0.3 * x + 0.1
        before = x
        x = sampler.step(i, v, x)
    return sampler, [sampler.record(b) for b in range(len(requests))], before, x, sigmas


def test_window_zero_trains_every_step_but_the_last():
    """Size 0: steps 0 .. T-2 (flow_grpo's int(0.99 T) = 9 of 10); the last step, to sigma 0, is the ODE
    step and records nothing."""
    sampler, records, before, final, sigmas = run_sampler(window_requests(3, 0, (0, 1)), steps=10)
    for r in records:
        assert r["step_indices"].tolist() == list(range(9))
        assert r["latents"].shape == (9, 2, 3) and (r["logprobs"] != 0).all()
    # The last step is x + (0 - sigma_9) v exactly.
    torch.testing.assert_close(final, before + (0.0 - sigmas[9]) * (0.3 * before + 0.1))
    assert window(10, 0, (0, 1)) == (9, 0, 0)
    with pytest.raises(ValueError, match="sampling.num_steps 1 leaves none"):
        window(1, 0, (0, 1))


def test_window_stays_inside_its_range():
    """W = 2 in [0, 5) starts in 0 .. 3, so it never trains step 5 (or 4 as a first step); each request's
    start is its generator's draw right after its initial latents, randint(lo, hi - W + 1)."""
    requests = window_requests(64, 2, (0, 5))
    _, records, _, _, _ = run_sampler(requests, steps=10)
    starts = [int(r["step_indices"][0]) for r in records]
    assert set(starts) == {0, 1, 2, 3}
    assert max(int(r["step_indices"][-1]) for r in records) == 4
    for req, start in zip(requests[:4], starts):
        g = torch.Generator().manual_seed(req.seed)
        torch.randn(2, 3, generator=g)
        assert start == int(torch.randint(0, 4, (1,), generator=g))
    assert window(10, 2, (0, 5)) == (2, 0, 3) and window(10, 3, (2, 5)) == (3, 2, 2)
    for size, rng in ((6, (0, 5)), (2, (4, 11)), (2, (-1, 3))):
        with pytest.raises(ValueError, match=r"sampling.sde_window_range .* sampling.sde_window_size"):
            window(10, size, rng)


def test_record_mean_and_validation_records():
    """record_mean keeps each trained step's mean, the Gaussian's centre: x' = mean + std * noise; a rollout
    recording no log-probs (validation) has no window and records nothing."""
    requests = window_requests(2, 2, (0, 4), steps=4, record_mean=True)
    _, records, _, _, sigmas = run_sampler(requests, steps=4)
    for r in records:
        k = r["step_indices"]
        v = 0.3 * r["latents"] + 0.1
        out = flow_step(
            v,
            r["latents"],
            sigmas[k],
            sigmas[k + 1],
            float(sigmas[1]),
            0.7,
            "sde",
            prev_sample=r["next_latents"],
        )
        torch.testing.assert_close(r["means"], out.mean)
        torch.testing.assert_close(r["logprobs"], out.logprob)
    _, records, _, _, _ = run_sampler(window_requests(2, 2, (0, 9), steps=4, record_logprobs=False), steps=4)
    assert all(r["latents"].shape[0] == 0 and r["means"] is None for r in records)
    assert records[0]["step_indices"].dtype == torch.int64


def reference_windows(
    num_steps: int, size: int, interval: int, stride: int, rl_steps: int
) -> list[list[int]]:
    """MixGRPO's progressive strategy as its GRPOTrainingStates runs it (prog_overlap, roll_back), written
    out by hand: the window of each RL step is range(cur, min(cur + size, T - 2)); cur moves by the stride
    every `interval` RL steps and goes back to 0 once it exceeds T - 2."""
    top, cur, count, out = num_steps - 2, 0, 0, []
    for _ in range(rl_steps):
        out.append(list(range(cur, min(cur + size, top))))
        count += 1
        if count >= interval:
            count, cur = 0, cur + stride
        if cur > top:
            cur, count = 0, 0
    return out


def test_sliding_window_schedule_by_hand():
    """MixGRPO's windows over whole periods: W 4 over T = 25 steps trains in [0, 23) (never steps 23 and
    24), shrinking to 3, 2, 1 steps at the end; the reference then spends one period on an empty window
    (start 23), which is skipped here, so a period is 23 windows, not 24."""
    ours = [sliding_window(step, 4, (0, 23), 1, 1) for step in range(2 * 23)]
    assert ours[:23] == [(s, 4) for s in range(20)] + [(20, 3), (21, 2), (22, 1)] and ours[23:] == ours[:23]
    ref = [w for w in reference_windows(25, 4, 1, 1, 2 * 24) if w]  # the empty periods dropped
    assert [list(range(start, start + size)) for start, size in ours] == ref
    # Every 20 RL steps (MixGRPO-Flash's iters_per_group), stride 2: the same rule, period by period.
    ours = [sliding_window(step, 4, (0, 23), 20, 2) for step in range(2 * 12 * 20)]
    ref = [w for w in reference_windows(25, 4, 20, 2, 2 * 12 * 20) if w]
    assert [list(range(start, start + size)) for start, size in ours] == ref
    assert ours[11 * 20] == (22, 1) and ours[12 * 20] == (0, 4)
    # The step's requests all share that window.
    cfg = config_for("sd3")
    s = cfg.sampling
    s.num_steps, s.sde_window_size, s.sde_window_range = 6, 2, (0, 5)
    s.sde_window_schedule, s.sde_window_shift_interval, s.sde_window_stride = "sliding", 3, 2
    ops = SimpleNamespace(cfg=cfg, params=sampling_params(cfg))
    assert [DiffusionOps.step_params(ops, step).sde_window_range for step in (0, 3, 6, 9)] == [
        (0, 2), (2, 4), (4, 5), (0, 2),
    ]  # fmt: skip
    params = DiffusionOps.step_params(ops, 7)
    assert params.sde_window_size == 1
    requests = [Request("p", i, i, derive_seed(1, 4, i), params) for i in range(5)]
    sampler = WindowedSampler(requests, (2, 3), torch.linspace(1, 0, 7), "cpu")
    assert sampler.step_indices.tolist() == [[4]] * 5


def test_dpm2_after_the_window_by_hand():
    """Sigmas 1, 0.75, 0.5, 0.25, 0 and a window of 1 at step 0. Step 1 follows sigma 1 (lambda = -inf):
    first order, the Euler step. Step 2, lambdas log(1/3), 0, log(3): h = log 3, r = 1,
    -alpha' (e^-h - 1) = 0.75 * 2/3 = 0.5, so x' = 0.5 x + 0.5 (1 + 1/2) x0 - 0.5 / 2 x0_prev
    = 0.5 x + 0.75 x0 - 0.25 x0_prev (exact on a straight path: x0 = x0_prev = c, x = (1 - s) c + s n).
    Step 3 ends at sigma 0: Euler again."""
    assert dpm2_coefficients(0.75, 0.5, 0.25) == pytest.approx((0.5, 0.75, -0.25))
    requests = window_requests(1, 1, (0, 1), steps=4, ode_solver="dpm2")
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    sampler = WindowedSampler(requests, (2, 3), sigmas, "cpu")
    x = sampler.initial_latents
    xs = [x]
    for i in range(4):
        x = sampler.step(i, 0.3 * x + 0.1, x)
        xs.append(x)
    v = [0.3 * y + 0.1 for y in xs]
    torch.testing.assert_close(xs[2], xs[1] - 0.25 * v[1])  # Euler
    x0_1, x0_2 = xs[1] - 0.75 * v[1], xs[2] - 0.5 * v[2]
    torch.testing.assert_close(xs[3], 0.5 * xs[2] + 0.75 * x0_2 - 0.25 * x0_1)
    torch.testing.assert_close(xs[4], xs[3] - 0.25 * v[3])  # Euler to sigma 0
    # A noise-free rollout (the deterministic sampler) takes dpm2 at every step, its window's included.
    requests = window_requests(1, 1, (0, 1), steps=4, ode_solver="dpm2")
    requests[0].params = dataclasses.replace(requests[0].params, noise_level=0.0, sde_type="ode")
    sampler = WindowedSampler(requests, (2, 3), sigmas, "cpu")
    xs = [sampler.initial_latents]
    for i in range(4):
        xs.append(sampler.step(i, 0.3 * xs[-1] + 0.1, xs[-1]))
    v = [0.3 * y + 0.1 for y in xs]
    x0_1, x0_2 = xs[1] - 0.75 * v[1], xs[2] - 0.5 * v[2]
    torch.testing.assert_close(xs[1], xs[0] - 0.25 * v[0])
    torch.testing.assert_close(xs[3], 0.5 * xs[2] + 0.75 * x0_2 - 0.25 * x0_1)
    # Per row only: a packed batch of rows with their own windows equals each row run alone.
    requests = window_requests(4, 2, (0, 6), steps=8, ode_solver="dpm2")
    _, packed, _, final, _ = run_sampler(requests, steps=8)
    for b, req in enumerate(requests):
        _, alone, _, final_alone, _ = run_sampler([req], steps=8)
        torch.testing.assert_close(final[b], final_alone[0])
        torch.testing.assert_close(packed[b]["next_latents"], alone[0]["next_latents"])


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


def test_dance_grpo_samples_every_step_and_trains_a_random_subset_by_hand():
    """DanceGRPO (sde_window_schedule dance): every step but the last takes the SDE step, and the trained
    steps are a random subset of the range. Written out by hand for 6 steps, a subset of 3 in [0, 5): each
    request's generator draws its initial latents, the subset (randperm(5)[:3], sorted), then one noise
    per step 0..4; the last step is the Euler step to sigma 0 (DanceGRPO decodes that x0 prediction)."""
    steps = 6
    requests = window_requests(6, 3, (0, 5), steps=steps, sde_window_schedule="dance")
    _, records, _, final, sigmas = run_sampler(requests, steps=steps)
    subsets = []
    for req, rec, fin in zip(requests, records, final):
        g = torch.Generator().manual_seed(req.seed)
        x = torch.randn(2, 3, generator=g)
        subset = sorted(int(j) for j in torch.randperm(5, generator=g)[:3])
        subsets.append(subset)
        xs = [x]
        for i in range(steps - 1):  # noise at every step but the last
            noise = torch.randn(2, 3, generator=g)
            sig = (sigmas[i : i + 1], sigmas[i + 1 : i + 2])
            x = flow_step(0.3 * x[None] + 0.1, x[None], *sig, float(sigmas[1]), 0.7, "sde", noise=noise[None])
            x = x.prev_sample[0]
            xs.append(x)
        x = x + (0.0 - sigmas[steps - 1]) * (0.3 * x + 0.1)
        torch.testing.assert_close(fin, x)
        assert rec["step_indices"].tolist() == subset
        torch.testing.assert_close(rec["latents"], torch.stack([xs[k] for k in subset]))
        torch.testing.assert_close(rec["next_latents"], torch.stack([xs[k + 1] for k in subset]))
        assert (rec["logprobs"] != 0).all()
    assert any(s != list(range(s[0], s[0] + 3)) for s in subsets), subsets  # not windows
    # Packed equals serial, and the range may not reach the last step.
    for b, req in enumerate(requests[:3]):
        _, alone, _, final_alone, _ = run_sampler([req], steps=steps)
        torch.testing.assert_close(final[b], final_alone[0])
    cfg = config_for("sd3")
    s = cfg.sampling
    s.num_steps, s.sde_window_size, s.sde_window_range, s.sde_window_schedule = 6, 3, (0, 6), "dance"
    with pytest.raises(ConfigError, match=r"sde_window_schedule dance: the last step \(5\) is the ODE step"):
        check_values(cfg)


def test_mixgrpo_flash_compressed_schedule_by_hand():
    """MixGRPO-Flash: after a window ending at step L the ODE runs on n = int(max(0.4 (T - L), 1)) points
    from sigma_{L+1} to 0, evenly spaced in unshifted time and shifted. T = 25, shift 3 (sigma = 3 t /
    (1 + 2 t) on t = 1 - i / 25), window 0..3: n = int(0.4 * 22) = 8 points from t = 0.84, so 4 + 7 = 11
    steps; a window ending at 21: 0.4 * 4 = 1.6 -> 1 point, which would end at sigma_22: one step to 0 is
    added."""
    t = torch.linspace(1, 0, 26, dtype=torch.float64)
    sigmas = (3 * t / (1 + 2 * t)).float()
    out = compressed_schedule(sigmas, 3, 0.4, 3.0)
    tail = torch.linspace(0.84, 0.0, 8, dtype=torch.float64)
    expected = torch.cat([sigmas[:5], (3 * tail / (1 + 2 * tail)).float()[1:]])
    assert len(out) == 12
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(
        compressed_schedule(sigmas, 21, 0.4, 3.0), torch.cat([sigmas[:23], torch.zeros(1)])
    )
    # The sampler runs it: 11 steps, the window's records unchanged (its sigmas are the schedule's).
    p = SamplingParams(
        8, 8, 25, 1.0, 0.7, "sde", 4, (0, 4), ode_solver="dpm2",
        sde_window_schedule="sliding_compressed", ode_compress_ratio=0.4,
    )  # fmt: skip
    requests = [Request("p", i, i, derive_seed(5, 0, i), p) for i in range(2)]
    sampler = WindowedSampler(requests, (2, 3), sigmas, "cpu", shift=3.0)
    assert sampler.num_steps == 11
    torch.testing.assert_close(sampler.host_sigmas, expected)
    x = sampler.initial_latents
    for i in range(sampler.num_steps):
        x = sampler.step(i, 0.3 * x + 0.1, x)
    assert sampler.step_indices.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.isfinite(x).all()
    cfg = config_for("sd3")
    cfg.sampling.ode_compress_ratio = 0.4
    with pytest.raises(ConfigError, match="ode_compress_ratio needs sampling.sde_window_schedule sliding"):
        check_values(cfg)


def test_subset_schedule_trains_random_steps_and_takes_the_ode_step_elsewhere():
    """sde_window_schedule subset (LTX-2's reference: 3 of the first 10 steps): each request's trained steps
    are a draw without replacement from the range, not contiguous for every request, and only they take
    the SDE step: the other steps are the ODE step (noise-free), as with a window."""
    requests = window_requests(8, 3, (0, 10), steps=12, sde_window_schedule="subset")
    sampler, records, _, _, sigmas = run_sampler(requests, 12)
    subsets = [r["step_indices"].tolist() for r in records]
    assert all(len(set(s)) == 3 and all(0 <= i < 10 for i in s) for s in subsets)
    assert any(s[-1] - s[0] > 2 for s in subsets) and len({tuple(s) for s in subsets}) > 1
    assert sampler.noisy == sampler.trained  # SDE on the trained steps alone
    for b, s in enumerate(subsets):  # each trained step's record is a noisy SDE step, its log-prob non-zero
        assert torch.all(records[b]["logprobs"] != 0)
        for k, i in enumerate(s):
            ode = records[b]["latents"][k] + (sigmas[i + 1] - sigmas[i]) * (
                0.3 * records[b]["latents"][k] + 0.1
            )
            assert (records[b]["next_latents"][k] - ode).abs().max() > 1e-3
