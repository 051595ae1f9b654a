"""The RL loop: rollout -> reward -> advantage -> update -> log -> validate -> export.

Every rank holds the policy and runs rollout and training on it, one after the other. The rollout
calls the very module the optimizer updates, so an update is visible to the next rollout with no
weight transfer.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.algos.losses import flow_kl, get_loss
from omnirl.config import Config, ConfigError
from omnirl.data.edit import load_edit_rows, open_inputs
from omnirl.data.prompts import PromptRow, load_prompts, step_prompt_indices
from omnirl.memory import Sleeper, module_tensors, optimizer_state, phase
from omnirl.metrics import MetricsLogger
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams, Trajectory, derive_seed
from omnirl.models.flow_sde import flow_step
from omnirl.rewards.pool import RewardPool
from omnirl.rollout.diffusion import DiffusionEngine


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


def make_requests(
    cfg: Config, rows: list[PromptRow], step: int, dist: D.DistInfo
) -> tuple[list[Request], list[PromptRow]]:
    """This rank's requests of a step: a contiguous share of the step's prompts, `group_size` each.

    The global request index (and so the seed) depends only on the step and the prompt's position in
    the step, never on the rank: a run on another number of ranks draws the same samples.
    """
    per_step, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if per_step % dist.world_size:
        raise ConfigError(
            f"rollout.prompts_per_step ({per_step}) must divide by the number of ranks ({dist.world_size})"
        )
    share = per_step // dist.world_size
    indices = step_prompt_indices(len(rows), step, per_step, cfg.run.seed)
    params = sampling_params(cfg)
    requests, req_rows = [], []
    for pos in range(dist.rank * share, (dist.rank + 1) * share):
        row = rows[indices[pos]]
        inputs = open_inputs(row.inputs)  # read once per step: the group's requests share its images
        for j in range(group):
            index = pos * group + j
            requests.append(
                Request(
                    prompt=row.prompt,
                    group_id=pos,
                    index=index,
                    seed=derive_seed(cfg.run.seed, step, index),
                    params=params,
                    negative_prompt=cfg.sampling.negative_prompt,
                    metadata=row.metadata,
                    inputs=inputs,
                )
            )
            req_rows.append(row)
    return requests, req_rows


def to_pil(image: torch.Tensor):
    from PIL import Image

    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()  # [H, W, 3]
    return Image.fromarray(array)


def rollout_and_score(
    engine: DiffusionEngine, rewards: RewardPool, requests: list[Request]
) -> tuple[list[Trajectory], dict[str, np.ndarray]]:
    """Generate and score; each finished batch is scored in the pool while the next one denoises.

    Sets `reward` on every trajectory; returns them in request order with the per-reward scores (in
    batch order, which is all the logged means need)."""
    scored = []

    def submit(trajs: list[Trajectory]) -> None:
        images = [to_pil(t.image) for t in trajs]
        metadata = [t.request.metadata for t in trajs]
        scored.append((trajs, rewards.submit(images, [t.request.prompt for t in trajs], metadata)))

    trajs = engine.generate(requests, on_batch=submit)
    per: dict[str, list[np.ndarray]] = {}
    for batch, future in scored:
        result = rewards.result(future)
        for t, r in zip(batch, result.total.tolist()):
            t.reward = r
        for k, v in result.per_reward.items():
            per.setdefault(k, []).append(v)
    return trajs, {k: np.concatenate(v) for k, v in per.items()}


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


def make_pairs(trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[Pair]:
    pairs = [Pair(t, k, 1.0) for t, kept in zip(trajs, keep.tolist()) if kept for k in range(len(t.logprobs))]
    perm = torch.randperm(len(pairs), generator=gen).tolist()
    return [pairs[i] for i in perm]


def micro_batches(pairs: list[Pair], size: int, pad_from: Trajectory) -> list[list[Pair]]:
    """Split into micro-batches; every rank runs the same (all-reduced max) number of them, short ranks
    padding with zero-weight rows, so FSDP collectives line up and no rank's gradient is biased."""
    n = torch.tensor([math.ceil(len(pairs) / size)])
    D.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    out = [pairs[i * size : (i + 1) * size] for i in range(int(n))]
    return [mb if mb else [Pair(pad_from, 0, 0.0)] for mb in out]


