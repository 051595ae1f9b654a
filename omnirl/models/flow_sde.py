"""The flow-matching denoising step with its log-probability: ODE, SDE (Flow-GRPO), CPS and DanceGRPO's.

One place for this math: every adapter's denoising loop and the trainer call `flow_step`, in fp32, with
the conventions of the public Flow-GRPO / DanceGRPO / Flow-CPS references. Noise level 0 gives the ODE
step exactly; a latent of several streams pools its log-prob by `Pool`. Our own code: no library
provides a flow-matching step with a log-density.

How it works: docs/algorithms.md#the-denoising-step-and-its-log-prob
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from omnirl import phase_clock

SDE_TYPES = ("ode", "sde", "cps", "dance_sde")


@dataclass(frozen=True)
class Pool:
    """How a step's log-prob pools the elements of a latent that joins several streams: the flattened
    latent is `sizes` consecutive segments (named `names`), each averaged alone, and the log-prob is
    sum_s weights[s] * mean_s. Weights proportional to the sizes give the plain mean over all elements."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]  # elements of each stream; they sum to the latent's numel
    weights: tuple[float, ...]


@dataclass
class StepOut:
    prev_sample: torch.Tensor  # [B, *latent] the latents after the step
    logprob: torch.Tensor  # [B] mean over latent dims (0 for the ODE step or noise level 0)
    mean: torch.Tensor  # [B, *latent] the mean of the step's Gaussian
    std: torch.Tensor  # [B] its standard deviation (per element)
    # [B] the scale the reference's own step returns as std_dev_t, whose square the flow_grpo KL term
    # divides by (algos.losses.flow_kl): SDE the coefficient before the sqrt(|dt|) factor; CPS and
    # dance_sde the std itself (their KL term is the Gaussian KL); 0 for the ODE step.
    std_dev_t: torch.Tensor
    streams: torch.Tensor | None = None  # [B, S] each stream's mean log-prob (with a `Pool`), else None


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
    pool: Pool | None = None,
) -> StepOut:
    """One denoising step for a batch, per-row sigmas.

    velocity, latents: [B, *latent]; sigma, sigma_next: [B]; sigma_max: the schedule's second sigma.
    Pass `noise` ([B, *latent], standard normal) to sample x', or `prev_sample` to score a stored x'
    (the trainer's recomputation). With neither, the step is taken without noise (the mean). `pool`: the
    streams of a joined latent (`Pool`), else the log-prob is the mean over all latent dims.
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
        streams = None if pool is None else zero[:, None].expand(-1, len(pool.sizes))
        return StepOut(out, zero, mean, zero, zero, streams)

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
        std_dev_t = std  # the references' dance step returns the whole std as std_dev_t
    else:  # cps
        std = s_next * math.sin(noise_level * math.pi / 2)
        std_dev_t = std
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = (1 - s_next) * x0 + torch.sqrt(s_next**2 - std**2) * x1

    if prev_sample is None:
        prev_sample = mean if noise is None else mean + std * noise.float()
    prev_sample = prev_sample.float()
    dims = tuple(range(1, x.dim()))
    if sde_type in ("sde", "dance_sde"):
        density = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    else:
        density = -((prev_sample - mean) ** 2)
    streams = None
    if pool is None:
        logprob = density.mean(dim=dims)
    else:
        parts = density.reshape(batch, -1).split(list(pool.sizes), dim=1)
        streams = torch.stack([part.mean(dim=1) for part in parts], dim=1)  # [B, S]
        logprob = streams @ torch.tensor(pool.weights, dtype=streams.dtype, device=streams.device)
    return StepOut(prev_sample, logprob, mean, std.reshape(batch), std_dev_t.reshape(batch), streams)


def phase(name: str):
    """A labelled range of a rollout (`omnirl/<name>`) for the torch profiler: the rollout benchmark's time
    breakdown (benchmarks/breakdown.py) sums the host and device time of each label. Free when no profiler
    runs. Labels: encode, noise, transformer, sde_step, vae_decode, to_host. The VAE decode is also timed on
    the clock the step records its rollout on (`phase_clock.recording`): the step's `time/vae_decode_s`."""
    if name == "vae_decode":
        return _timed(name)
    return torch.profiler.record_function(f"omnirl/{name}")


