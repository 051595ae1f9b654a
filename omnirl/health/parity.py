"""The parity gate: the trainer's log-prob of the rollout's recorded steps (diffusion) or tokens (omni)
against the rollout's own, at the first update of a run and every `health.parity_every` steps.

No extra forward runs: every update already measures the gap on the forwards of the policy the rollout
sampled from (`consistency/*`: `DiffusionOps.measured` per trained timestep index, `OmniOps.measured` over
the response tokens). The gate reads those numbers, always logs them, and stops the run with one line
naming the family, the stream, the timestep (or the tokens) and the gap when the mean gap of a timestep
(or of the tokens) passes the tolerance of the rollout's precision (`health.parity_tolerance`).
"""

from __future__ import annotations

import re

from omnirl.config import Config
from omnirl.config_checks import fp8_trained

TIMESTEP = re.compile(r"^consistency/t(\d+)/logprob_abs_diff_mean$")


class ParityError(RuntimeError):
    """The rollout's log-probs drifted from the trainer's past the tolerance: the run stops (one
    `error:` line, exit status 1)."""


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


def stream_name(cfg: Config) -> str:
    """The stream a diffusion gap is measured on: every stream of the family's latent together (LTX-2's
    log-prob is the sum of its video and audio streams'), else the one latent."""
    return "video+audio" if cfg.model.adapter == "ltx2" else "latent"


def gate(cfg: Config, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """Check one update's measured gaps; returns what is logged (health/parity_gap, the largest mean
    gap, and health/parity_tolerance), or raises a ParityError. Nothing measured (a loss without
    log-probs, DiffusionNFT; vLLM without its log-probs): nothing to check."""
    tol = cfg.health.parity_tolerance[precision(cfg)]
    per_t = {int(m.group(1)): v for k, v in metrics.items() if (m := TIMESTEP.match(k))}
    if per_t:
        t, gap = max(per_t.items(), key=lambda kv: kv[1])
        where = f"stream {stream_name(cfg)}, timestep index {t}"
    elif "consistency/logprob_abs_diff_mean" in metrics and "consistency/tokens" in metrics:
        gap = metrics["consistency/logprob_abs_diff_mean"]
        n = int(metrics["consistency/tokens"])
        worst = metrics.get("consistency/logprob_abs_diff_max", float("nan"))
        where = f"response tokens (mean over {n} tokens; the worst token {worst:.3g})"
    else:
        return {}
    out = {"health/parity_gap": gap, "health/parity_tolerance": tol}
    if not gap <= tol:  # NaN fails too
        raise ParityError(
            f"step {step}: parity gate: {cfg.model.adapter} {where}: the trainer's log-prob differs from "
            f"the rollout's by {gap:.3g} on average, past the {precision(cfg)} tolerance {tol:g} "
            "(health.parity_tolerance): the rollout does not sample the policy being trained"
        )
    return out


def due(cfg: Config, step: int, first: bool) -> bool:
    """Whether this step's update is checked: the run's first update, then every parity_every steps."""
    every = cfg.health.parity_every
    return cfg.health.parity and (first or (every > 0 and step % every == 0))