def update(cfg: Config, adapter, ref_model, optimizer, loss_fn, trajs, keep, step: int) -> dict[str, float]:
    """One RL step's policy update over the stored transitions of this rank."""
    params = trajs[0].request.params
    model = adapter.transformer
    gen = torch.Generator().manual_seed(derive_seed(cfg.run.seed, step, -1))
    # Every rank must hold the same keys: reduce_metrics all-reduces them as one tensor.
    sums: dict[str, float] = {"train/skipped_nonfinite": 0.0}
    pairs_all = make_pairs(trajs, keep, gen)
    if cfg.algo.old_logprob == "recompute":
        with torch.no_grad():
            for mb in micro_batches(pairs_all, cfg.optim.micro_batch_size, trajs[0]):
                lp, _, _ = pair_logprob(adapter, mb, params)
                for p, v in zip(mb, lp.tolist()):
                    p.old = v
    for _ in range(cfg.optim.epochs):
        for chunk in np.array_split(np.arange(len(pairs_all)), cfg.optim.mini_batches):
            pairs = [pairs_all[i] for i in chunk]
            total = D.all_reduce(torch.tensor([float(len(pairs))]))
            if total.item() == 0:
                continue  # no rank kept anything: nothing to learn from this step
            optimizer.zero_grad(set_to_none=True)
            mb_sums: dict[str, float] = {}
            finite_loss = True
            for mb in micro_batches(pairs, cfg.optim.micro_batch_size, trajs[0]):
                logprob, mean, std = pair_logprob(adapter, mb, params)
                device = logprob.device
                old = torch.tensor(
                    [float(p.traj.logprobs[p.k]) if p.old is None else p.old for p in mb], device=device
                )
                adv = torch.tensor([p.traj.advantage for p in mb], device=device)
                w = torch.tensor([p.weight for p in mb], device=device)
                kl = None
                if cfg.algo.kl_beta > 0:
                    with torch.no_grad(), reference(adapter, ref_model) as ref:
                        _, mean_ref, _ = pair_logprob(adapter, mb, params, transformer=ref)
                    kl = flow_kl(mean, mean_ref, std)
                loss, m = loss_fn(
                    logprob, old, adv, w, cfg.algo.clip_range, total.item(), kl=kl, kl_beta=cfg.algo.kl_beta
                )
                loss.backward()
                finite_loss &= bool(torch.isfinite(loss.detach()))
                for k, v in m.items():
                    mb_sums[k] = mb_sums.get(k, 0.0) + float(v)
            sync_grads(cfg, model)
            grad_norm = clip_grads(cfg, adapter)
            if skip_nonfinite(cfg, step, finite_loss, grad_norm):
                optimizer.zero_grad(set_to_none=True)
                sums["train/skipped_nonfinite"] += 1
                continue
            optimizer.step()
            for k, v in mb_sums.items():  # a skipped update's (non-finite) loss metrics are not logged
                sums[k] = sums.get(k, 0.0) + v
            sums["train/grad_norm_sum"] = sums.get("train/grad_norm_sum", 0.0) + grad_norm
            sums["train/updates"] = sums.get("train/updates", 0.0) + 1
    return sums


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


