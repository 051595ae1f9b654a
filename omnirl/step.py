"""The parts of an RL step that diffusion and omni models share: one copy, used by both kinds.

- `update`: the policy update over the rows that a kind's ops object builds (`ops.diffusion.DiffusionOps`:
  one row per (sample, trained denoising step); `ops.omni.OmniOps`: one row per response). The loop is the
  same for both: mini-batches, micro-batches of the same (all-reduced) number on every rank with
  zero-weight padding rows, losses divided by the global (all-reduced) count, gradient sync and clipping,
  the non-finite guard, and the reduction of the metrics over ranks (docs/architecture.md, invariants).
- `reward_stats`: the global mean of each named reward; `per_rank`: rank-local measurements of every rank.
- `assign_advantages`: the group-relative advantage of every sample.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.autotune import AutoCheckpointing
from omnirl.batching import split_mini_batches
from omnirl.config import Config
from omnirl.distributed import derive_seed
from omnirl.ops import KindOps
from omnirl.phase_clock import PhaseClock
from omnirl.rollout.compiled import compile_forwards, swapped
from omnirl.scoring import nonfinite_parts
from omnirl.train_fp8 import Fp8Update


class UpdateTuning:
    """What a run's updates carry from step to step: the pending `model.gradient_checkpointing: auto`
    decision (`omnirl.autotune`), the blocks compiled for training (`train.compile`, swapped in only while
    an update runs, as the rollout swaps its own), the FP8 base layers of `train.precision fp8`
    (`omnirl.train_fp8`), the clock of the update's parts, and the run's counts of the optimizer steps
    applied (`updates`) and skipped for non-finite values (`skipped`), which `check_learned` reads at the
    end of the run."""

    def __init__(self, cfg: Config, ops: KindOps):
        self.updates = self.skipped = 0.0
        self.auto = AutoCheckpointing(cfg.model.gradient_checkpointing)
        self.clock = PhaseClock(ops.adapter.device)
        self.compiled = compile_forwards(ops.adapter.fsdp_units()) if cfg.train.compile else []
        self.fp8: Fp8Update | None = None
        if cfg.train.precision == "fp8":
            D.check_fp8_matmul(ops.adapter.device)
            units, keep = ops.adapter.fsdp_units(), ops.adapter.fp8_keep_bf16
            self.fp8 = Fp8Update(units, keep, cfg.rollout.fp8.fast_accum)
        if hasattr(ops, "clock"):  # the ops that time a part of their loss (the KL reference pass)
            ops.clock = self.clock  # pyright: ignore[reportAttributeAccessIssue]

    @contextlib.contextmanager
    def running(self):
        """What an update runs under: the compiled blocks and the FP8 base layers swapped in."""
        with swapped(self.compiled), self.fp8.swapped() if self.fp8 else contextlib.nullcontext():
            yield


def update(
    cfg: Config,
    ops: KindOps,
    optimizer,
    trajs: list,
    keep: torch.Tensor,
    step: int,
    tuning: UpdateTuning | None = None,
) -> dict:
    """One RL step's policy update over this rank's samples; returns the logged (global) metrics, and
    adds the optimizer steps it applied and skipped to `tuning`'s counts.

    `keep` [N] bool marks the samples of groups with reward spread. Losses are divided by the global count
    of the mini-batch (`ops.count` all-reduced), so the gradients summed over micro-batches and ranks are
    the mini-batch mean. Mini-batches are cut from one shuffle of every rank's rows
    (`batching.global_positions`): they hold the same rows on any number of ranks, only the order of the
    sums differs; where groups were dropped they hold unequal numbers of rows (each divided by its own
    count)."""
    metrics = _update(cfg, ops, optimizer, trajs, keep, step, tuning)
    if tuning is not None:
        tuning.updates += metrics.get("train/updates", 0.0)
        tuning.skipped += metrics["train/skipped_nonfinite"]
    return metrics


def _update(
    cfg: Config,
    ops: KindOps,
    optimizer,
    trajs: list,
    keep: torch.Tensor,
    step: int,
    tuning: UpdateTuning | None,
) -> dict:
    gen = torch.Generator().manual_seed(derive_seed(cfg.run.seed, step, -1))
    world = D.rank_and_world()[1]
    if nonfinite := nonfinite_samples(cfg, trajs, step):  # the step's update is skipped, or the run stops
        sums = {"train/skipped_nonfinite": 1.0}  # one skipped update, on every rank
        return {
            **summarise(reduce_metrics(sums), world),
            **ops.measured(0),
            "rollout/nonfinite_samples": nonfinite,
        }
    # Every rank must hold the same keys: reduce_metrics all-reduces them as one tensor.
    sums: dict[str, float] = {"train/skipped_nonfinite": 0.0}
    tuning = tuning or UpdateTuning(cfg, ops)
    mark = tuning.clock.mark
    rows_all = ops.update_rows(trajs, keep, gen)
    if cfg.algo.old_logprob == "recompute":
        mark("recompute")
        with torch.no_grad(), tuning.running():
            sums.update(ops.recompute_old(rows_all, trajs[0]))
        mark("idle")
    # Eager, outside the compiled blocks: on the CPU the probe counts memory under a dispatch mode, which
    # compiled code does not run under.
    decided = probe(tuning, ops, optimizer, rows_all, trajs[0], cfg.optim.mini_batches)
    with tuning.running():
        first = True
        for _ in range(cfg.optim.epochs):
            for rows in split_mini_batches(rows_all, cfg.optim.mini_batches):
                measure, first = first, False
                total = D.all_reduce(torch.tensor([float(ops.count(rows))], dtype=torch.float64))
                if total.item() == 0:
                    continue  # no rank kept anything: nothing to learn from this mini-batch
                optimizer.zero_grad(set_to_none=True)
                mb_sums: dict[str, float] = {}
                finite_loss = True
                for mb in ops.micro_batches(rows, trajs[0]):
                    mark("forward")
                    loss, m = ops.loss(mb, total.item(), measure)
                    mark("backward")
                    loss.backward()
                    mark("idle")
                    finite_loss &= bool(torch.isfinite(loss.detach()))
                    for k, v in m.items():
                        mb_sums[k] = combine(k, mb_sums.get(k), float(v))
                mark("optimizer")
                sync_grads(cfg, ops.policy)
                grad_norm = clip_grads(cfg, ops.policy)
                if skip_nonfinite(cfg, step, finite_loss, grad_norm):
                    optimizer.zero_grad(set_to_none=True)
                    sums["train/skipped_nonfinite"] += 1
                    continue
                optimizer.step()
                mark("idle")
                for k, v in mb_sums.items():  # a skipped update's (non-finite) loss metrics are not logged
                    sums[k] = combine(k, sums.get(k), v)
                sums["train/grad_norm_sum"] = sums.get("train/grad_norm_sum", 0.0) + grad_norm
                sums["train/updates"] = sums.get("train/updates", 0.0) + 1
    mark("idle")
    steps = int(sums.get("train/updates", 0))  # skipped ones are not counted: the same on every rank
    return {
        **summarise(reduce_metrics(sums), world),
        **ops.measured(steps),
        "rollout/nonfinite_samples": 0.0,
        **decided,
        **tuning.clock.totals(),
    }


def probe(tuning: UpdateTuning, ops: KindOps, optimizer, rows: list, pad_traj, mini_batches: int) -> dict:
    """The pending auto decisions, made on the step's first micro-batch (collective: every rank calls it,
    also one whose rows are all dropped: it probes on padding rows)."""
    if not tuning.auto.pending:
        return tuning.auto.maybe_decide(ops, optimizer, None, 1.0)
    first = split_mini_batches(rows, mini_batches)[0]
    total = D.all_reduce(torch.tensor([float(ops.count(first))], dtype=torch.float64)).item()
    mbs = ops.micro_batches(first, pad_traj) if total else []
    with tuning.clock.alone("memory_probe"):  # the update's `time/train_memory_probe_s`
        return tuning.auto.maybe_decide(ops, optimizer, mbs[0] if mbs else None, max(total, 1.0))


def sync_grads(cfg: Config, model: nn.Module) -> None:
    """Without FSDP on several ranks, sum the (already globally normalised) gradients by hand."""
    if cfg.distributed.fsdp or not torch.distributed.is_initialized():
        return
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            D.all_reduce(p.grad)


class NonFiniteError(RuntimeError):
    """Training made NaN or infinity and the run ends (scripts/train.py reports it as one `error:` line,
    exit status 1, and nothing is exported): a non-finite sample, loss or gradient norm with
    train.on_nonfinite 'stop'; whatever train.on_nonfinite, a step whose every sample is non-finite, or a
    run that skipped every update. The message names the step."""


def nonfinite_samples(cfg: Config, trajs: list, step: int) -> float:
    """How many samples of the step, over all ranks, held NaN or infinity (`omnirl.scoring.nonfinite_parts`:
    they were not scored, their reward is NaN). Every one of them: a NonFiniteError, whatever
    train.on_nonfinite (the update is skipped, so the policy that made them stays as it is and would make
    them again). Some: with train.on_nonfinite 'stop' a NonFiniteError naming the step and this rank's
    first such request; with 'skip' a warning, and the caller skips the step's update on every rank (a
    policy that makes NaN samples would only learn NaN from them). Collective."""
    bad = [t for t in trajs if not math.isfinite(t.reward)]
    counts = D.all_reduce(torch.tensor([float(len(bad)), float(len(trajs))], dtype=torch.float64))
    total, samples = (int(c) for c in counts.tolist())
    if not total:
        return 0.0
    where = (
        f"; on this rank request {bad[0].request.index}: {', '.join(nonfinite_parts(bad[0]))}" if bad else ""
    )
    if total == samples:
        raise NonFiniteError(
            f"step {step}: all {total} samples hold NaN or infinity{where}: the policy makes no finite "
            "sample (a setting such as optim.lr or the family's made it diverge), so the run stops and "
            "exports nothing"
        )
    msg = f"step {step}: {total} samples hold NaN or infinity, so none of them was scored{where}"
    if cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(f"{msg}; the weights were not updated (train.on_nonfinite: stop)")
    D.print0(f"warning: {msg}; the update is skipped (train.on_nonfinite: skip)")
    return float(total)


def check_learned(steps: int, updates: float, skipped: float) -> None:
    """The end of a run of `steps` steps that applied `updates` optimizer steps and skipped `skipped` for
    non-finite values: a NonFiniteError when it skipped every one (nothing was learned, and the LoRA is
    not exported). A step that updates nothing because no group had reward spread skips nothing."""
    if skipped and not updates:
        raise NonFiniteError(
            f"every update of the run's {steps} steps was skipped ({int(skipped)} for NaN or infinity in "
            "samples, a loss or a gradient norm; train.on_nonfinite: skip): nothing was learned, so the run "
            "exports nothing"
        )


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


def clip_grads(cfg: Config, model: nn.Module) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):  # FSDP2 parameters give a DTensor norm
        norm = norm.full_tensor()
    return float(norm)


def combine(key: str, total: float | None, value: float) -> float:
    """Add a loss metric to its running total: a `*_max` metric keeps the largest value, the rest sum."""
    if total is None:
        return value
    return max(total, value) if key.endswith("_max") else total + value


# The namespaces of the losses' metrics: sums and counts over the rows of the "loss/count".
LOSS_METRICS = ("loss/", "dppo/", "nft/", "dgpo/")


def reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The metrics of all ranks: `*_max` metrics by their maximum, the others summed."""
    keys = sorted(k for k in sums if not k.endswith("_max"))
    maxima = sorted(k for k in sums if k.endswith("_max"))
    t = D.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    out = dict(zip(keys, t.tolist()))
    if maxima:
        m = D.all_reduce(
            torch.tensor([sums[k] for k in maxima], dtype=torch.float64), op=torch.distributed.ReduceOp.MAX
        )
        out.update(zip(maxima, m.tolist()))
    return out