@contextlib.contextmanager
def _timed(name: str):
    with torch.profiler.record_function(f"omnirl/{name}"), phase_clock.part(name):
        yield


# One worker thread draws every sampler's step noise ahead of its denoising loop (`WindowedSampler`). Torch's
# CPU kernels release the GIL, so the draws run while the main thread launches the transformer's kernels.
_NOISE_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnirl-noise")


def window(num_steps: int, size: int, window_range: tuple[int, int]) -> tuple[int, int, int]:
    """The trained steps of a rollout of `num_steps`: (W, first start, last start). Size 0 is every step
    but the last (W = num_steps - 1, starting at 0); a size W > 0 starts anywhere in lo .. hi - W of the
    range [lo, hi), which must hold it within the schedule. A ValueError names the sampling fields."""
    lo, hi = window_range
    if size == 0:
        if num_steps < 2:
            raise ValueError(
                f"sampling.sde_window_size 0 trains every step but the last: sampling.num_steps {num_steps} "
                "leaves none"
            )
        return num_steps - 1, 0, 0
    if not (0 < size and 0 <= lo and lo + size <= hi <= num_steps):
        raise ValueError(
            f"sampling.sde_window_range {list(window_range)} must hold a window of sampling.sde_window_size "
            f"{size} within sampling.num_steps {num_steps}: 0 <= lo, lo + size <= hi <= num_steps"
        )
    return size, lo, hi - size


