"""The RL loop: rollout -> reward -> advantage -> update -> log -> validate -> checkpoint -> export.

One loop for diffusion and omni models. Every rank holds the policy and runs rollout and training on it,
one after the other. The rollout calls the very module the optimizer updates, so an update is visible to
the next rollout with no weight transfer. What depends on the kind of model is behind `omnirl.ops.KindOps`
(`ops/diffusion.py`, `ops/omni.py`); the update shared by both kinds is `omnirl.step.update`.
"""

from __future__ import annotations

import functools
import time

import torch

from omnirl import checkpoint, probe_cache
from omnirl import distributed as D
from omnirl.autotune import AutoSleep
from omnirl.config import Config
from omnirl.data import check_prompts, load_data
from omnirl.fsdp import shard
from omnirl.health import Health
from omnirl.memory import Phases, Sleeper
from omnirl.metrics import MetricsLogger
from omnirl.models import build_adapter
from omnirl.ops import check_before_loading
from omnirl.rewards.pool import RewardPool
from omnirl.rollout.compiled import CompileMeter, cached_graphs, use_cache_dir
from omnirl.scoring import rollout_step, validate
from omnirl.step import UpdateTuning, assign_advantages, check_learned, per_rank, reward_stats, update


def train(cfg: Config) -> dict[str, float]:
    """Run the recipe; returns the last step's logged metrics."""
    # A sharded or offloaded frozen base runs FSDP2, which needs a process group also on one device.
    dist = D.init_distributed(cfg.distributed.timeout_s, group=cfg.distributed.frozen_base != "replicate")
    D.seed_everything(cfg.run.seed)
    # First: a run already there, or an output_dir that cannot be written, fails before anything loads.
    D.lock_output_dir(cfg.run.output_dir)
    compile_cache(cfg)
    try:
        if cfg.distributed.mode == "async":  # rollout and update on disjoint ranks: a loop of its own
            from omnirl.async_mode import train_async

            return train_async(cfg, dist)
        return _train(cfg, dist)
    finally:
        D.unlock_output_dir(cfg.run.output_dir)  # a run refused before writing leaves no directory


