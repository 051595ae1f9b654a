"""Generation and scoring, written once for both kinds of model.

- `rollout_step`: a training step's samples: `rollout_and_score`, then Sol-RL's regeneration when asked for.
- `rollout_and_score`: a kind's generation with each finished batch scored in the reward pool meanwhile.
- `collect_scores`: the reward pool's results, set on the trajectories.
- `regenerate_selected`: Sol-RL's bf16 regeneration of the FP8 samples chosen for training.
- `nonfinite_parts`: which tensors of a sample hold NaN or infinity (such a sample is never scored).
- `validate`: the validation samples and their global mean reward.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from omnirl import distributed as D
from omnirl.config import Config
from omnirl.data.edit import open_inputs
from omnirl.data.prompts import PromptRow
from omnirl.distributed import derive_seed
from omnirl.models.base import Request
from omnirl.ops import KindOps
from omnirl.phase_clock import PhaseClock, recording
from omnirl.rewards.pool import RewardPool


def rollout_step(
    cfg: Config, ops: KindOps, rewards: RewardPool, requests: list[Request], stats: dict[str, float]
) -> tuple[list, dict[str, np.ndarray]]:
    """The samples a training step trains on, scored: those of `rollout_and_score`; with Sol-RL's
    selection (rollout.fp8.select k: explore in FP8, train on bf16 regenerations) the bf16 regenerations of
    the k best and k worst of each group (`regenerate_selected`). Writes the timings into `stats`."""
    trajs, per_reward = rollout_and_score(ops, rewards, requests, stats)
    select = cfg.rollout.fp8.select
    if not select:
        return trajs, per_reward
    return regenerate_selected(ops, rewards, trajs, select, stats)


def rollout_and_score(
    ops: KindOps, rewards: RewardPool, requests: list[Request], stats: dict[str, float] | None = None
) -> tuple[list, dict[str, np.ndarray]]:
    """Generate and score: each finished batch (or response) is scored in the reward pool while the rest
    generates. Sets `reward` on every trajectory; returns them in request order with the per-reward scores
    (in finishing order, which is all the logged means need). A sample holding NaN or infinity
    (`nonfinite_parts`) is never scored: a NaN image would be scored as a black one. Its reward stays NaN,
    and `omnirl.step.update` handles it as train.on_nonfinite says. Writes into `stats`, when given,
    `time/generate_s` (the generation, scoring overlapped), `time/score_wait_s` (the scoring still left
    after it), `time/vae_decode_s` (the VAE decode's part of the generation, device time; 0 for a family
    without one) and `time/memory_probe_s` (the memory probes' part: 0 but where a batch shape is new)."""
    scored = []
    start = time.perf_counter()

    def submit(trajs: list) -> None:
        trajs = [t for t in trajs if not nonfinite_parts(t)]  # never scored: their reward stays NaN
        if not trajs:
            return
        outputs = [t.output for t in trajs]
        prompts, metadata = [t.request.prompt for t in trajs], [t.request.metadata for t in trajs]
        scored.append((trajs, rewards.submit(outputs, prompts, metadata)))

    clock = PhaseClock(ops.adapter.device, prefix="time/")
    with recording(clock):
        trajs = ops.generate(requests, submit)
    generated = time.perf_counter()
    per_reward = collect_scores(rewards, scored, start, generated, stats)
    if stats is not None:
        parts = clock.totals()  # the VAE decode's and the memory probes' (every rank logs both: per_rank)
        for key in ("time/vae_decode_s", "time/memory_probe_s"):
            stats[key] = parts.get(key, 0.0)
    return trajs, per_reward


def collect_scores(
    rewards, scored: list[tuple[list, Any]], start: float, generated: float, stats: dict[str, float] | None
) -> dict[str, np.ndarray]:
    """Wait for the reward pool's results of `scored` ([(trajectories, pending result)], submitted during
    the generation that ran from `start` to `generated`, perf_counter seconds), set each trajectory's
    `reward` and return the per-reward scores in submission order. Writes into `stats`, when given,
    `time/generate_s` (the generation, scoring overlapped) and `time/score_wait_s` (the scoring still
    left after it)."""
    per: dict[str, list[np.ndarray]] = {name: [] for name in rewards.weights}  # a rank may score nothing
    rewards.score_held()  # latent rewards, here, on every rank (omnirl.rewards.pool)
    for trajs, pending in scored:
        result = rewards.result(pending)
        for t, r in zip(trajs, result.total.tolist()):
            t.reward = r
        for k, v in result.per_reward.items():
            per.setdefault(k, []).append(v)
    if stats is not None:
        stats["time/generate_s"] = generated - start
        stats["time/score_wait_s"] = time.perf_counter() - generated
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in per.items()}


