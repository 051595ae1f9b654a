"""The RL loop: rollout -> reward -> advantage -> update -> log -> validate -> export.

One loop for diffusion and omni models. Every rank holds the policy and runs rollout and training on it,
one after the other. The rollout calls the very module the optimizer updates, so an update is visible to
the next rollout with no weight transfer.

What depends on the kind of model (the adapter's declared `kind`) lives in one ops object per kind: how a
step's requests are made, rolled out and scored, what a training row is, how a micro-batch's loss is
computed, validation. `DiffusionOps` is below; `omnirl.omni_train.OmniOps` is the omni one. The rest of a
step (the update loop, micro-batch padding, the global normaliser, the non-finite guard, the metric
reduction) is shared, in `omnirl.step`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.algos.losses import flow_kl, get_loss
from omnirl.config import Config, ConfigError
from omnirl.data.edit import load_edit_rows, open_inputs
from omnirl.data.mmk12 import load_mmk12
from omnirl.data.prompts import PromptRow, load_prompts
from omnirl.memory import Sleeper, module_tensors, optimizer_state, phase
from omnirl.metrics import MetricsLogger
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams, Trajectory, derive_seed
from omnirl.models.flow_sde import flow_step
from omnirl.omni_train import OmniOps
from omnirl.rewards.pool import RewardPool
from omnirl.rollout.diffusion import DiffusionEngine
from omnirl.step import collect_scores, equalise, make_requests, reward_stats, update


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
    )


def to_pil(image: torch.Tensor):
    from PIL import Image

    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()  # [H, W, 3]
    return Image.fromarray(array)


def rollout_and_score(
    engine: DiffusionEngine,
    rewards: RewardPool,
    requests: list[Request],
    stats: dict[str, float] | None = None,
) -> tuple[list[Trajectory], dict[str, np.ndarray]]:
    """Generate and score; each finished batch is scored in the pool while the next one denoises.

    Sets `reward` on every trajectory; returns them in request order with the per-reward scores (in
    batch order, which is all the logged means need). Writes into `stats`, when given, `time/generate_s`
    (the generation, scoring overlapped) and `time/score_wait_s` (the scoring still left after it)."""
    scored = []
    start = time.perf_counter()

    def submit(trajs: list[Trajectory]) -> None:
        images = [to_pil(t.image) for t in trajs]
        metadata = [t.request.metadata for t in trajs]
        scored.append((trajs, rewards.submit(images, [t.request.prompt for t in trajs], metadata)))

    trajs = engine.generate(requests, on_batch=submit)
    return trajs, collect_scores(rewards, scored, start, time.perf_counter(), stats)


@dataclass
class Pair:
    """One (sample, trained step) row of the update."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    old: float | None = None  # behaviour log-prob recomputed by the trainer (old_logprob: recompute)