def sync_grads(cfg: Config, model: nn.Module) -> None:
    """Without FSDP on several ranks, sum the (already globally normalised) gradients by hand."""
    if cfg.distributed.fsdp or not torch.distributed.is_initialized():
        return
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            D.all_reduce(p.grad)


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with train.on_nonfinite 'stop'; the message names the step."""


def skip_nonfinite(cfg: Config, step: int, finite_loss: bool, grad_norm: float) -> bool:
    """Whether this optimizer step must be skipped because some rank saw a non-finite loss or gradient
    norm. The verdict is all-reduced so that every rank skips (or stops) together: a rank stepping
    alone would desynchronise the replicas, or hang FSDP in the next collective."""
    bad = torch.tensor([float(not finite_loss), float(not math.isfinite(grad_norm))])
    bad_loss, bad_grad = D.all_reduce(bad, op=torch.distributed.ReduceOp.MAX).tolist()
    if not (bad_loss or bad_grad):
        return False
    what = " and ".join(w for w, b in (("loss", bad_loss), ("gradient norm", bad_grad)) if b)
    msg = f"step {step}: non-finite {what} (on at least one rank; this rank's grad norm {grad_norm})"
    if cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; the weights were not updated (train.on_nonfinite: stop)")
    D.print0(f"warning: {msg}; the update is skipped (train.on_nonfinite: skip)")
    return True


def clip_grads(cfg: Config, adapter) -> float:
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):  # FSDP2 parameters give a DTensor norm
        norm = norm.full_tensor()
    return float(norm)


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    keys = sorted(sums)
    t = D.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, t.tolist()))


def summarise(sums: dict[str, float], world_size: int) -> dict[str, float]:
    """Turn all-reduced sums into the means that are logged."""
    out = {}
    count = sums.get("loss/count", 0.0)
    if count:
        out["loss/policy"] = sums["loss/policy_sum"] / count
        out["loss/clip_frac"] = sums["loss/clip_count"] / count
        out["loss/ratio"] = sums["loss/ratio_sum"] / count
        out["loss/approx_kl"] = sums["loss/approx_kl_sum"] / count
        out["loss/kl"] = sums.get("loss/kl_sum", 0.0) / count
    updates = sums.get("train/updates", 0.0)
    if updates:
        out["train/grad_norm"] = sums["train/grad_norm_sum"] / updates
        out["train/updates"] = updates / world_size
    out["train/skipped_nonfinite"] = sums["train/skipped_nonfinite"] / world_size
    return out


def reward_stats(per: dict[str, np.ndarray]) -> dict[str, float]:
    """Global mean of each named reward (the weighted total's mean and std come with the advantages)."""
    keys = sorted(per)
    t = D.all_reduce(
        torch.tensor([float(per[k].sum()) for k in keys] + [float(len(per[keys[0]]))], dtype=torch.float64)
    )
    return {f"reward/{k}": t[i].item() / t[-1].item() for i, k in enumerate(keys)}


def validate(cfg: Config, engine: DiffusionEngine, rewards: RewardPool, rows, dist) -> dict[str, float]:
    params = sampling_params(cfg, num_steps=cfg.validation.num_steps, ode=True)
    mine = rows[dist.rank :: dist.world_size]
    requests = [
        Request(
            r.prompt,
            i,
            i,
            derive_seed(cfg.run.seed, -1, i),
            params,
            cfg.sampling.negative_prompt,
            r.metadata,
            open_inputs(r.inputs),
        )
        for i, r in enumerate(mine)
    ]
    trajs, _ = rollout_and_score(engine, rewards, requests)
    t = D.all_reduce(torch.tensor([sum(x.reward for x in trajs), float(len(trajs))], dtype=torch.float64))
    return {"val/reward": (t[0] / t[1]).item()}


def train(cfg: Config) -> dict[str, float]:
    """Run the recipe; returns the last step's logged metrics."""
    dist = D.init_distributed(cfg.distributed.timeout_s)
    D.seed_everything(cfg.run.seed)
    resume = checkpoint.find_resume(cfg)  # a checkpoint of another model fails here, before any loading
    skipped: list[str] | None = [] if cfg.data.on_bad_row == "skip" else None
    load_rows = {"prompts": load_prompts, "edit": load_edit_rows}[cfg.data.format]
    rows = load_rows(cfg.data.train_path, skipped)
    val_rows = load_rows(cfg.data.val_path, skipped) if cfg.validation.every and cfg.data.val_path else []
    if skipped:
        D.print0(f"warning: skipped {len(skipped)} malformed data rows (data.on_bad_row: skip):")
        D.print0("\n".join(f"  {e}" for e in skipped))
    # Names are checked before the model loads: a typo should not cost minutes of loading first.
    loss_fn = get_loss(cfg.algo.loss)
    rewards = RewardPool(cfg.reward.weights, cfg.reward.num_workers, cfg.reward.timeout_s)
    adapter = get_adapter(cfg.model.adapter)(cfg, dist.device)
    ref_model = build_reference(cfg, adapter)
    shard(cfg, adapter, ref_model, dist)
    optimizer = torch.optim.AdamW(
        [p for p in adapter.transformer.parameters() if p.requires_grad],
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    start, history = 0, []
    if resume is not None:
        start, history = checkpoint.load(resume, cfg, adapter.transformer, optimizer, dist)
    engine = DiffusionEngine(
        adapter,
        cfg.rollout.max_num_seqs,
        cfg.rollout.max_num_batched_tokens,
        cfg.rollout.fused_cfg,
        cfg.rollout.compile,
    )
    logger = MetricsLogger(cfg.run.output_dir, dist.is_main, cfg.log.tensorboard, start, history)
    logger.progress(cfg.run.steps, initial=start)
    sleeper = Sleeper(dist.device) if cfg.memory.sleep else None
    logs: dict[str, float] = {}
    for step in range(start, cfg.run.steps):
        stats: dict[str, float] = {}
        step_start = time.perf_counter()
        requests, _ = make_requests(cfg, rows, step, dist)
        # Each phase sleeps what only the other one uses (DESIGN.md 4c). The gradients are dead after a
        # step (every update starts from zero_grad(set_to_none=True)): dropped, not carried to the host.
        optimizer.zero_grad(set_to_none=True)
        train_only = {
            "optimizer": optimizer_state(optimizer),
            "reference": module_tensors([ref_model] if ref_model is not None else []),
        }
        with phase("rollout", stats, sleeper, sleep=train_only, wake=["offload"]):
            trajs, per_reward = rollout_and_score(engine, rewards, requests)
        rewards_t = torch.tensor([t.reward for t in trajs])
        groups = torch.tensor([t.request.group_id for t in trajs])
        adv, keep, adv_metrics = group_advantages(rewards_t, groups, cfg.algo.adv_clip, cfg.algo.global_std)
        for t, a in zip(trajs, adv.tolist()):
            t.advantage = a
        rollout_only = {"offload": module_tensors(adapter.offload_modules())}
        with phase("train", stats, sleeper, sleep=rollout_only, wake=list(train_only)):
            sums = update(cfg, adapter, ref_model, optimizer, loss_fn, trajs, keep, step)
        logs = {
            **reward_stats(per_reward),
            **adv_metrics,
            **summarise(reduce_metrics(sums), dist.world_size),
            **stats,
        }
        logs["time/step_s"] = time.perf_counter() - step_start
        if step == 0 and skipped is not None:
            logs["data/skipped_rows"] = len(skipped)
        if cfg.validation.every and val_rows and (step + 1) % cfg.validation.every == 0:
            # The optimizer state stays awake: a checkpoint saved after validation reads it.
            with phase("validate", logs, sleeper, wake=["offload"]):
                logs.update(validate(cfg, engine, rewards, val_rows, dist))
        logger.log(step, logs)
        if cfg.log.image_every and step % cfg.log.image_every == 0:
            logger.log_images(
                step, "samples", [t.image for t in trajs[:8]], [t.request.prompt for t in trajs[:8]]
            )
        logger.update(step, logs["reward/mean"], logs["time/step_s"])
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.run.steps):
            checkpoint.save(cfg, step + 1, adapter.transformer, optimizer, dist)
    if cfg.export.lora_at_end and cfg.model.finetune == "lora":
        export_lora(cfg, adapter, dist)
    rewards.close()
    logger.close()
    return logs


def build_reference(cfg: Config, adapter) -> nn.Module | None:
    """Full fine-tuning with KL keeps a frozen copy of the initial transformer (sharded like the actor);
    LoRA needs none: its reference is the same model with the adapter disabled."""
    if cfg.model.finetune != "full" or cfg.algo.kl_beta == 0:
        return None
    ref = copy.deepcopy(adapter.transformer).requires_grad_(False).eval()
    return ref


def shard(cfg: Config, adapter, ref_model, dist: D.DistInfo) -> None:
    if not cfg.distributed.fsdp or dist.mesh is None:
        return
    model = adapter.transformer
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


def export_lora(cfg: Config, adapter, dist: D.DistInfo) -> None:
    """Gather the full (unsharded) LoRA on every rank, write it from rank 0 in the diffusers format."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        adapter.transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.is_main:
        adapter.export_lora(f"{cfg.run.output_dir}/lora", state)