def _train(cfg: Config, dist: D.DistInfo) -> dict[str, float]:
    resume = checkpoint.find_resume(cfg)  # a checkpoint of another model fails here, before any loading
    keep_probes(cfg, dist)
    rows, val_rows, skipped = load_data(cfg)
    _, ops_cls = check_before_loading(cfg)  # a typo should not cost minutes of loading
    adapter = build_adapter(cfg, dist.device)
    # After the model: a latent reward reads its latent space, and may run its blocks (before FSDP wraps them)
    r = cfg.reward
    rewards = RewardPool(r.weights, r.num_workers, r.timeout_s, r.paths, adapter=adapter, cfg=cfg)
    ops = ops_cls(cfg, adapter)
    # Prompts too long for the model: found now that its tokenizer is loaded, before anything is written.
    rows, val_rows = (check_prompts(r, ops.prompt_problem, skipped) for r in (rows, val_rows))
    health = Health(cfg, ops, rewards, dist)  # the LoRA proof: one error line before the first step
    frozen = shard(cfg, ops, dist)  # the frozen bytes each rank holds, logged every step
    o = cfg.optim
    trained = [p for p in ops.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    start, history = (0, [])
    if resume:
        start, history = checkpoint.load(resume, cfg, ops.policy, optimizer, dist, ops.state())
        health.resume(history)
    logger = MetricsLogger(cfg.run.output_dir, dist.is_main, cfg.log.tensorboard, start, history)
    logger.progress(cfg.run.steps, initial=start)
    phases = Phases(Sleeper(dist.device) if cfg.memory.sleep else None, optimizer, ops, rewards)
    AutoSleep(cfg.memory.sleep, phases, dist.device)  # what sleeps from step 1, from step 0's peaks
    tuning = UpdateTuning(cfg, ops)  # auto checkpointing, train.compile, the update's clock and counts
    compiled = CompileMeter()  # what each step spent compiling, and whether it compiled anything
    logs: dict[str, float] = {}
    try:
        for step in range(start, cfg.run.steps):
            began = time.perf_counter()
            # Each phase sleeps what only the other one uses; the rollout's compiling is logged apart.
            with phases.rollout() as stats, compiled.part("rollout"):
                trajs, per_reward = rollout_step(cfg, ops, rewards, ops.requests(rows, step, dist), stats)
            keep, adv_metrics = assign_advantages(cfg, trajs)
            with phases.train(stats):
                health.before_update(step, trajs)
                update_metrics = update(cfg, ops, optimizer, trajs, keep, step, tuning)
            logs = {**reward_stats(per_reward), **adv_metrics, **update_metrics, **stats, **frozen}
            logs |= {
                "time/step_s": time.perf_counter() - began,
                **compiled.take(),
                **skipped_rows(step, skipped),
            }
            if cfg.validation.every and val_rows and (step + 1) % cfg.validation.every == 0:
                with phases.validate(logs):
                    logs.update(validate(cfg, ops, rewards, val_rows, dist))
            logs.update(per_rank(logs))
            logs.update(health.after_step(step, logs, trajs, logger, phases.guard(logs)))
            logger.log(step, logs)
            if cfg.log.image_every and step % cfg.log.image_every == 0:
                ops.log_samples(logger, step, trajs)
            logger.update(step, logs["reward/mean"], logs["time/step_s"])
            save = functools.partial(checkpoint.save, cfg, step + 1, ops.policy, optimizer, dist, ops.state())
            # The checkpoint checkpoint.every asks for; then a failed check, or an alert with on_alert stop,
            # ends the run (saving this step's checkpoint first if it was not due).
            health.stop_if_needed(None if save(when_due=True) else save)
        check_learned(cfg.run.steps - start, tuning.updates, tuning.skipped)
        if cfg.export.lora_at_end and cfg.model.finetune == "lora":
            checkpoint.export_lora(cfg, ops.adapter, ops.policy, dist)
    finally:
        logger.close()  # ends the progress bar's line: an error reported now starts its own
        health.finish()  # the run's alerts, also when it stops
    rewards.close()
    return logs


def compile_cache(cfg: Config) -> None:
    """Where a run that compiles keeps its compiled graphs (`run.compile_cache`), said once at start with
    what it holds: an empty cache means a step 0 that compiles every graph."""
    g = cfg.generation
    if not (cfg.train.compile or cfg.rollout.compile or g.compile or g.compile_modules):
        return
    path = use_cache_dir(cfg.run.compile_cache)
    held = cached_graphs(path)
    what = f"{held} compiled graphs of earlier runs" if held else "empty: step 0 compiles every graph"
    D.print0(f"compile cache: {path} ({what})")


def keep_probes(cfg: Config, dist: D.DistInfo) -> None:
    """On an accelerator, step 0's memory probes are read from and kept in `omnirl.probe_cache`, beside the
    compile cache; on CPU, where they cost little and tests run the same shapes again and again, they are
    always measured."""
    if dist.device.type == "cpu":
        probe_cache.use(None)
        return
    rank, world = D.rank_and_world()
    cache = probe_cache.for_run(cfg, dist.device, rank, world, use_cache_dir(cfg.run.compile_cache))
    kept = sum(len(v) for v in cache.entries.values())
    D.print0(
        f"memory probes: {cache.path.parent} ({f'{kept} kept for these shapes' if kept else 'none kept'})"
    )
    probe_cache.use(cache)


def skipped_rows(step: int, skipped: list | None) -> dict[str, float]:
    """The count of data rows left out (`data.on_bad_row` skip), logged at the run's first step."""
    return {"data/skipped_rows": len(skipped)} if step == 0 and skipped is not None else {}