def sliding_window(
    step: int, size: int, window_range: tuple[int, int], interval: int, stride: int
) -> tuple[int, int]:
    """MixGRPO's window at RL step `step`, (start, size), as its progressive strategy places it: it starts
    at lo, moves by `stride` every `interval` steps, and at the end of the range shrinks to what is left
    of it (steps start .. hi - 1, so sizes W, ..., 3, 2, 1); once its start would reach hi, it goes back to
    lo. The reference goes back only after one more period at start hi, whose window is empty (it trains
    nothing then): that period is skipped here. E.g. size 2 in [0, 5), interval 3, stride 2: steps 0-2
    train steps 0-1, 3-5 steps 2-3, 6-8 step 4 alone, 9-11 steps 0-1 again."""
    lo, hi = window_range
    positions = (hi - lo + stride - 1) // stride  # the starts lo, lo + stride, ... below hi
    start = lo + stride * ((step // interval) % positions)
    return start, min(size, hi - start)


def compressed_schedule(sigmas: torch.Tensor, last: int, ratio: float, shift: float) -> torch.Tensor:
    """MixGRPO-Flash's schedule after a window whose last step is `last`: steps 0 .. last keep their
    sigmas, and the ODE from sigma_{last+1} to 0 runs on n = int(max(ratio (T - last), 1)) points evenly
    spaced in the unshifted time t (sigma = s t / (1 + (s - 1) t), s = `shift`), from the time of
    sigma_{last+1} to 0, shifted as the schedule is: [last + 1 + n] sigmas, last + n steps. Where n is 1
    the reference's schedule ends at sigma_{last+1}, short of 0, and its sample keeps that step's noise;
    here a last step to 0 is added (n = 2)."""
    num_steps = len(sigmas) - 1
    n = max(int(max(ratio * (num_steps - last), 1)), 2)
    start = float(sigmas[last + 1])
    t = torch.linspace(start / (shift - (shift - 1) * start), 0.0, n, dtype=torch.float64)
    post = (shift * t / (1 + (shift - 1) * t)).to(sigmas.dtype)
    return torch.cat([sigmas[: last + 2], post[1:]])  # post[0] is sigma_{last+1} itself


@dataclass
class Plan:
    """What a rollout's rows do at each step (`PLANNERS`): which steps each row trains (records) and which
    it samples with the SDE step (the ODE step elsewhere), and the sigmas the rollout runs."""

    trained: list[list[int]]  # per row, its trained steps in ascending order (as many for every row)
    noisy: list[list[int]]  # per row, the steps it takes the SDE step at (its trained ones among them)
    sigmas: torch.Tensor  # [T' + 1] the schedule (T' = T unless the planner compresses it)


# A planner: (the batch's SamplingParams, untyped here as models.base imports this module; one generator
# per row; the schedule's sigmas; its static shift or None) -> the rows' `Plan`. It draws from each row's
# generator after its initial latents and before its step noise; it only runs for a rollout that records
# log-probs (`WindowedSampler`: no window otherwise).
Planner = Callable[[Any, list[torch.Generator], torch.Tensor, float | None], Plan]


def _contiguous(p, generators: list[torch.Generator], sigmas: torch.Tensor, shift: float | None) -> Plan:
    """flow_grpo's and VeRL-Omni's window: each row's W steps in a row, from a start drawn uniformly in
    lo .. hi - W of `sde_window_range`; the SDE on them alone. Size 0 trains every step but the last, with
    no draw. MixGRPO's sliding window is this draw on a range of exactly W steps (`sliding_window`), the
    same for every row."""
    size, lo, last = window(p.num_steps, p.sde_window_size, p.sde_window_range)
    starts = [0] * len(generators)
    if p.sde_window_size:
        starts = [int(torch.randint(lo, last + 1, (1,), generator=g)) for g in generators]
    trained = [list(range(s, s + size)) for s in starts]
    return Plan(trained, trained, sigmas)


def _random_steps(p, generators: list[torch.Generator]) -> list[list[int]]:
    """Each row's W trained steps drawn without replacement from `sde_window_range` (the first W of a
    permutation, sorted)."""
    size, lo, last = window(p.num_steps, p.sde_window_size, p.sde_window_range)
    return [
        sorted(lo + int(j) for j in torch.randperm(last + size - lo, generator=g)[:size]) for g in generators
    ]


def _dance(p, generators: list[torch.Generator], sigmas: torch.Tensor, shift: float | None) -> Plan:
    """DanceGRPO's: every step but the last takes the SDE step (DanceGRPO samples them all and decodes the
    last one's x0 prediction, which is the ODE step to sigma 0), W of them trained (`_random_steps`)."""
    trained = _random_steps(p, generators)
    return Plan(trained, [list(range(p.num_steps - 1)) for _ in trained], sigmas)


def _subset(p, generators: list[torch.Generator], sigmas: torch.Tensor, shift: float | None) -> Plan:
    """VeRL-Omni's LTX-2 Flow-GRPO: W trained steps drawn per row (`_random_steps`), the SDE on them alone."""
    trained = _random_steps(p, generators)
    return Plan(trained, trained, sigmas)


def _sliding_compressed(
    p, generators: list[torch.Generator], sigmas: torch.Tensor, shift: float | None
) -> Plan:
    """MixGRPO-Flash's: MixGRPO's window (`_contiguous`), then the ODE on the compressed schedule after it
    (`compressed_schedule`, `ode_compress_ratio`), which needs one window for the whole batch."""
    plan = _contiguous(p, generators, sigmas, shift)
    ends = {t[-1] for t in plan.trained}
    if len(ends) != 1 or shift is None:
        raise ValueError(
            "sampling.sde_window_schedule sliding_compressed needs one window for the whole batch and a "
            "schedule of static shift"
        )
    plan.sigmas = compressed_schedule(sigmas, ends.pop(), p.ode_compress_ratio, shift)
    return plan


# sampling.sde_window_schedule -> its planner. Its docs/recipes.md table says what each trains and samples
# with the SDE, and the reference it follows.
PLANNERS: dict[str, Planner] = {
    "contiguous": _contiguous,
    "dance": _dance,
    "subset": _subset,
    "sliding": _contiguous,
    "sliding_compressed": _sliding_compressed,
}


def dpm2_coefficients(sigma_prev: float, sigma: float, sigma_next: float) -> tuple[float, float, float]:
    """(c_x, c_0, c_1): DPM-Solver++ 2M's step from sigma to sigma_next for flow matching (alpha = 1 -
    sigma, lambda = log(alpha / sigma)) as x' = c_x x + c_0 x0 + c_1 x0_prev, with x0 = x - sigma v the
    data prediction at sigma and x0_prev the previous step's (at sigma_prev), the midpoint form:
    x' = (sigma' / sigma) x - alpha' (e^-h - 1) (D0 + D1 / 2), D0 = x0, D1 = (x0 - x0_prev) / r,
    h = lambda' - lambda, r = (lambda - lambda_prev) / h. Needs 0 < sigma_next and sigma_prev < 1."""
    lam = [math.log((1 - s) / s) for s in (sigma_prev, sigma, sigma_next)]
    h, r = lam[2] - lam[1], (lam[1] - lam[0]) / (lam[2] - lam[1])
    a = -(1 - sigma_next) * math.expm1(-h)  # -alpha' (e^-h - 1)
    return sigma_next / sigma, a * (1 + 0.5 / r), -a * 0.5 / r


class WindowedSampler:
    """The per-request randomness of a packed denoising loop, and the SDE window of each row.

    Every adapter's loop uses it, so the rules live in one place. Which steps each row trains and samples
    with the SDE is the plan of the batch's `sde_window_schedule` (`PLANNERS`: one function per schedule).
    The window (`window`): size W > 0 lies in `sde_window_range` [lo, hi); size 0 trains every step but the
    last (flow_grpo's `timestep_fraction` 0.99: the last step, to sigma 0, is a very sharply peaked
    Gaussian). Each request's own generator (seeded from `request.seed`) draws, in this order: its initial
    latents, what its schedule's planner draws (a window start, a subset of steps), then the noise of each
    SDE step. With `shared_initial_noise` the initial latents come from a generator seeded by
    `request.group_seed` instead (every sample of a group starts from the same latents, DanceGRPO's rule),
    and the request's own generator draws the rest. So a request's sample does not depend on the batch it
    runs in (packed == serial). Rows at an SDE step take `flow_step` with the request's SDE type and noise
    level; at a trained step they record (latents in, latents out, step, log-prob and, with `record_mean`,
    the step's mean); elsewhere they take the ODE step and record nothing: the Euler step, or after the SDE
    steps with `ode_solver` dpm2 DPM-Solver++ 2M (`dpm2_coefficients`). A planner that compresses the
    schedule (MixGRPO-Flash's, with the schedule's `shift`) sets `num_steps` and `sigmas`: they are then the
    sampler's, not the request's.
    `on_step(trained)` runs before each step (`steps`): the rollout engine's per-step precision (rollout.
    fp8.steps untrained: the policy's own layers for a step that trains a row, FP8 for the others).
    A rollout that records no log-probs (validation) has no window: the ODE step everywhere. Noise is drawn
    on the host, so samples do not depend on the device either.

    What this adds to a stock denoising loop must cost the device nothing: the step noise is drawn ahead on
    a worker thread (in each generator's own order, so the values are those of drawing it step by step)
    into pinned memory and copied without blocking; which rows a step trains is known from the window
    starts, so its row indices are copied to the device once, at the start; the records stay on the
    device in [B, K, ...] buffers and come to the host in one copy per buffer (`record`). No step waits for
    the device.
    """

    def __init__(
        self,
        requests: list,
        latent_shape: tuple[int, ...],
        sigmas: torch.Tensor,
        device,
        shift: float | None = None,
        pool: Pool | None = None,
        on_step: Callable[[bool], None] | None = None,
    ):
        p = requests[0].params
        self.pool, self.on_step = pool, on_step
        self.params, self.shape, self.device = p, latent_shape, torch.device(device)
        pin = self.device.type != "cpu"  # pinned host memory: copies that do not block the host
        self.generators = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
        with phase("noise"):
            first = self.generators
            if p.shared_initial_noise:
                first = [torch.Generator("cpu").manual_seed(r.group_seed) for r in requests]
            initial = torch.stack([torch.randn(latent_shape, generator=g) for g in first])
            self.initial_latents = _to_device(initial, self.device, pin)  # [B, *latent]
        if p.record_logprobs:
            plan = PLANNERS[p.sde_window_schedule](p, self.generators, sigmas, shift)
        else:  # nothing is trained from it (validation): no window, no draw
            plan = Plan([[] for _ in requests], [[] for _ in requests], sigmas)
        self.trained, self.noisy, sigmas = plan.trained, plan.noisy, plan.sigmas
        self.size = len(self.trained[0])
        self.num_steps = num_steps = len(sigmas) - 1
        self.host_sigmas = sigmas  # [T' + 1] the rollout's schedule on the host (T' = T but compressed)
        self.sigmas = sigmas.to(device)
        self.sigma_max = float(sigmas[1])
        batch = len(requests)
        # rows[i]: the rows step i samples with the SDE (in row order); index[i]: of those it trains, the
        # position j among them, the row b and its position k among the row's trained steps.
        self.rows = [[b for b, t in enumerate(self.noisy) if i in t] for i in range(num_steps)]
        flat = [
            (j, b, self.trained[b].index(i))
            for i in range(num_steps)
            for j, b in enumerate(self.rows[i])
            if i in self.trained[b]
        ]
        index = _to_device(torch.tensor(flat, dtype=torch.int64).reshape(-1, 3), self.device, pin)  # [N, 3]
        self.counts = [sum(i in self.trained[b] for b in rows) for i, rows in enumerate(self.rows)]
        offsets = [0]
        for n in self.counts:
            offsets.append(offsets[-1] + n)
        self.index = [index[offsets[i] : offsets[i + 1]] for i in range(num_steps)]  # [N_i, 3] views
        self.sde_rows = [
            _to_device(torch.tensor(rows, dtype=torch.int64), self.device, pin) if rows else None
            for rows in self.rows
        ]  # [R_i]
        self.noise = [
            _NOISE_WORKER.submit(self._draw, rows, pin) if rows else None for rows in self.rows
        ]  # the jobs run in step order, so every generator draws in the order of its SDE steps
        # dpm2: the rows past their SDE steps at step i (every row of a noise-free rollout), where its
        # second-order step applies (both neighbouring sigmas strictly inside (0, 1); elsewhere
        # DPM-Solver++ is the Euler step).
        s = [float(x) for x in sigmas]
        self.post: list[tuple[torch.Tensor, tuple[float, float, float]] | None] = [None] * num_steps
        if p.ode_solver == "dpm2":
            noise_free = p.noise_level == 0 or p.sde_type == "ode"
            for i in range(1, num_steps):
                rows = [b for b, t in enumerate(self.noisy) if noise_free or not t or i > t[-1]]
                if rows and s[i - 1] < 1 and s[i + 1] > 0:
                    idx = _to_device(torch.tensor(rows, dtype=torch.int64), self.device, pin)
                    self.post[i] = (idx, dpm2_coefficients(s[i - 1], s[i], s[i + 1]))
        self.prev_x0: torch.Tensor | None = None  # [B, *latent] the previous step's data prediction
        self.step_indices = torch.tensor(self.trained, dtype=torch.int64).reshape(batch, self.size)  # [B, K]
        self.x_in = torch.empty((batch, self.size, *latent_shape), device=device)  # [B, K, *latent]
        self.x_out = torch.empty((batch, self.size, *latent_shape), device=device)
        self.logprobs = torch.zeros((batch, self.size), device=device)  # [B, K]
        # The step means, for losses that compare the policy's mean with the rollout's (flow_dppo).
        self.means = torch.empty((batch, self.size, *latent_shape), device=device) if p.record_mean else None
        # Each stream's log-prob of each trained step (a latent of several streams: `pool`), [B, K, S].
        self.streams = None
        if pool is not None:
            self.streams = torch.zeros((batch, self.size, len(pool.sizes)), device=device)
        self._host: dict[str, torch.Tensor] | None = None

    def _draw(self, rows: list[int], pin: bool) -> torch.Tensor:
        noise = torch.stack([torch.randn(self.shape, generator=self.generators[b]) for b in rows])
        return noise.pin_memory() if pin else noise  # [R, *latent]

    def steps(self) -> Iterator[int]:
        """The step indices of the adapter's denoising loop, 0 .. num_steps - 1; before each, `on_step`
        (when given) learns whether the step trains any row of the batch."""
        for i in range(self.num_steps):
            if self.on_step is not None:
                self.on_step(self.counts[i] > 0)
            yield i

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
        pending, out = self.noise[i], None
        if pending is not None:
            with phase("noise"):  # a wait only if the worker fell behind
                noise = pending.result().to(self.device, non_blocking=True)  # [R, *latent]
            idx = self.sde_rows[i]  # [R] the rows of this SDE step
            out = flow_step(
                velocity[idx], latents[idx], sigma[idx], sigma_next[idx], self.sigma_max, p.noise_level,
                p.sde_type, noise=noise, pool=self.pool,
            )  # fmt: skip
            next_latents[idx] = out.prev_sample
        if self.counts[i]:
            assert out is not None  # a trained step is an SDE step
            j, b, k = self.index[i].unbind(1)  # [N] of the SDE rows, their rows, their trained positions
            self.x_in[b, k] = latents[b].float()
            self.logprobs[b, k] = out.logprob[j]
            if self.streams is not None:
                assert out.streams is not None  # flow_step pools by streams when given a Pool
                self.streams[b, k] = out.streams[j]
            if self.means is not None:
                self.means[b, k] = out.mean[j]
        if p.ode_solver == "dpm2":
            x0 = latents.float() - self.sigmas[i] * velocity.float()  # [B, *latent]
            post, prev_x0 = self.post[i], self.prev_x0
            if post is not None:
                assert prev_x0 is not None  # a second-order step follows a first: dpm2_coefficients
                rows, (c_x, c_0, c_1) = post
                next_latents[rows] = c_x * latents[rows].float() + c_0 * x0[rows] + c_1 * prev_x0[rows]
            self.prev_x0 = x0
        if self.counts[i]:
            _, b, k = self.index[i].unbind(1)
            self.x_out[b, k] = next_latents[b]  # (a noise-free dpm2 step included)
        return next_latents

    def record(self, b: int) -> dict[str, Any]:
        """Row b's trained steps, on the host, as `Trajectory` fields (views of the batch's records, which
        come to the host in one copy per buffer at the first call)."""
        if self._host is None:
            buffers = {"latents": self.x_in, "next_latents": self.x_out, "logprobs": self.logprobs.float()}
            if self.means is not None:
                buffers["means"] = self.means
            if self.streams is not None:
                buffers["stream_logprobs"] = self.streams
            # [B, K, *latent] latents, next_latents and means, [B, K] logprobs: one copy and one wait
            self._host = dict(zip(buffers, to_host(list(buffers.values()))))
        rows = {k: v[b] for k, v in self._host.items()}
        # step_indices [K] int64; stream_logprobs [K, S] with a pool
        return {"means": None, "stream_logprobs": None, **rows, "step_indices": self.step_indices[b]}


def _to_device(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory (a copy that does not wait for the device)."""
    return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors on the host, copied into pinned memory on the device's stream and waited for once:
    a batch's trajectories cost one wait, and copies at the DMA engines' speed (fresh pageable
    memory is far slower: benchmarks/RESULTS.md, the rollout's breakdown). Host tensors pass through."""
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
