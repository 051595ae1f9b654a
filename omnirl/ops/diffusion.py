"""The diffusion half of an RL step (Flow-GRPO, Flow-DPPO and relatives), for `DiffusionAdapter`s.

`DiffusionOps` is the rollout (the `DiffusionEngine` packing the step's requests on the actor's own
module, each finished batch scored while the next denoises) and the update: a training row is one
(sample, trained denoising step) pair (`Pair`), whose log-prob the trainer recomputes with the math the
rollout ran (`pair_logprob`: the adapter's `velocity` + `flow_sde.flow_step`), with an optional KL term
to the reference policy (`build_reference`). An FP8 rollout of the trained steps is corrected by
`omnirl.algos.correction`. DiffusionNFT and DGPO reuse this rollout half with update halves of their own
(`omnirl.ops.nft`, `omnirl.ops.dgpo`).

How it works: docs/recipes.md#diffusion-algorithms
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from omnirl import distributed as D
from omnirl.algos.correction import correction_weights
from omnirl.algos.losses import RowInputs, flow_kl, get_loss, loss_spec
from omnirl.batching import equalise, make_requests, shuffled_rows
from omnirl.config import Config
from omnirl.config_checks import fp8_trained
from omnirl.data.prompts import PromptRow
from omnirl.metrics import MetricsLogger
from omnirl.models.base import DecodesLatents, DiffusionAdapter, Output, Request, SamplingParams, Trajectory
from omnirl.models.flow_sde import StepOut, flow_step, sliding_window
from omnirl.phase_clock import PhaseClock
from omnirl.rewards import get_reward
from omnirl.rollout.diffusion import DiffusionEngine, bucket_size

SHOWN = 8  # samples a logging step writes (log.image_every)


def sampling_params(cfg: Config, num_steps: int | None = None, ode: bool = False) -> SamplingParams:
    """The rollout's settings (the ODE sampler with `ode`, validation's). The rollout of a loss that reads
    the divergence (`LossSpec.divergence`: flow_dppo) records each trained step's mean too, unless the old
    policy is recomputed (then the recompute pass gives it). When every reward reads latents nothing is
    decoded (validation shows nothing; logged samples are decoded apart, `DiffusionOps.generate`)."""
    s, a = cfg.sampling, cfg.algo
    return SamplingParams(
        height=s.height,
        width=s.width,
        num_steps=num_steps or s.num_steps,
        guidance_scale=s.guidance_scale,
        noise_level=0.0 if ode else s.noise_level,
        sde_type="ode" if ode else s.sde_type,
        sde_window_size=s.sde_window_size,
        sde_window_range=(s.sde_window_range[0], s.sde_window_range[1]),  # a pair (a recipe's list)
        record_logprobs=not ode,
        record_mean=not ode and loss_spec(a.loss).divergence and a.old_logprob == "rollout",
        ode_solver=s.ode_solver,
        shared_initial_noise=s.shared_initial_noise and not ode,  # validation draws per sample
        sde_window_schedule="contiguous" if ode else s.sde_window_schedule,  # validation trains nothing
        ode_compress_ratio=0.0 if ode else s.ode_compress_ratio,
        fused_cfg=cfg.rollout.fused_cfg,
        decode=not all(get_reward(name).modality == "latent" for name in cfg.reward.weights),
    )


@dataclass
class Pair:
    """One (sample, trained step) row of the update."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    old: float | None = None  # behaviour log-prob recomputed by the trainer (old_logprob: recompute)
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (batching.global_positions)
    old_mean: torch.Tensor | None = None  # [*latent] and its step mean (flow_dppo with recompute)
    is_weight: float = 1.0  # the rollout correction's weight (rollout.precision fp8 with algo.correction)


