"""The parity gate: the trainer's log-prob of the rollout's recorded steps (diffusion) or tokens (omni)
against the rollout's own, at the first update of a run and every `health.parity_every` steps.

No extra forward runs: every update already measures the gap on the forwards of the policy the rollout
sampled from (`consistency/*`: `DiffusionOps.measured` per trained timestep index and, for a latent of
several streams, per stream; `OmniOps.measured` per span of response positions). The gate reads those
numbers, always logs the largest, and stops the run with one line naming the family, the stream and
timestep (or the positions, and the worst position among them) and the gap when the mean gap of one
place passes the tolerance of the rollout's precision (`health.parity_tolerance`).
"""

from __future__ import annotations

import re

from omnirl.config import Config
from omnirl.config_checks import fp8_trained

TIMESTEP = re.compile(r"^consistency/t(\d+)/logprob_abs_diff_mean$")
STREAM = re.compile(r"^consistency/t(\d+)/([a-z]+)/logprob_abs_diff_mean$")
SPAN = re.compile(r"^consistency/pos(\d+)_(\d+)/logprob_abs_diff_mean$")


class ParityError(RuntimeError):
    """The rollout's log-probs drifted from the trainer's past the tolerance: the run stops (one
    `error:` line, exit status 1). `gap`: the gap that passed it."""

    def __init__(self, line: str, gap: float):
        super().__init__(line)
        self.gap = gap


def precision(cfg: Config) -> str:
    """The precision whose tolerance applies: vllm (rollout.backend), fp8 (an FP8 rollout of the trained
    steps), bf16 (a bf16 policy or FSDP2 compute) or fp32."""
    if cfg.rollout.backend == "vllm":
        return "vllm"
    if fp8_trained(cfg):
        return "fp8"
    if cfg.model.dtype != "float32" or cfg.distributed.param_dtype != "float32":
        return "bf16"
    return "fp32"


def gaps(metrics: dict[str, float]) -> dict[str, float]:
    """Where -> mean gap of every place the update measured: `stream S, timestep index T` (a latent of
    several streams, LTX-2: each stream apart), `stream latent, timestep index T` (one latent),
    `response positions LO-HI (the worst position P: G)` (omni, per span of positions; a span of one
    position: `response position P`), else
    `response tokens` (omni, all tokens)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if m := STREAM.match(k):
            out[f"stream {m.group(2)}, timestep index {int(m.group(1))}"] = v
    if not out:
        for k, v in metrics.items():
            if m := TIMESTEP.match(k):
                out[f"stream latent, timestep index {int(m.group(1))}"] = v
    for k, v in metrics.items():
        if m := SPAN.match(k):
            lo, hi = int(m.group(1)), int(m.group(2))
            base = k.removesuffix("/logprob_abs_diff_mean")
            at = int(metrics[f"{base}/worst_position"])
            worst = f"the worst position {at}: {metrics[f'{base}/worst_position_gap']:.3g}"
            out[f"response position {lo}" if lo == hi else f"response positions {lo}-{hi} ({worst})"] = v
    if not out and "consistency/logprob_abs_diff_mean" in metrics and "consistency/tokens" in metrics:
        out[f"response tokens (mean over {int(metrics['consistency/tokens'])} tokens)"] = metrics[
            "consistency/logprob_abs_diff_mean"
        ]
    return out


def gate(cfg: Config, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """Check one update's measured gaps; returns what is logged (health/parity_gap, the largest mean
    gap, and health/parity_tolerance), or raises a ParityError naming the place of the largest gap. Nothing
    measured (a loss without log-probs, DiffusionNFT; vLLM without its log-probs): nothing to check."""
    tol = cfg.health.parity_tolerance[precision(cfg)]
    measured = gaps(metrics)
    if not measured:
        return {}
    nan = [w for w, g in measured.items() if g != g]
    where, gap = (nan[0], float("nan")) if nan else max(measured.items(), key=lambda kv: kv[1])
    out = {"health/parity_gap": gap, "health/parity_tolerance": tol}
    if not gap <= tol:  # NaN fails too
        raise ParityError(
            f"step {step}: parity gate: {cfg.model.adapter} {where}: the trainer's log-prob differs from "
            f"the rollout's by {gap:.3g} on average, past the {precision(cfg)} tolerance {tol:g} "
            "(health.parity_tolerance): the rollout does not sample the policy being trained",
            gap,
        )
    return out


def due(cfg: Config, step: int, first: bool) -> bool:
    """Whether this step's update is checked: the run's first update, then every parity_every steps."""
    every = cfg.health.parity_every
    return cfg.health.parity and (first or (every > 0 and step % every == 0))
