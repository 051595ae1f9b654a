"""The flow-matching denoising step with its log-probability: ODE, SDE (Flow-GRPO) and CPS.

One place for this math; every adapter's denoising loop and the trainer call `flow_step`.
Conventions (those of the public Flow-GRPO / DanceGRPO / Flow-CPS references), all in fp32, with
sigma running from 1 (noise) to 0 (data) and the model predicting the velocity v = noise - x0:

- ODE:  x' = x + (sigma_next - sigma) * v.
- SDE (Flow-GRPO): dt = sigma_next - sigma (negative);
  std_dev_t = a * sqrt(sigma / (1 - sigma)), where at sigma == 1 the denominator uses the schedule's
  second sigma (`sigma_max`) instead, so a window may start at the first step;
  mean = x * (1 + std_dev_t^2 / (2 sigma) * dt) + v * (1 + std_dev_t^2 * (1 - sigma) / (2 sigma)) * dt;
  x' = mean + std_dev_t * sqrt(-dt) * noise; the log-prob is the Gaussian log-density of x' under
  N(mean, (std_dev_t * sqrt(-dt))^2), averaged (not summed) over all latent dims.
- CPS (coefficient-preserving): std = sigma_next * sin(a * pi / 2); x0 = x - sigma * v;
  x1 = x + (1 - sigma) * v; mean = (1 - sigma_next) * x0 + sqrt(sigma_next^2 - std^2) * x1;
  x' = mean + std * noise; its "log-prob" is -mean((x' - mean)^2) over latent dims (no normaliser).
- DanceGRPO (`dance_sde`): x0_hat = x - sigma * v; score = -(x - (1 - sigma) * x0_hat) / sigma^2;
  dsigma = sigma_next - sigma; mean = x + dsigma * v - 0.5 * eta^2 * score * dsigma;
  std = eta * sqrt(sigma - sigma_next); the log-prob is the Gaussian log-density averaged over latent dims
  (as the SDE's). Its std has no 1 / (1 - sigma), so it is stable at sigma = 1.
- Noise level a = 0 gives the ODE step exactly, and a log-prob of 0.

This is our own code because no library provides a flow-matching step with a log-density.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

SDE_TYPES = ("ode", "sde", "cps", "dance_sde")


@dataclass
class StepOut:
    prev_sample: torch.Tensor  # [B, *latent] the latents after the step
    logprob: torch.Tensor  # [B] mean over latent dims (0 for the ODE step or noise level 0)
    mean: torch.Tensor  # [B, *latent] the mean of the step's Gaussian
    std: torch.Tensor  # [B] its standard deviation (per element)


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def flow_step(
    velocity: torch.Tensor,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_max: float,
    noise_level: float,
    sde_type: str,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOut:
    """One denoising step for a batch, per-row sigmas.

    velocity, latents: [B, *latent]; sigma, sigma_next: [B]; sigma_max: the schedule's second sigma.
    Pass `noise` ([B, *latent], standard normal) to sample x', or `prev_sample` to score a stored x'
    (the trainer's recomputation). With neither, the step is taken without noise (the mean).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    v = velocity.float()
    x = latents.float()
    s = _expand(sigma.float(), x)
    s_next = _expand(sigma_next.float(), x)
    dt = s_next - s
    batch = x.shape[0]
    zero = torch.zeros(batch, dtype=torch.float32, device=x.device)

    if sde_type == "ode" or noise_level == 0:
        mean = x + dt * v
        out = mean if prev_sample is None else prev_sample.float()
        return StepOut(out, zero, mean, zero)

    if sde_type == "sde":
        denom = 1 - torch.where(s == 1, torch.full_like(s, sigma_max), s)
        std_dev_t = noise_level * torch.sqrt(s / denom)
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        std = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "dance_sde":
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)
    else:  # cps
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = (1 - s_next) * x0 + torch.sqrt(s_next**2 - std**2) * x1

    if prev_sample is None:
        prev_sample = mean if noise is None else mean + std * noise.float()
    prev_sample = prev_sample.float()
    dims = tuple(range(1, x.dim()))
    if sde_type in ("sde", "dance_sde"):
        logprob = (
            -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        ).mean(dim=dims)
    else:
        logprob = -((prev_sample - mean) ** 2).mean(dim=dims)
    return StepOut(prev_sample, logprob, mean, std.reshape(batch))


