"""The diffusion half of an RL step (Flow-GRPO and relatives), for `DiffusionAdapter`s.

- Rollout: the `DiffusionEngine` packs the step's requests into compatible batches and runs each through
  the adapter's denoising loop on the actor's own module; each finished batch is scored while the next
  denoises.
- Update: a training row is one (sample, trained denoising step) pair (`Pair`). The trainer recomputes
  that step's Gaussian log-prob (`pair_logprob`: the adapter's `velocity` + `flow_sde.flow_step`, the
  math the rollout ran) and the loss is the clipped ratio against the rollout's (or a recomputed) old
  log-prob, with an optional KL term to the reference policy (the LoRA off, or a full fine-tune's frozen
  copy).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from omnirl import distributed as D
from omnirl.algos.losses import flow_kl, get_loss
from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.metrics import MetricsLogger
from omnirl.models.base import DiffusionAdapter, Output, Request, SamplingParams, Trajectory
from omnirl.models.flow_sde import flow_step
from omnirl.rollout.diffusion import DiffusionEngine
from omnirl.step import equalise, global_positions, make_requests


def sampling_params(cfg: Config, num_steps: int | None = None, ode: bool = False) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(
        height=s.height,
        width=s.width,
        num_steps=num_steps or s.num_steps,
        guidance_scale=s.guidance_scale,
        noise_level=0.0 if ode else s.noise_level,
        sde_type="ode" if ode else s.sde_type,
        sde_window_size=s.sde_window_size,
        sde_window_range=tuple(s.sde_window_range),
        record_logprobs=not ode,
        shared_initial_noise=s.shared_initial_noise and not ode,  # validation draws per sample
        sde_window_random=s.sde_window_random,
    )


@dataclass
class Pair:
    """One (sample, trained step) row of the update."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    old: float | None = None  # behaviour log-prob recomputed by the trainer (old_logprob: recompute)
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (step.global_positions)


