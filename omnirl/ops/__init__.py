"""The kind-specific halves of an RL step, behind one Protocol, and the parts both kinds run the same way.

`omnirl.trainer.train` is the loop; what depends on the kind of model (an adapter class's `kind`) lives in
one ops object per kind: `ops.diffusion.DiffusionOps` (a training row is one (sample, trained denoising
step) pair) and `ops.omni.OmniOps` (a training row is one response). A loss that trains on rows of its
own names its ops class instead: `ops.nft.NFTOps` (diffusion_nft: a row is a clean sample, a time and a
noise), which reuses DiffusionOps's rollout. `KindOps` lists every member the loop and
`omnirl.step.update` call. Generation and scoring (`rollout_and_score`) and validation (`validate`) are
written once, here, for both kinds.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from omnirl import distributed as D
from omnirl.algos.losses import get_loss
from omnirl.config import Config
from omnirl.data.edit import open_inputs
from omnirl.data.prompts import PromptRow
from omnirl.metrics import MetricsLogger
from omnirl.models import get_adapter
from omnirl.models.base import Request, derive_seed
from omnirl.rewards import check_modalities
from omnirl.rewards.pool import RewardPool
from omnirl.step import collect_scores

# The ops of each adapter kind (the adapter class's `kind` attribute), and of the losses whose training
# rows are not their kind's (keyed by the loss's name), resolved when asked for.
OPS = {
    "diffusion": "omnirl.ops.diffusion:DiffusionOps",
    "omni": "omnirl.ops.omni:OmniOps",
    "diffusion_nft": "omnirl.ops.nft:NFTOps",
}


class KindOps(Protocol):
    """What the loop (`omnirl.trainer.train`) and the update (`omnirl.step.update`) need from a kind.

    A row is whatever the kind trains on (it has a `weight`: 1 for real rows, 0 for padding rows)."""

    adapter: Any  # the DiffusionAdapter / OmniModelBase
    policy: nn.Module  # the trained module (the FSDP root): adapter.policy
    ref_model: nn.Module | None  # the frozen reference copy of a full fine-tune with KL, else None
    sleepable: Any  # a rollout engine with weights of its own (`sleep()` / `wake()`: vLLM), else None

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads (a ConfigError naming the field)."""

    def offload_modules(self) -> list[nn.Module]:
        """Modules only the rollout needs (text encoders, VAE): they sleep during training."""

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        """This rank's requests of a training step (`step.make_requests` with the kind's parameters)."""

    def validation_params(self) -> Any:
        """The sampling parameters of validation requests."""

    def generate(self, requests: list[Request], on_done: Callable[[list], None]) -> list:
        """Trajectories in request order; `on_done` gets each finished group of them as soon as it is
        done (a packed batch, or one response), so rewards are scored while the rest generates."""

    def update_rows(self, trajs: list, keep: torch.Tensor, gen: torch.Generator) -> list:
        """This rank's rows of the kept samples, each with its `position` in the step's shuffle of every
        rank's rows (`step.global_positions` with `gen`), in that order."""

    def recompute_old(self, rows: list, pad_traj: Any) -> dict[str, float]:
        """Record the behaviour policy's log-probs on every row (old_logprob recompute), under no_grad,
        in `micro_batches`; returns metric sums."""

    def count(self, rows: list) -> float:
        """This rank's share of the loss normaliser of a mini-batch (pairs, tokens or responses)."""

    def micro_batches(self, rows: list, pad_traj: Any) -> list[list]:
        """The micro-batches of `rows`, as many on every rank (`equalise`, padding rows from `pad_traj`)."""

    def loss(self, micro_batch: list, normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        """Forward and loss of one micro-batch; `measure` is True for the first mini-batch of the update
        (the policy the rollout sampled from, before any optimizer step)."""

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        """The end of an update that took `optimizer_steps` optimizer steps (the same on every rank): global
        metrics of the update that are not sums (e.g. actor-rollout consistency). Collective: every rank
        calls it once per update."""

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors beyond the policy's weights and the optimizer that the run's state holds (DiffusionNFT's
        soft-updated old policy), by name: checkpoints save them and resuming loads into these very
        tensors. Empty for most losses."""

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list) -> None:
        """Write the step's sample outputs (image grid, videos, audio, texts)."""


def ops_class(kind: str, loss: str) -> type:
    """The ops class of a loss (checked to train this kind by `get_loss`) on an adapter of `kind`."""
    module, cls = OPS[loss if loss in OPS else kind].split(":")
    return getattr(importlib.import_module(module), cls)


def check_before_loading(cfg: Config) -> tuple[type, type]:
    """Everything about the recipe's names and pairings that can be checked before any weights load: the
    adapter, the loss and the kind of model it trains, the kind's own settings, and that every reward reads
    a modality the model produces. Returns (adapter class, ops class)."""
    adapter_cls = get_adapter(cfg.model.adapter)
    get_loss(cfg.algo.loss, adapter_cls.kind)
    ops_cls = ops_class(adapter_cls.kind, cfg.algo.loss)
    ops_cls.check_config(cfg)
    check_modalities(cfg.reward.weights, adapter_cls.modalities, cfg.model.adapter)
    return adapter_cls, ops_cls


def rollout_and_score(
    ops: KindOps, rewards: RewardPool, requests: list[Request], stats: dict[str, float] | None = None
) -> tuple[list, dict[str, np.ndarray]]:
    """Generate and score: each finished batch (or response) is scored in the reward pool while the rest
    generates. Sets `reward` on every trajectory; returns them in request order with the per-reward scores
    (in finishing order, which is all the logged means need). A sample holding NaN or infinity
    (`nonfinite_parts`) is never scored: a NaN image would be scored as a black one. Its reward stays NaN,
    and `omnirl.step.update` handles it as train.on_nonfinite says. Writes into `stats`, when given,
    `time/generate_s` (the generation, scoring overlapped) and `time/score_wait_s` (the scoring still left
    after it)."""
    scored = []
    start = time.perf_counter()

    def submit(trajs: list) -> None:
        trajs = [t for t in trajs if not nonfinite_parts(t)]  # never scored: their reward stays NaN
        if not trajs:
            return
        outputs = [t.output for t in trajs]
        prompts, metadata = [t.request.prompt for t in trajs], [t.request.metadata for t in trajs]
        scored.append((trajs, rewards.submit(outputs, prompts, metadata)))

    trajs = ops.generate(requests, submit)
    return trajs, collect_scores(rewards, scored, start, time.perf_counter(), stats)


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


def shard(cfg: Config, ops: KindOps, dist: D.DistInfo) -> dict[str, float]:
    """FSDP2 over the policy and over the reference copy of a full fine-tune, the frozen weights as
    distributed.frozen_base says: a LoRA's base replicated (only the trained parameters sharded), sharded
    with them, or sharded and offloaded to host memory; a full fine-tune's reference copy sharded like
    the actor, offloaded with 'offload' (its actor, all trained, stays on the device). Returns the bytes
    of frozen parameters this rank then holds and the part of them on its device (`frozen_bytes`), which
    the trainer logs every step (mem/frozen_bytes, mem/frozen_device_bytes), and prints them with the way
    the rollout gathers the weights."""
    if cfg.distributed.fsdp and dist.mesh is not None:
        _apply_fsdp(cfg, ops, dist)
    d = cfg.distributed
    models = [ops.policy] + ([ops.ref_model] if ops.ref_model is not None else [])
    held, on_device = (sum(n) for n in zip(*(D.frozen_bytes(m) for m in models)))
    D.print0(
        f"frozen weights: {d.frozen_base}, {held / 2**20:.1f} MiB on each rank ({on_device / 2**20:.1f} MiB "
        f"of it on the device); the rollout gathers weights per {d.rollout_gather}"
    )
    return {"mem/frozen_bytes": float(held), "mem/frozen_device_bytes": float(on_device)}


def _apply_fsdp(cfg: Config, ops: KindOps, dist: D.DistInfo) -> None:
    d, units = cfg.distributed, ops.adapter.fsdp_units()
    replicate = d.frozen_base == "replicate"
    offload = d.frozen_base == "offload"
    frozen = {p for p in ops.policy.parameters() if not p.requires_grad} if replicate else set()
    lora = cfg.model.finetune == "lora"
    # The reference copy's units are the policy's, by name (it is a copy of the policy). Named before the
    # policy is wrapped, and not by class: fully_shard gives each unit an FSDP subclass of its own class.
    names = {id(m): n for n, m in ops.policy.named_modules()}
    unit_names = [names[id(u)] for u in units]
    D.apply_fsdp(ops.policy, units, dist.mesh, d.param_dtype, d.reduce_dtype, frozen, offload and lora)
    if ops.ref_model is not None:
        ref_units = [ops.ref_model.get_submodule(n) for n in unit_names]
        D.apply_fsdp(ops.ref_model, ref_units, dist.mesh, d.param_dtype, d.reduce_dtype, offload=offload)