def phase(name: str):
    """A labelled range of a rollout (`omnirl/<name>`) for the torch profiler: the rollout benchmark's time
    breakdown (benchmarks/breakdown.py) sums the host and device time of each label. Free when no profiler
    runs. Labels: encode, noise, transformer, sde_step, vae_decode, to_host."""
    return torch.profiler.record_function(f"omnirl/{name}")


# One worker thread draws every sampler's step noise ahead of its denoising loop (`WindowedSampler`). Torch's
# CPU kernels release the GIL, so the draws run while the main thread launches the transformer's kernels.
_NOISE_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnirl-noise")


class WindowedSampler:
    """The per-request randomness of a packed denoising loop, and the SDE window of each row.

    Every adapter's loop uses it, so the rules live in one place. Each request's own generator (seeded
    from `request.seed`) draws, in this order: its initial latents, its window start (uniform in
    `sde_window_range`, clamped so the window fits), then the noise of each step inside its window. With
    `shared_initial_noise` the initial latents come from a generator seeded by `request.group_seed`
    instead (every sample of a group starts from the same latents, DanceGRPO's rule), and the request's
    own generator draws the rest. With `sde_window_random` the trained steps are `sde_window_size` steps
    drawn without replacement from `sde_window_range` (the original DanceGRPO's timestep subset) instead
    of a contiguous window. So a
    request's sample does not depend on the batch it runs in (packed == serial). Rows inside their window
    take `flow_step` with the request's SDE type and noise level and record (latents in, latents out, step,
    log-prob); rows outside take the ODE step and record nothing. Noise is drawn on the host, so samples
    do not depend on the device either.

    What this adds to a stock denoising loop must cost the device nothing: the step noise is drawn ahead on
    a worker thread (in each generator's own order, so the values are those of drawing it step by step)
    into pinned memory and copied without blocking; which rows a step trains is known from the window
    starts, so its row indices are copied to the device once, at the start; the records stay on the
    device in [B, K, ...] buffers and come to the host in one copy per buffer (`record`). No step waits for
    the device.
    """

    def __init__(self, requests: list, latent_shape: tuple[int, ...], sigmas: torch.Tensor, device):
        p = requests[0].params
        num_steps = p.num_steps
        self.size = p.sde_window_size or num_steps  # 0 = every step is trained
        lo, hi = p.sde_window_range
        if not 0 < self.size <= num_steps or (p.sde_window_size and not 0 <= lo < hi):
            raise ValueError(
                f"sde_window_size {p.sde_window_size} must be in [0, num_steps={num_steps}] and "
                f"sde_window_range {p.sde_window_range} a non-empty range [lo, hi) with lo >= 0"
            )
        self.params, self.shape, self.device = p, latent_shape, torch.device(device)
        pin = self.device.type != "cpu"  # pinned host memory: copies that do not block the host
        self.generators = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
        with phase("noise"):
            first = self.generators
            if p.shared_initial_noise:
                first = [torch.Generator("cpu").manual_seed(r.group_seed) for r in requests]
            initial = torch.stack([torch.randn(latent_shape, generator=g) for g in first])
            self.initial_latents = _to_device(initial, self.device, pin)  # [B, *latent]
        if p.sde_window_random:
            if not (p.sde_window_size and hi - lo >= self.size and hi <= num_steps):
                raise ValueError(
                    f"sde_window_random draws sde_window_size {p.sde_window_size} steps from "
                    f"sde_window_range {p.sde_window_range}"
                    f": it must hold that many, all below num_steps {num_steps}"
                )
            self.trained = [
                sorted(lo + int(j) for j in torch.randperm(hi - lo, generator=g)[: self.size])
                for g in self.generators
            ]
        else:
            starts = [0] * len(requests)
            if p.sde_window_size:
                starts = [
                    min(int(torch.randint(lo, hi, (1,), generator=g)), num_steps - self.size)
                    for g in self.generators
                ]
            self.trained = [list(range(s, s + self.size)) for s in starts]
        self.sigmas = sigmas.to(device)  # [T + 1]
        self.sigma_max = float(sigmas[1])
        batch = len(requests)
        # rows[i]: the rows step i trains (in row order), and each one's position k in its window.
        self.rows = [[b for b, t in enumerate(self.trained) if i in t] for i in range(num_steps)]
        flat = [(b, self.trained[b].index(i)) for i in range(num_steps) for b in self.rows[i]]
        index = _to_device(torch.tensor(flat, dtype=torch.int64).reshape(-1, 2), self.device, pin)  # [N, 2]
        offsets = [0]
        for rows in self.rows:
            offsets.append(offsets[-1] + len(rows))
        self.index = [index[offsets[i] : offsets[i + 1]] for i in range(num_steps)]  # [R_i, 2] views
        self.noise = [
            _NOISE_WORKER.submit(self._draw, rows, pin) if rows else None for rows in self.rows
        ]  # the jobs run in step order, so every generator draws in the order of the window's steps
        self.step_indices = torch.tensor(self.trained)  # [B, K]
        self.x_in = torch.empty((batch, self.size, *latent_shape), device=device)  # [B, K, *latent]
        self.x_out = torch.empty((batch, self.size, *latent_shape), device=device)
        self.logprobs = torch.zeros((batch, self.size), device=device)  # [B, K]
        self._host: tuple[torch.Tensor, ...] | None = None

    def _draw(self, rows: list[int], pin: bool) -> torch.Tensor:
        noise = torch.stack([torch.randn(self.shape, generator=self.generators[b]) for b in rows])
        return noise.pin_memory() if pin else noise  # [R, *latent]

    def sigma(self, i: int) -> torch.Tensor:
        """The sigma of step i for every row: [B]."""
        return self.sigmas[i].expand(len(self.trained))

    def step(self, i: int, velocity: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Step i of the whole batch: velocity, latents [B, *latent] -> the next latents [B, *latent]."""
        with phase("sde_step"):
            return self._step(i, velocity, latents)

    def _step(self, i: int, velocity: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        p = self.params
        sigma, sigma_next = self.sigma(i), self.sigmas[i + 1].expand(len(self.trained))
        next_latents = flow_step(velocity, latents, sigma, sigma_next, self.sigma_max, 0.0, "ode").prev_sample
        if self.noise[i] is not None:
            with phase("noise"):  # a wait only if the worker fell behind
                noise = self.noise[i].result().to(self.device, non_blocking=True)  # [R, *latent]
            idx, k = self.index[i][:, 0], self.index[i][:, 1]  # [R] rows, [R] their window positions
            out = flow_step(
                velocity[idx], latents[idx], sigma[idx], sigma_next[idx], self.sigma_max, p.noise_level,
                p.sde_type, noise=noise,
            )  # fmt: skip
            next_latents[idx] = out.prev_sample
            self.x_in[idx, k] = latents[idx].float()
            self.x_out[idx, k] = out.prev_sample
            if p.record_logprobs:
                self.logprobs[idx, k] = out.logprob
        return next_latents

    def record(self, b: int) -> dict[str, torch.Tensor]:
        """Row b's trained steps, on the host, as `Trajectory` fields (views of the batch's records, which
        come to the host in one copy per buffer at the first call)."""
        if self._host is None:
            self._host = tuple(to_host([self.x_in, self.x_out, self.logprobs.float()]))
        x_in, x_out, logprobs = self._host
        return {
            "latents": x_in[b],  # [K, *latent]
            "next_latents": x_out[b],  # [K, *latent]
            "step_indices": self.step_indices[b],  # [K] int64
            "logprobs": logprobs[b],  # [K]
        }


def _to_device(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory (a copy that does not wait for the device)."""
    return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors on the host, copied into pinned memory on the device's stream and waited for once:
    a batch's trajectories cost one wait, and copies at the DMA engines' speed (fresh pageable memory was
    measured at ~1.5 GB/s: RESULTS.md, rollout breakdown). Host tensors pass through."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    with phase("to_host"):
        out = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
        ]
        torch.accelerator.synchronize(tensors[0].device)
    return out


def host_rows(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors (one per sample, shapes may differ in dim 0) on the host in one copy: the batch's
    trajectories then cost one transfer, not one per sample and field."""
    if not rows or rows[0].device.type == "cpu":
        return list(rows)
    (flat,) = to_host([torch.cat([r.reshape(-1) for r in rows])])
    out, at = [], 0
    for r in rows:
        out.append(flat[at : at + r.numel()].view(r.shape))
        at += r.numel()
    return out