def regenerate_selected(
    ops: Any, rewards: RewardPool, trajs: list, k: int, stats: dict[str, float]
) -> tuple[list, dict[str, np.ndarray]]:
    """Sol-RL's second stage (rollout.fp8.select k, an FP8 diffusion rollout: `ops` is a DiffusionOps):
    of each group of FP8 samples `trajs`, the k best and the k worst by reward (among the scored ones; a
    group with fewer than 2k scored samples keeps all of them) are generated again in bf16 from the same
    requests, hence from the same seeds and noise, and scored again. Returns the regenerated trajectories
    and their per-reward scores: what the update trains on. Writes rollout/explore_reward_mean (the FP8
    pool's) and time/regenerate_s into `stats`."""
    groups: dict[int, list] = {}
    for t in trajs:
        if math.isfinite(t.reward):
            groups.setdefault(t.request.group_id, []).append(t)
    chosen = []
    for members in groups.values():
        ranked = sorted(members, key=lambda t: t.reward)
        chosen += ranked if len(ranked) <= 2 * k else ranked[:k] + ranked[-k:]
    chosen.sort(key=lambda t: t.request.index)
    scored = [t.reward for t in trajs if math.isfinite(t.reward)]
    stats["rollout/explore_reward_mean"] = sum(scored) / len(scored) if scored else math.nan
    again: dict[str, float] = {}
    with ops.engine.in_bf16():
        out = rollout_and_score(ops, rewards, [t.request for t in chosen], again)
    stats["time/regenerate_s"] = again["time/generate_s"] + again["time/score_wait_s"]
    return out


def nonfinite_parts(traj) -> list[str]:
    """The names of a trajectory's floating-point tensors that hold NaN or infinity: its latents and
    log-probs (an omni model's token log-probs: non-finite logits), its embeddings and inputs, and its
    output's image, video or audio."""
    values = {f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)}
    values |= {f"output.{m}": getattr(traj.output, m) for m in ("image", "video", "audio")}
    for name in [n for n, v in values.items() if isinstance(v, dict)]:
        values |= {f"{name}.{k}": v for k, v in values.pop(name).items()}
    return [
        name
        for name, v in values.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]


def validate(
    cfg: Config, ops: KindOps, rewards: RewardPool, rows: list[PromptRow], dist: D.DistInfo
) -> dict[str, float]:
    """validation.num_samples samples per prompt with the kind's validation parameters (diffusion: the ODE
    sampler; omni: validation.temperature / top_p); the global mean reward. Rows are dealt to ranks
    round-robin and seeds come from the global (row, sample) index, so the samples do not depend on the
    number of ranks."""
    n, params = cfg.validation.num_samples, ops.validation_params()
    requests = []
    for i in range(dist.rank, len(rows), dist.world_size):
        inputs = open_inputs(rows[i].inputs)
        for j in range(n):
            index = i * n + j
            seed = derive_seed(cfg.run.seed, -1, index)
            requests.append(
                Request(
                    rows[i].prompt,
                    i,
                    index,
                    seed,
                    params,
                    cfg.sampling.negative_prompt,
                    rows[i].metadata,
                    inputs,
                )
            )
    trajs, _ = rollout_and_score(ops, rewards, requests)
    scored = [x.reward for x in trajs if math.isfinite(x.reward)]  # non-finite samples are not scored
    t = D.all_reduce(torch.tensor([sum(scored), float(len(scored)), float(len(trajs))], dtype=torch.float64))
    return {
        "val/reward": (t[0] / t[1]).item() if t[1] else math.nan,
        "val/nonfinite_samples": (t[2] - t[1]).item(),
    }
