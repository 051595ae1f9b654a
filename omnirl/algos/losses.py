"""RL losses: LOSSES maps a name to a `LossSpec` ("module:function" and what its callers need to know);
each loss is called as `loss(inputs, algo, normaliser)` and returns (loss, metrics).

Every loss divides by the GLOBAL (all-ranks) count of the mini-batch's rows or tokens (`normaliser`),
rows of weight 0 padding short ranks, so the losses of all micro-batches on all ranks sum to the
mini-batch mean that FSDP's summed gradients need. Metrics are detached sums and counts, never means,
so the trainer can add them over micro-batches and ranks before dividing. Our own code: the clipped
policy-gradient objectives are a few lines each, and the normalisation is ours to get right.

The losses live by kind in omnirl.algos.diffusion_losses and omnirl.algos.token_losses, their input
records in omnirl.algos.loss_records; all are exported here.

How it works: docs/extending.md#how-to-add-a-loss (the token losses:
docs/algorithms.md#the-token-losses-grpo-dapo-drgrpo-gspo)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

# The losses and their records, exported here as this module's own.
from omnirl.algos.diffusion_losses import dgpo_loss as dgpo_loss
from omnirl.algos.diffusion_losses import dgpo_margin as dgpo_margin
from omnirl.algos.diffusion_losses import diffusion_nft_loss as diffusion_nft_loss
from omnirl.algos.diffusion_losses import flow_dppo_loss as flow_dppo_loss
from omnirl.algos.diffusion_losses import flow_grpo_loss as flow_grpo_loss
from omnirl.algos.diffusion_losses import flow_kl as flow_kl
from omnirl.algos.diffusion_losses import grpo_guard_loss as grpo_guard_loss
from omnirl.algos.loss_records import DGPOInputs as DGPOInputs
from omnirl.algos.loss_records import NFTInputs as NFTInputs
from omnirl.algos.loss_records import RowInputs as RowInputs
from omnirl.algos.loss_records import TokenInputs as TokenInputs
from omnirl.algos.token_losses import grpo_loss as grpo_loss
from omnirl.algos.token_losses import gspo_loss as gspo_loss
from omnirl.config import AlgoConfig
from omnirl.errors import ConfigError


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: what it trains and what its callers compute for it, so no caller branches on
    a loss's name. The function is called as `fn(inputs, algo, normaliser)` with the input record of its
    rows (`RowInputs`, `NFTInputs`, `TokenInputs`), the run's `AlgoConfig` and the global normaliser."""

    kind: str  # the kind of model it trains: an adapter class's `kind`
    fn: str  # "module:function", the loss
    ops: str = ""  # "module:Class": the ops of a loss whose training rows are not its kind's (omnirl.ops)
    logprobs: bool = True  # it reads the rollout's log-probs (old_logprob, correction, a stochastic step)
    divergence: bool = False  # it reads RowInputs.divergence (so the rollout records each step's mean)
    check: str = ""  # "module:function" refusing the AlgoConfig settings it cannot run with (ConfigError)
    # A loss's own settings are the AlgoConfig section of its name here (algo.flow_dppo, algo.diffusion_nft,
    # algo.dgpo), with their ranges (omnirl.config).


LOSSES = {
    "flow_grpo": LossSpec("diffusion", "omnirl.algos.diffusion_losses:flow_grpo_loss"),
    "flow_dppo": LossSpec("diffusion", "omnirl.algos.diffusion_losses:flow_dppo_loss", divergence=True),
    "grpo_guard": LossSpec("diffusion", "omnirl.algos.diffusion_losses:grpo_guard_loss", divergence=True),
    "diffusion_nft": LossSpec(
        "diffusion",
        "omnirl.algos.diffusion_losses:diffusion_nft_loss",
        ops="omnirl.ops.nft:NFTOps",
        logprobs=False,
        check="omnirl.algos.losses:check_nft",
    ),
    "dgpo": LossSpec(
        "diffusion",
        "omnirl.algos.diffusion_losses:dgpo_loss",
        ops="omnirl.ops.dgpo:DGPOOps",
        logprobs=False,
        check="omnirl.algos.losses:check_dgpo",
    ),
    "grpo": LossSpec("omni", "omnirl.algos.token_losses:grpo_loss"),
    "gspo": LossSpec("omni", "omnirl.algos.token_losses:gspo_loss", check="omnirl.algos.losses:check_gspo"),
}


def loss_spec(name: str, kind: str | None = None) -> LossSpec:
    """The LOSSES entry of `name`; with `kind`, a loss of another kind of model is a ConfigError naming the
    losses that kind can train with."""
    if name not in LOSSES:
        raise ConfigError(f"unknown algo.loss {name!r}; known losses: {', '.join(sorted(LOSSES))}")
    spec = LOSSES[name]
    if kind is not None and spec.kind != kind:
        fits = sorted(n for n, s in LOSSES.items() if s.kind == kind)
        raise ConfigError(
            f"algo.loss {name!r} trains {spec.kind} models; {kind} models train with {', '.join(fits)}"
        )
    return spec


def _resolve(path: str) -> Callable:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def get_loss(name: str, kind: str | None = None) -> Callable:
    """The loss function registered under `name` in LOSSES, imported on first use (`loss_spec` checks the
    name and the kind)."""
    return _resolve(loss_spec(name, kind).fn)


def check_loss(algo: AlgoConfig) -> None:
    """The algo settings that algo.loss cannot run with, as a ConfigError: a loss without log-probs and
    recomputed old log-probs, and what the loss's own `check` refuses."""
    spec = loss_spec(algo.loss)
    if not spec.logprobs and algo.old_logprob == "recompute":
        raise ConfigError(f"algo.old_logprob recompute: algo.loss {algo.loss} uses no log-probs")
    if spec.check:
        _resolve(spec.check)(algo)


def check_nft(algo: AlgoConfig) -> None:
    if algo.adv_clip is None:
        raise ConfigError(
            "algo.adv_clip null: algo.loss diffusion_nft needs a number (its optimality probability is "
            "A / (2 adv_clip) + 0.5)"
        )


def check_dgpo(algo: AlgoConfig) -> None:
    dgpo = algo.dgpo
    if dgpo.clip_kl and not dgpo.trust_region:
        raise ConfigError("algo.dgpo.clip_kl needs algo.dgpo.trust_region: it clips by its ratio")
    if dgpo.timesteps > dgpo.max_step + 1:
        raise ConfigError(
            f"algo.dgpo.timesteps ({dgpo.timesteps}) must be at most algo.dgpo.max_step + 1 "
            f"({dgpo.max_step + 1}): the times are drawn without replacement from steps 0 .. max_step"
        )


def check_gspo(algo: AlgoConfig) -> None:
    # GSPO's objective weighs every response the same; token_mean (and dr_grpo's token sum) weigh a
    # response by its length, which is another objective under GSPO's name.
    if algo.aggregation != "seq_mean":
        raise ConfigError(
            f"algo.loss 'gspo' is sequence-level: algo.aggregation must be 'seq_mean', got "
            f"{algo.aggregation!r} (which weighs responses by their length)"
        )