def micro_batch_embeds(
    adapter: DiffusionAdapter, embeds: list[dict[str, torch.Tensor]], bucketed: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch's per-sample `Trajectory.embeds` collated (`adapter.batch_embeds`; `bucketed`:
    train.compile, texts padded to the family's length buckets) on the adapter's device."""
    return {k: e.to(adapter.device) for k, e in adapter.batch_embeds(embeds, bucketed).items()}


@dataclass
class PairInputs:
    """A micro-batch's stored transitions on the device: what `pair_logprob` feeds the forward, built once
    where the policy's and the KL reference's forwards read the same rows."""

    x: torch.Tensor  # [M, *latent]
    nxt: torch.Tensor  # [M, *latent]
    sigma: torch.Tensor  # [M]
    sigma_next: torch.Tensor  # [M]
    sigma1: float  # the schedule's second sigma (flow_step's SDE scale)
    embeds: dict[str, torch.Tensor]


def pair_inputs(adapter: DiffusionAdapter, pairs: list[Pair], bucketed: bool = False) -> PairInputs:
    """The inputs of `pair_logprob` for `pairs` (`bucketed`: train.compile, texts padded to the family's
    length buckets)."""
    device = adapter.device
    trajs = [p.traj for p in pairs]
    steps = torch.stack([t.step_indices[p.k] for t, p in zip(trajs, pairs)])
    sig = trajs[0].sigmas
    return PairInputs(
        x=torch.stack([t.latents[p.k] for t, p in zip(trajs, pairs)]).to(device),
        nxt=torch.stack([t.next_latents[p.k] for t, p in zip(trajs, pairs)]).to(device),
        sigma=sig[steps].to(device),
        sigma_next=sig[steps + 1].to(device),
        sigma1=float(sig[1]),
        embeds=micro_batch_embeds(adapter, [t.embeds for t in trajs], bucketed),
    )


def pair_logprob(
    adapter: DiffusionAdapter,
    pairs: list[Pair],
    params: SamplingParams,
    policy: nn.Module | None = None,
    bucketed: bool = False,
    inputs: PairInputs | None = None,
) -> StepOut:
    """Recompute stored transitions: the step's `StepOut` ([M] logprob, [M, *latent] mean, [M] std and
    std_dev_t). Each row's sigma is its stored step's, so a family of several experts runs it on the expert
    that sampled it. `bucketed` (train.compile): texts padded to the family's length buckets. `inputs`:
    `pair_inputs(adapter, pairs, bucketed)` built before (the KL reference pass reuses the policy's)."""
    i = inputs if inputs is not None else pair_inputs(adapter, pairs, bucketed)
    v = adapter.velocity(i.x, i.sigma, i.embeds, params.guidance_scale, policy=policy)
    return flow_step(
        v, i.x, i.sigma, i.sigma_next, i.sigma1, params.noise_level, params.sde_type, prev_sample=i.nxt,
        pool=adapter.logprob_pool(params),
    )  # fmt: skip


def micro_batches(
    pairs: list[Pair], size: int, pad_from: Trajectory, bucket: bool = False
) -> list[list[Pair]]:
    """Split into micro-batches of `size` pairs, as many on every rank (batching.equalise). `bucket`
    (train.compile) pads each with zero-weight pairs up to a bucket size (1, 2, 4, 8, ..., `size`), so that
    a compiled update meets a few row counts only and never recompiles for a new one."""
    pad = Pair(pad_from, 0, 0.0)
    out = equalise([pairs[i : i + size] for i in range(0, len(pairs), size)], pad)
    if bucket:
        out = [mb + [pad] * (bucket_size(len(mb), size) - len(mb)) for mb in out]
    return out


class DiffusionOps:
    """The diffusion half of an RL step (the module docstring); `omnirl.trainer.train` runs it."""

    sleepable = None  # the diffusion engine runs on the actor's own module: no weights of its own to sleep
    clock: PhaseClock | None = None  # the update's clock (omnirl.step.UpdateTuning): times the KL pass

    def __init__(self, cfg: Config, adapter: DiffusionAdapter):
        self.cfg, self.adapter = cfg, adapter
        self.policy = adapter.policy
        self.spec = loss_spec(cfg.algo.loss, "diffusion")
        self.loss_fn = get_loss(cfg.algo.loss, "diffusion")
        self.params = sampling_params(cfg)
        self.ref_model = build_reference(cfg, adapter)
        self.engine = DiffusionEngine(adapter, cfg.rollout, per_unit=cfg.distributed.rollout_gather == "unit")
        a = cfg.algo
        # Only an FP8 rollout whose trained steps ran in FP8 and that trains on its own samples, or an
        # asynchronous run's rollout of an older policy, has a behaviour policy other than the trainer's.
        stale = cfg.distributed.mode == "async" and cfg.distributed.max_staleness > 0
        self.correct = (fp8_trained(cfg) or stale) and a.correction != "none"
        if a.correction != "none" and not self.correct and self.spec.logprobs:
            D.print0(
                f"warning: algo.correction {a.correction!r} is ignored: a diffusion rollout samples with the "
                "trainer's weights in its precision unless rollout.precision is fp8 (with fp8.steps all and "
                "fp8.select 0)"
            )
        self._gap = self._no_gap()
        self._shown: list[Request] = []  # this step's requests whose samples are logged, to decode

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads, beyond the loss's kind and what the
        recipe's values are checked for when it loads (`config_checks.check_values`): an FP8 rollout on a
        device without FP8 matrix multiplies."""
        if cfg.rollout.precision == "fp8":
            D.check_fp8_matmul(D.local_device())

    def offload_modules(self) -> list[nn.Module]:
        """The adapter's rollout-only modules, and an FP8 rollout's FP8 weights."""
        fp8 = self.engine.fp8.modules() if self.engine.fp8 is not None else []
        return self.adapter.offload_modules() + fp8

    def prompt_problem(self, row: PromptRow) -> str | None:
        return self.adapter.prompt_problem(row)

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        requests = make_requests(
            self.cfg, rows, step, dist, self.step_params(step), self.cfg.sampling.negative_prompt
        )[0]
        every = self.cfg.log.image_every
        logged = every and step % every == 0 and not self.params.decode
        self._shown = requests[:SHOWN] if logged else []
        return requests

    def step_params(self, step: int) -> SamplingParams:
        """The sampling parameters of RL step `step`: with the sliding schedule the window is the step's
        (`sliding_window`: its size shrinks at the end of the range), the same for every request."""
        s = self.cfg.sampling
        if s.sde_window_schedule not in ("sliding", "sliding_compressed"):
            return self.params
        lo, hi = s.sde_window_range  # a recipe's list: the pair `sliding_window` takes
        span, interval, stride = (lo, hi), s.sde_window_shift_interval, s.sde_window_stride
        start, size = sliding_window(step, s.sde_window_size, span, interval, stride)
        return dataclasses.replace(self.params, sde_window_size=size, sde_window_range=(start, start + size))

    def validation_params(self) -> SamplingParams:
        return sampling_params(self.cfg, num_steps=self.cfg.validation.num_steps, ode=True)

    def generate(self, requests: list[Request], on_done: Callable[[list], None]) -> list[Trajectory]:
        trajs = self.engine.generate(requests, on_batch=on_done)
        # A rollout that skipped the decode (every reward reads latents) still decodes the samples a
        # logging step shows, here, while the VAE is awake (it sleeps through the update).
        shown = [t for t in trajs if any(t.request is r for r in self._shown)]
        if shown:
            decoder = cast(DecodesLatents, self.adapter)
            images = decoder.decode(torch.stack([t.final_latents for t in shown]))
            for t, image in zip(shown, images):
                t.output.image = image
        self._shown = []
        return trajs

    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[Pair]:
        k_steps = len(trajs[0].logprobs)  # trained steps per sample: the same for every sample of a step
        samples = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return shuffled_rows(
            trajs, keep, gen, samples, k_steps, lambda t, k, at: Pair(t, k, 1.0, position=at)
        )

    def recompute_old(self, pairs: list[Pair], pad_traj: Trajectory) -> dict[str, float]:
        for mb in self.micro_batches(pairs, pad_traj):
            out = pair_logprob(self.adapter, mb, self.params, bucketed=self.cfg.train.compile)
            means = out.mean.cpu() if self.spec.divergence else [None] * len(mb)  # [M, *latent]: one copy
            for p, v, mean in zip(mb, out.logprob.tolist(), means):
                p.old, p.old_mean = v, mean
        return self._correct(pairs) if self.correct else {}

    def _correct(self, pairs: list[Pair]) -> dict[str, float]:
        """Set each row's `is_weight` from its recomputed and its rollout log-prob; returns the
        correction's metric sums. Rows are laid out [samples, trained steps] for the sequence level."""
        a = self.cfg.algo
        trajs = list({id(p.traj): p.traj for p in pairs}.values())
        row = {id(t): i for i, t in enumerate(trajs)}
        k_steps = len(pairs[0].traj.logprobs) if pairs else 1
        old = torch.zeros(len(trajs), k_steps, dtype=torch.float64)  # [B, K]
        rollout = torch.zeros_like(old)
        mask = torch.zeros_like(old, dtype=torch.bool)
        for p in pairs:
            i = row[id(p.traj)]
            assert p.old is not None  # recomputed before the correction
            old[i, p.k], rollout[i, p.k], mask[i, p.k] = p.old, float(p.traj.logprobs[p.k]), True
        assert a.correction != "none"  # called only with a correction (self.correct)
        weights, sums = correction_weights(
            old, rollout, mask, a.correction, a.correction_level, a.correction_threshold
        )
        for p in pairs:
            p.is_weight = weights[row[id(p.traj)], p.k].item()
        return sums

    def count(self, pairs: list[Pair]) -> float:
        return float(len(pairs))

    def micro_batches(self, pairs: list[Pair], pad_traj: Trajectory) -> list[list[Pair]]:
        return micro_batches(pairs, self.cfg.optim.micro_batch_size, pad_traj, self.cfg.train.compile)

    def loss(self, mb: list[Pair], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        a = self.cfg.algo
        inputs = pair_inputs(self.adapter, mb, self.cfg.train.compile)  # the KL pass reads them too
        out = pair_logprob(self.adapter, mb, self.params, inputs=inputs)
        device = out.logprob.device
        rollout = torch.tensor([float(p.traj.logprobs[p.k]) for p in mb], device=device)
        old = torch.tensor(
            [float(p.traj.logprobs[p.k]) if p.old is None else p.old for p in mb], device=device
        )
        adv = torch.tensor([p.traj.advantage for p in mb], device=device)
        w = torch.tensor([p.weight for p in mb], device=device)
        is_weight = torch.tensor([p.is_weight for p in mb], device=device) if self.correct else None
        if measure:
            steps = torch.stack([p.traj.step_indices[p.k] for p in mb]).to(device)
            mine, theirs = out.logprob.detach(), rollout
            recorded = [p.traj.stream_logprobs for p in mb]  # [S] of each row: each stream apart (LTX-2)
            if out.streams is not None and all(r is not None for r in recorded):
                mine = torch.column_stack([mine, out.streams.detach()])
                picked = torch.stack([r[p.k] for r, p in zip(recorded, mb) if r is not None]).to(device)
                theirs = torch.column_stack([theirs, picked])
            self._measure_gap(mine, theirs, steps, w)
        streams = {}  # each stream's log-prob of a latent of several (LTX-2's video and audio), logged apart
        if (pool := self.adapter.logprob_pool(self.params)) is not None:
            assert out.streams is not None  # flow_step pools by streams when given a Pool
            streams = {
                f"loss/logprob_{name}_sum": (w * out.streams[:, i].detach()).sum()
                for i, name in enumerate(pool.names)
            }
        kl = None
        if a.kl_beta > 0:
            if self.clock is not None:
                self.clock.mark("kl_reference")
            with torch.no_grad(), reference(self.adapter, self.ref_model) as ref:
                mean_ref = pair_logprob(self.adapter, mb, self.params, ref, inputs=inputs).mean
            if self.clock is not None:
                self.clock.mark("forward")
            kl = flow_kl(out.mean, mean_ref, out.std_dev_t if a.kl_form == "flow_grpo" else out.std)
        divergence = None
        if self.spec.divergence:
            divergence = flow_kl(out.mean, self._old_means(mb, out.mean), out.std)  # the exact KL
        std = dt = None
        if a.loss == "grpo_guard":  # its ratio scale and re-weighting read the step's std and |dt|
            steps = torch.stack([p.traj.step_indices[p.k] for p in mb])
            sig = mb[0].traj.sigmas
            std, dt = out.std, (sig[steps + 1] - sig[steps]).abs().to(device)
        inputs = RowInputs(
            out.logprob, old, adv, w, kl=kl, is_weight=is_weight, divergence=divergence, std=std, dt=dt
        )
        loss, metrics = self.loss_fn(inputs, a, normaliser)
        return loss, {**metrics, **streams}

    @staticmethod
    def _old_means(mb: list[Pair], mean: torch.Tensor) -> torch.Tensor:
        """[M, *latent] the behaviour policy's step means, recomputed or recorded by the rollout, in one copy
        to the device. A padding row (weight 0) of a recompute run has neither: zeros (it adds nothing)."""
        rows = []
        for p in mb:
            row = (
                p.old_mean if p.old_mean is not None else None if p.traj.means is None else p.traj.means[p.k]
            )
            assert row is not None or p.weight == 0, "a real row without the behaviour policy's mean"
            rows.append(torch.zeros(mean.shape[1:]) if row is None else row)
        return torch.stack(rows).to(mean.device)

    def _no_gap(self) -> torch.Tensor:
        """[3, T, 1 + S]: per timestep index, the sum and the max of |trainer - rollout| log-prob, and the
        count; column 0 the step's log-prob, then each stream's of a latent that joins S (LTX-2)."""
        pool = self.adapter.logprob_pool(self.params)
        return torch.zeros(3, self.params.num_steps, 1 + len(pool.names if pool else ()), dtype=torch.float64)

    def _measure_gap(self, logprob, rollout, steps, w) -> None:
        """Accumulate the trainer-vs-rollout log-prob gap ([M, 1 + S]: the step's, then each stream's) of a
        micro-batch of the unchanged policy."""
        real = w > 0
        if not real.any():  # a micro-batch of padding rows only (a rank whose groups had no spread)
            return
        diff = (logprob.double() - rollout.double()).abs()[real].cpu()  # [M', 1 + S]
        diff = diff.reshape(len(diff), -1)
        steps = steps[real].cpu()
        gap = self._gap[..., : diff.shape[1]]  # a rollout that recorded no stream log-probs: column 0 only
        gap[0].index_add_(0, steps, diff)
        gap[1].scatter_reduce_(0, steps[:, None].expand_as(diff), diff, "amax")
        gap[2].index_add_(0, steps, torch.ones_like(diff))

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        """The trainer-vs-rollout log-prob gap of this update over all ranks, overall and per trained
        timestep index t (consistency/tXX/logprob_abs_diff_mean and _max): in fp32 on CPU ~1e-6; in bf16 on
        a GPU the gap guidance amplifies. Collective: every rank calls it once per update."""
        gap, self._gap = self._gap, self._no_gap()
        sums = D.all_reduce(gap[[0, 2]].clone())  # [2, T, 1 + S]
        maxima = D.all_reduce(gap[1].clone(), op=torch.distributed.ReduceOp.MAX)
        total, count = sums[..., 0].sum(dim=1).tolist()
        if count == 0:
            return {}
        out = {
            "consistency/logprob_abs_diff_mean": total / count,
            "consistency/logprob_abs_diff_max": maxima[:, 0].max().item(),
            "consistency/pairs": count,
        }
        pool = self.adapter.logprob_pool(self.params)
        columns = [""] + [f"{name}/" for name in (pool.names if pool else ())]
        for t in torch.nonzero(sums[1, :, 0]).flatten().tolist():
            for i, col in enumerate(columns):
                if sums[1, t, i] == 0:
                    continue
                out[f"consistency/t{t:02d}/{col}logprob_abs_diff_mean"] = (
                    sums[0, t, i] / sums[1, t, i]
                ).item()
                out[f"consistency/t{t:02d}/{col}logprob_abs_diff_max"] = maxima[t, i].item()
        return out

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list[Trajectory]) -> None:
        shown = trajs[:SHOWN]
        log_outputs(logger, step, [t.output for t in shown], [t.request.prompt for t in shown])


def log_outputs(logger: MetricsLogger, step: int, outputs: list[Output], captions: list[str]) -> None:
    """Samples by what the family produces: images as one grid, videos as mp4 files (with their own audio
    track where they have one), audio alone as wav files."""
    first = outputs[0]  # a family's outputs all hold the same fields: the filters keep every one
    if first.image is not None:
        logger.log_images(step, "samples", [o.image for o in outputs if o.image is not None], captions)
    if first.video is not None:
        audios = [o.audio for o in outputs if o.audio is not None] if first.audio is not None else None
        rate = first.sample_rate if audios else None
        videos = [o.video for o in outputs if o.video is not None]
        logger.log_videos(step, "samples", videos, first.fps, captions, audios, rate)
    elif first.audio is not None:
        audios = [o.audio for o in outputs if o.audio is not None]
        logger.log_audios(step, "samples", audios, first.sample_rate, captions)


@contextlib.contextmanager
def reference(adapter: DiffusionAdapter, ref_model: nn.Module | None):
    """The reference policy: the frozen copy for full fine-tuning (yielded, to run in place of the policy),
    else the policy itself with its LoRA off (None: run the adapter's own policy)."""
    if ref_model is not None:
        yield ref_model
        return
    with adapter.lora_disabled():
        yield None


def build_reference(cfg: Config, adapter: DiffusionAdapter) -> nn.Module | None:
    """Full fine-tuning with KL keeps a frozen copy of the initial policy (sharded like the actor); LoRA
    needs none: its reference is the same model with the adapter disabled. The copy is made where the
    policy is: on the host when FSDP2 shards the frozen base (`fsdp.place_policy`), so neither
    whole copy reaches the device before `fully_shard` places them one unit at a time."""
    if cfg.model.finetune != "full" or cfg.algo.kl_beta == 0:
        return None
    return copy.deepcopy(adapter.policy).requires_grad_(False).eval()
