"""The kind-specific halves of an RL step, behind one Protocol, and the parts both kinds run the same way.

`omnirl.trainer.train` is the loop; what depends on the kind of model (an adapter class's `kind`) lives in
one ops object per kind: `ops.diffusion.DiffusionOps` (a training row is one (sample, trained denoising
step) pair) and `ops.omni.OmniOps` (a training row is one response). A loss that trains on rows of its
own names its ops class in its `LossSpec.ops` instead: `ops.nft.NFTOps` (diffusion_nft: a row is a clean
sample, a time and a noise), which reuses DiffusionOps's rollout. `KindOps` lists every member the loop and
`omnirl.step.update` call. Generation and scoring (`rollout_and_score`) and validation (`validate`) are
written once for both kinds, in `omnirl.scoring`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from omnirl import distributed as D
from omnirl.algos.losses import loss_spec
from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.metrics import MetricsLogger
from omnirl.models import get_adapter
from omnirl.models.base import Request
from omnirl.rewards import check_modalities, check_reward_paths

# The ops of each adapter kind (the adapter class's `kind` attribute), resolved when asked for; a loss
# whose training rows are not its kind's names its own (`LossSpec.ops`).
OPS = {
    "diffusion": "omnirl.ops.diffusion:DiffusionOps",
    "omni": "omnirl.ops.omni:OmniOps",
}


class KindOps(Protocol):
    """What the loop (`omnirl.trainer.train`) and the update (`omnirl.step.update`) need from a kind.

    A row is whatever the kind trains on (it has a `weight`: 1 for real rows, 0 for padding rows)."""

    adapter: Any  # the DiffusionAdapter / OmniAdapter
    policy: nn.Module  # the trained module (the FSDP root): adapter.policy
    ref_model: nn.Module | None  # the frozen reference copy of a full fine-tune with KL, else None
    sleepable: Any  # a rollout engine with weights of its own (`sleep()` / `wake()`: vLLM), else None

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads (a ConfigError naming the field)."""
        ...

    def offload_modules(self) -> list[nn.Module]:
        """Modules only the rollout needs (text encoders, VAE): they sleep during training."""
        ...

    def prompt_problem(self, row: PromptRow) -> str | None:
        """Why the data row's prompt cannot run on the loaded model (too long for it), or None; every row
        is checked before step 0 (`omnirl.data.check_prompts`)."""

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        """This rank's requests of a training step (`batching.make_requests` with the kind's parameters)."""
        ...

    def validation_params(self) -> Any:
        """The sampling parameters of validation requests."""
        ...

    def generate(self, requests: list[Request], on_done: Callable[[list], None]) -> list:
        """Trajectories in request order; `on_done` gets each finished group of them as soon as it is
        done (a packed batch, or one response), so rewards are scored while the rest generates."""
        ...

    def update_rows(self, trajs: list, keep: torch.Tensor, gen: torch.Generator) -> list:
        """This rank's rows of the kept samples, each with its `position` in the step's shuffle of every
        rank's rows (`batching.global_positions` with `gen`), in that order."""
        ...

    def recompute_old(self, rows: list, pad_traj: Any) -> dict[str, float]:
        """Record the behaviour policy's log-probs on every row (old_logprob recompute), under no_grad,
        in `micro_batches`; returns metric sums."""
        ...

    def count(self, rows: list) -> float:
        """This rank's share of the loss normaliser of a mini-batch (pairs, tokens or responses)."""
        ...

    def micro_batches(self, rows: list, pad_traj: Any) -> list[list]:
        """The micro-batches of `rows`, as many on every rank (`equalise`, padding rows from `pad_traj`)."""
        ...

    def loss(self, micro_batch: list, normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        """Forward and loss of one micro-batch; `measure` is True for the first mini-batch of the update
        (the policy the rollout sampled from, before any optimizer step)."""
        ...

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        """The end of an update that took `optimizer_steps` optimizer steps (the same on every rank): global
        metrics of the update that are not sums (e.g. actor-rollout consistency). Collective: every rank
        calls it once per update."""
        ...

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors beyond the policy's weights and the optimizer that the run's state holds (DiffusionNFT's
        soft-updated old policy), by name: checkpoints save them and resuming loads into these very
        tensors. Empty for most losses."""
        ...

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list) -> None:
        """Write the step's sample outputs (image grid, videos, audio, texts)."""
        ...


def ops_class(kind: str, loss: str) -> type:
    """The ops class of a loss (checked to train this kind by `loss_spec`) on an adapter of `kind`."""
    module, cls = (loss_spec(loss, kind).ops or OPS[kind]).split(":")
    return getattr(importlib.import_module(module), cls)


def check_before_loading(cfg: Config) -> tuple[type, type]:
    """Everything about the recipe's names and pairings that can be checked before any weights load: the
    adapter, the loss and the kind of model it trains, the kind's own settings, and that every reward reads
    a modality the model produces and finds what it loads at its `reward.paths`. Returns (adapter class, ops
    class)."""
    adapter_cls = get_adapter(cfg.model.adapter)
    loss_spec(cfg.algo.loss, adapter_cls.kind)
    ops_cls = ops_class(adapter_cls.kind, cfg.algo.loss)
    ops_cls.check_config(cfg)
    check_modalities(cfg.reward.weights, adapter_cls.modalities, cfg.model.adapter)
    check_reward_paths(cfg.reward.weights, cfg.reward.paths)
    return adapter_cls, ops_cls