def summarise(sums: dict[str, float], world_size: int) -> dict[str, float]:
    """Turn all-reduced sums into the means that are logged: a loss metric `X_sum` becomes the mean `X` and
    `X_count` the fraction `X_frac` over the summed "loss/count" (the rows, or tokens, of the losses);
    `X_max` stays as it is."""
    out = {}
    count = sums.get("loss/count", 0.0)
    if count:
        for k, v in sums.items():
            if k == "loss/count" or not k.startswith(LOSS_METRICS):
                continue
            if k.endswith("_sum"):
                out[k.removesuffix("_sum")] = v / count
            elif k.endswith("_count"):
                out[k.removesuffix("_count") + "_frac"] = v / count
            elif k.endswith("_max"):
                out[k] = v
        out.setdefault("loss/kl", 0.0)  # logged without a KL term too: 0
    corrected = sums.get("correction/count", 0.0)
    if corrected:
        out["correction/weight_mean"] = sums["correction/weight_sum"] / corrected
        out["correction/clip_frac"] = sums["correction/clip_count"] / corrected
    updates = sums.get("train/updates", 0.0)
    if updates:
        out["train/grad_norm"] = sums["train/grad_norm_sum"] / updates
        out["train/updates"] = updates / world_size
    out["train/skipped_nonfinite"] = sums["train/skipped_nonfinite"] / world_size
    return out