def pair_logprob(
    adapter: DiffusionAdapter, pairs: list[Pair], params: SamplingParams, policy: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute the log-prob of stored transitions: ([M] logprob, [M, *latent] mean, [M] std). Each row's
    sigma is its stored step's, so a family of several experts runs it on the expert that sampled it."""
    device = next(adapter.policy.parameters()).device
    trajs = [p.traj for p in pairs]
    x = torch.stack([t.latents[p.k] for t, p in zip(trajs, pairs)]).to(device)  # [M, *latent]
    nxt = torch.stack([t.next_latents[p.k] for t, p in zip(trajs, pairs)]).to(device)
    steps = torch.stack([t.step_indices[p.k] for t, p in zip(trajs, pairs)])
    sig = trajs[0].sigmas
    sigma, sigma_next = sig[steps].to(device), sig[steps + 1].to(device)  # [M]
    embeds = {k: e.to(device) for k, e in adapter.batch_embeds([t.embeds for t in trajs]).items()}
    v = adapter.velocity(x, sigma, embeds, params.guidance_scale, policy=policy)
    out = flow_step(
        v, x, sigma, sigma_next, float(sig[1]), params.noise_level, params.sde_type, prev_sample=nxt
    )
    return out.logprob, out.mean, out.std


def micro_batches(pairs: list[Pair], size: int, pad_from: Trajectory) -> list[list[Pair]]:
    """Split into micro-batches of `size` pairs, as many on every rank (step.equalise)."""
    return equalise([pairs[i : i + size] for i in range(0, len(pairs), size)], Pair(pad_from, 0, 0.0))


class DiffusionOps:
    """The diffusion half of an RL step (the module docstring); `omnirl.trainer.train` runs it."""

    def __init__(self, cfg: Config, adapter: DiffusionAdapter):
        self.cfg, self.adapter = cfg, adapter
        self.policy = adapter.policy
        self.loss_fn = get_loss(cfg.algo.loss, "diffusion")
        self.params = sampling_params(cfg)
        self.ref_model = build_reference(cfg, adapter)
        r = cfg.rollout
        self.engine = DiffusionEngine(
            adapter, r.max_num_seqs, r.max_num_batched_tokens, r.fused_cfg, r.compile
        )

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads: none beyond the loss's kind."""

    def offload_modules(self) -> list[nn.Module]:
        return self.adapter.offload_modules()

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        return make_requests(self.cfg, rows, step, dist, self.params, self.cfg.sampling.negative_prompt)[0]

    def validation_params(self) -> SamplingParams:
        return sampling_params(self.cfg, num_steps=self.cfg.validation.num_steps, ode=True)

    def generate(self, requests: list[Request], on_done: Callable[[list], None]) -> list[Trajectory]:
        return self.engine.generate(requests, on_batch=on_done)

    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[Pair]:
        k_steps = len(trajs[0].logprobs)  # trained steps per sample: the same for every sample of a step
        where = global_positions(
            gen, self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size * k_steps
        )
        pairs = [
            Pair(t, k, 1.0, position=where[t.request.index * k_steps + k])
            for t, kept in zip(trajs, keep.tolist())
            if kept
            for k in range(k_steps)
        ]
        return sorted(pairs, key=lambda p: p.position)

    def recompute_old(self, pairs: list[Pair], pad_traj: Trajectory) -> dict[str, float]:
        for mb in self.micro_batches(pairs, pad_traj):
            lp, _, _ = pair_logprob(self.adapter, mb, self.params)
            for p, v in zip(mb, lp.tolist()):
                p.old = v
        return {}

    def count(self, pairs: list[Pair]) -> float:
        return float(len(pairs))

    def micro_batches(self, pairs: list[Pair], pad_traj: Trajectory) -> list[list[Pair]]:
        return micro_batches(pairs, self.cfg.optim.micro_batch_size, pad_traj)

    def loss(self, mb: list[Pair], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        logprob, mean, std = pair_logprob(self.adapter, mb, self.params)
        device = logprob.device
        old = torch.tensor(
            [float(p.traj.logprobs[p.k]) if p.old is None else p.old for p in mb], device=device
        )
        adv = torch.tensor([p.traj.advantage for p in mb], device=device)
        w = torch.tensor([p.weight for p in mb], device=device)
        kl = None
        if cfg.algo.kl_beta > 0:
            with torch.no_grad(), reference(self.adapter, self.ref_model) as ref:
                _, mean_ref, _ = pair_logprob(self.adapter, mb, self.params, policy=ref)
            kl = flow_kl(mean, mean_ref, std)
        return self.loss_fn(
            logprob, old, adv, w, cfg.algo.clip_range, normaliser, kl=kl, kl_beta=cfg.algo.kl_beta
        )

    def measured(self) -> dict[str, float]:
        return {}

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list[Trajectory]) -> None:
        log_outputs(logger, step, [t.output for t in trajs[:8]], [t.request.prompt for t in trajs[:8]])


def log_outputs(logger: MetricsLogger, step: int, outputs: list[Output], captions: list[str]) -> None:
    """Samples by what the family produces: images as one grid, videos as mp4 files (with their own audio
    track where they have one), audio alone as wav files."""
    first = outputs[0]
    if first.image is not None:
        logger.log_images(step, "samples", [o.image for o in outputs], captions)
    if first.video is not None:
        audios = [o.audio for o in outputs] if first.audio is not None else None
        rate = first.sample_rate if audios else None
        logger.log_videos(step, "samples", [o.video for o in outputs], first.fps, captions, audios, rate)
    elif first.audio is not None:
        logger.log_audios(step, "samples", [o.audio for o in outputs], first.sample_rate, captions)


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
    needs none: its reference is the same model with the adapter disabled."""
    if cfg.model.finetune != "full" or cfg.algo.kl_beta == 0:
        return None
    return copy.deepcopy(adapter.policy).requires_grad_(False).eval()