def pair_logprob(
    adapter, pairs: list[Pair], params: SamplingParams, transformer: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute the log-prob of stored transitions: ([M] logprob, [M, *latent] mean, [M] std)."""
    device = next(adapter.transformer.parameters()).device
    trajs = [p.traj for p in pairs]
    x = torch.stack([t.latents[p.k] for t, p in zip(trajs, pairs)]).to(device)  # [M, *latent]
    nxt = torch.stack([t.next_latents[p.k] for t, p in zip(trajs, pairs)]).to(device)
    steps = torch.stack([t.step_indices[p.k] for t, p in zip(trajs, pairs)])
    sig = trajs[0].sigmas
    sigma, sigma_next = sig[steps].to(device), sig[steps + 1].to(device)  # [M]
    embeds = {k: e.to(device) for k, e in adapter.batch_embeds([t.embeds for t in trajs]).items()}
    v = adapter.velocity(x, sigma, embeds, params.guidance_scale, transformer=transformer)
    out = flow_step(
        v, x, sigma, sigma_next, float(sig[1]), params.noise_level, params.sde_type, prev_sample=nxt
    )
    return out.logprob, out.mean, out.std


def micro_batches(pairs: list[Pair], size: int, pad_from: Trajectory) -> list[list[Pair]]:
    """Split into micro-batches of `size` pairs, as many on every rank (step.equalise)."""
    return equalise([pairs[i : i + size] for i in range(0, len(pairs), size)], Pair(pad_from, 0, 0.0))


class DiffusionOps:
    """The diffusion half of an RL step (Flow-GRPO and relatives): a training row is one (sample, trained
    denoising step) pair, and its loss the clipped ratio of that step's Gaussian log-prob (`flow_step`)."""

    def __init__(self, cfg: Config, adapter):
        self.cfg, self.adapter = cfg, adapter
        self.module = adapter.transformer
        self.loss_fn = get_loss(cfg.algo.loss)
        self.params = sampling_params(cfg)
        self.ref_model = build_reference(cfg, adapter)
        self.engine = DiffusionEngine(
            adapter,
            cfg.rollout.max_num_seqs,
            cfg.rollout.max_num_batched_tokens,
            cfg.rollout.fused_cfg,
            cfg.rollout.compile,
        )

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads."""
        if cfg.algo.loss != "flow_grpo":
            raise ConfigError(f"algo.loss {cfg.algo.loss!r}: diffusion models train with flow_grpo")

    def offload_modules(self) -> list[nn.Module]:
        return self.adapter.offload_modules()

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        return make_requests(self.cfg, rows, step, dist, self.params, self.cfg.sampling.negative_prompt)[0]

    def rollout_and_score(self, rewards: RewardPool, requests: list[Request], stats: dict | None = None):
        return rollout_and_score(self.engine, rewards, requests, stats)

    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[Pair]:
        pairs = [
            Pair(t, k, 1.0) for t, kept in zip(trajs, keep.tolist()) if kept for k in range(len(t.logprobs))
        ]
        perm = torch.randperm(len(pairs), generator=gen).tolist()
        return [pairs[i] for i in perm]

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
                _, mean_ref, _ = pair_logprob(self.adapter, mb, self.params, transformer=ref)
            kl = flow_kl(mean, mean_ref, std)
        return self.loss_fn(
            logprob, old, adv, w, cfg.algo.clip_range, normaliser, kl=kl, kl_beta=cfg.algo.kl_beta
        )

    def measured(self) -> dict[str, float]:
        return {}

    def validate(self, rewards: RewardPool, rows: list[PromptRow], dist: D.DistInfo) -> dict[str, float]:
        cfg = self.cfg
        params = sampling_params(cfg, num_steps=cfg.validation.num_steps, ode=True)
        # Rows dealt to ranks round-robin; seeds from the global row index, so the validation images do
        # not depend on the number of ranks.
        requests = [
            Request(
                rows[i].prompt,
                i,
                i,
                derive_seed(cfg.run.seed, -1, i),
                params,
                cfg.sampling.negative_prompt,
                rows[i].metadata,
                open_inputs(rows[i].inputs),
            )
            for i in range(dist.rank, len(rows), dist.world_size)
        ]
        trajs, _ = rollout_and_score(self.engine, rewards, requests)
        t = D.all_reduce(torch.tensor([sum(x.reward for x in trajs), float(len(trajs))], dtype=torch.float64))
        return {"val/reward": (t[0] / t[1]).item()}

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list[Trajectory]) -> None:
        images, prompts = [t.image for t in trajs[:8]], [t.request.prompt for t in trajs[:8]]
        logger.log_images(step, "samples", images, prompts)


@contextlib.contextmanager
def reference(adapter, ref_model: nn.Module | None):
    """The reference policy: the frozen copy for full fine-tuning, else the same model with LoRA off."""
    if ref_model is not None:
        yield ref_model
        return
    model = adapter.transformer
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


# The ops of each adapter kind (the adapter class's `kind` attribute).
OPS = {"diffusion": DiffusionOps, "omni": OmniOps}
LOADERS = {"prompts": load_prompts, "edit": load_edit_rows, "mmk12": load_mmk12}


def train(cfg: Config) -> dict[str, float]:
    """Run the recipe; returns the last step's logged metrics."""
    dist = D.init_distributed(cfg.distributed.timeout_s)
    D.seed_everything(cfg.run.seed)
    resume = checkpoint.find_resume(cfg)  # a checkpoint of another model fails here, before any loading
    skipped: list[str] | None = [] if cfg.data.on_bad_row == "skip" else None
    rows = LOADERS[cfg.data.format](cfg.data.train_path, skipped)
    val_rows = (
        LOADERS[cfg.data.format](cfg.data.val_path, skipped)
        if cfg.validation.every and cfg.data.val_path
        else []
    )
    if skipped:
        D.print0(f"warning: skipped {len(skipped)} malformed data rows (data.on_bad_row: skip):")
        D.print0("\n".join(f"  {e}" for e in skipped))
    # Names and settings are checked before the model loads: a typo should not cost minutes of loading.
    get_loss(cfg.algo.loss)
    adapter_cls = get_adapter(cfg.model.adapter)
    ops_cls = OPS[adapter_cls.kind]
    ops_cls.check_config(cfg)
    rewards = RewardPool(cfg.reward.weights, cfg.reward.num_workers, cfg.reward.timeout_s)
    adapter = adapter_cls(cfg, dist.device)
    ops = ops_cls(cfg, adapter)
    shard(cfg, adapter, ops.module, ops.ref_model, dist)
    optimizer = torch.optim.AdamW(
        [p for p in ops.module.parameters() if p.requires_grad],
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    start, history = 0, []
    if resume is not None:
        start, history = checkpoint.load(resume, cfg, ops.module, optimizer, dist)
    logger = MetricsLogger(cfg.run.output_dir, dist.is_main, cfg.log.tensorboard, start, history)
    logger.progress(cfg.run.steps, initial=start)
    sleeper = Sleeper(dist.device) if cfg.memory.sleep else None
    logs: dict[str, float] = {}
    for step in range(start, cfg.run.steps):
        stats: dict[str, float] = {}
        step_start = time.perf_counter()
        requests = ops.requests(rows, step, dist)
        # Each phase sleeps what only the other one uses (DESIGN.md 4c). The gradients are dead after a
        # step (every update starts from zero_grad(set_to_none=True)): dropped, not carried to the host.
        optimizer.zero_grad(set_to_none=True)
        train_only = {
            "optimizer": optimizer_state(optimizer),
            "reference": module_tensors([ops.ref_model] if ops.ref_model is not None else []),
        }
        with phase("rollout", stats, sleeper, sleep=train_only, wake=["offload"]):
            trajs, per_reward = ops.rollout_and_score(rewards, requests, stats)
        rewards_t = torch.tensor([t.reward for t in trajs])
        groups = torch.tensor([t.request.group_id for t in trajs])
        adv, keep, adv_metrics = group_advantages(
            rewards_t, groups, cfg.algo.adv_clip, cfg.algo.global_std, std_normalise=cfg.algo.std_normalise
        )
        for t, a in zip(trajs, adv.tolist()):
            t.advantage = a
        rollout_only = {"offload": module_tensors(ops.offload_modules())}
        with phase("train", stats, sleeper, sleep=rollout_only, wake=list(train_only)):
            update_metrics = update(cfg, ops, optimizer, trajs, keep, step)
        logs = {**reward_stats(per_reward), **adv_metrics, **update_metrics, **stats}
        logs["time/step_s"] = time.perf_counter() - step_start
        if step == 0 and skipped is not None:
            logs["data/skipped_rows"] = len(skipped)
        if cfg.validation.every and val_rows and (step + 1) % cfg.validation.every == 0:
            # The optimizer state stays awake: a checkpoint saved after validation reads it.
            with phase("validate", logs, sleeper, wake=["offload"]):
                logs.update(ops.validate(rewards, val_rows, dist))
        logs.update(per_rank(logs))
        logger.log(step, logs)
        if cfg.log.image_every and step % cfg.log.image_every == 0:
            ops.log_samples(logger, step, trajs)
        logger.update(step, logs["reward/mean"], logs["time/step_s"])
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.run.steps):
            checkpoint.save(cfg, step + 1, ops.module, optimizer, dist)
    if cfg.export.lora_at_end and cfg.model.finetune == "lora":
        export_lora(cfg, adapter, ops.module, dist)
    rewards.close()
    logger.close()
    return logs


def per_rank(logs: dict[str, float]) -> dict[str, float]:
    """The rank-local measurements of a step (the peak device memory of each phase, generation and scoring
    wait) from every rank: `KEY/rankR` for each rank R, and KEY itself becomes the maximum over ranks (the
    GPU closest to its limit; the rank the others wait for). Collective: every rank holds the same keys."""
    keys = sorted(k for k in logs if k.endswith("_peak_gib") or k in ("time/generate_s", "time/score_wait_s"))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    table = torch.zeros(world, len(keys), dtype=torch.float64)  # [ranks, keys]: a sum of one row each
    table[rank] = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
    D.all_reduce(table)
    out = {f"{k}/rank{r}": table[r, i].item() for i, k in enumerate(keys) for r in range(world)}
    out.update({k: table[:, i].max().item() for i, k in enumerate(keys)})
    return out


def build_reference(cfg: Config, adapter) -> nn.Module | None:
    """Full fine-tuning with KL keeps a frozen copy of the initial transformer (sharded like the actor);
    LoRA needs none: its reference is the same model with the adapter disabled."""
    if cfg.model.finetune != "full" or cfg.algo.kl_beta == 0:
        return None
    ref = copy.deepcopy(adapter.transformer).requires_grad_(False).eval()
    return ref


def shard(cfg: Config, adapter, model: nn.Module, ref_model: nn.Module | None, dist: D.DistInfo) -> None:
    """FSDP2 over the trained `model` (a LoRA's frozen base stays replicated) and the reference copy."""
    if not cfg.distributed.fsdp or dist.mesh is None:
        return
    frozen = {p for p in model.parameters() if not p.requires_grad}
    D.apply_fsdp(
        model,
        adapter.fsdp_units(),
        dist.mesh,
        cfg.distributed.param_dtype,
        cfg.distributed.reduce_dtype,
        frozen,
    )
    if ref_model is not None:
        units = [b for b in ref_model.modules() if type(b) in {type(u) for u in adapter.fsdp_units()}]
        D.apply_fsdp(ref_model, units, dist.mesh, cfg.distributed.param_dtype, cfg.distributed.reduce_dtype)


def export_lora(cfg: Config, adapter, model: nn.Module, dist: D.DistInfo) -> None:
    """Gather the full (unsharded) LoRA of `model` to rank 0 and write it there in the adapter's format
    (diffusers for diffusion adapters, peft for omni ones). The frozen base is not gathered: at 30B
    parameters it would be ~60 GB of host memory for nothing."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    if dist.is_main:
        adapter.export_lora(f"{cfg.run.output_dir}/lora", state)