def reward_stats(per: dict[str, np.ndarray]) -> dict[str, float]:
    """Global mean of each named reward (the weighted total's mean and std come with the advantages); NaN
    when no sample of the step was scored (all non-finite)."""
    keys = sorted(per)
    t = D.all_reduce(
        torch.tensor([float(per[k].sum()) for k in keys] + [float(len(per[keys[0]]))], dtype=torch.float64)
    )
    return {f"reward/{k}": t[i].item() / t[-1].item() if t[-1] else math.nan for i, k in enumerate(keys)}


def per_rank(logs: dict[str, float]) -> dict[str, float]:
    """The rank-local measurements of a step (the peak device memory of each phase, the frozen weights
    held, generation, its VAE decode and scoring wait) from every rank: `KEY/rankR` for each rank R, and
    KEY itself becomes the maximum over ranks (the GPU closest to its limit; the rank the others wait for).
    Collective: every rank holds the same keys."""
    keys = sorted(
        k
        for k in logs
        if k.endswith("_peak_gib")
        or k.startswith("mem/frozen_")
        or k in ("time/generate_s", "time/score_wait_s", "time/vae_decode_s")
    )
    rank, world = D.rank_and_world()
    table = torch.zeros(world, len(keys), dtype=torch.float64)  # [ranks, keys]: a sum of one row each
    table[rank] = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
    D.all_reduce(table)
    out = {f"{k}/rank{r}": table[r, i].item() for i, k in enumerate(keys) for r in range(world)}
    out.update({k: table[:, i].max().item() for i, k in enumerate(keys)})
    return out


def assign_advantages(cfg: Config, trajs: list) -> tuple[torch.Tensor, dict[str, float]]:
    """Set each trajectory's group-relative advantage; returns (keep [N] bool: the samples of groups with
    reward spread, the advantage metrics)."""
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.request.group_id for t in trajs])
    # A non-finite sample was not scored (reward NaN): the scored ones alone make the statistics, and
    # `update` skips the step (or stops) because of it.
    scored = torch.isfinite(rewards)
    a = cfg.algo
    adv, kept, metrics = group_advantages(
        rewards[scored], groups[scored], a.adv_clip, a.global_std, std_normalise=a.std_normalise
    )
    keep = torch.zeros(len(trajs), dtype=torch.bool)
    keep[scored] = kept
    advantages = torch.zeros(len(trajs), dtype=adv.dtype)
    advantages[scored] = adv
    for t, value in zip(trajs, advantages.tolist()):
        t.advantage = value
    return keep, metrics
