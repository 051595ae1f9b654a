"""Alerts of the reward-hacking monitors, and what the run does about them (`health.on_alert`).

A rule compares one logged statistic with its threshold; it alerts once the statistic has stayed past it
for `health.patience` consecutive steps, and clears once it has stayed back for as many. Each alert is
recorded (step, metric, value, threshold) and printed as one line; the run's end prints them all and
writes them to output_dir/health_alerts.jsonl (`scripts/summarize_run.py` lists them).

`adapt` follows the adaptive KL controller of Ziegler et al. (2019, section 2.2), beta <- beta (1 + K e),
with e the relative distance of the worst adapting statistic from its threshold, clipped to [-1, 1],
positive on the wrong side; set before each update from that step's samples (`Health.before_update`),
the statistic taken one step ahead. The weight grows geometrically while diversity (or the guard reward)
falls and relaxes once it recovers, never below the recipe's algo.kl_beta. Details: docs/health.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnirl.config import Config


@dataclass(frozen=True)
class Rule:
    metric: str  # the logged key, health/...
    field: str  # the health.* threshold
    below: bool  # alerts when the value falls below the threshold (else when it passes above it)


RULES = (
    Rule("health/diversity_ratio", "diversity_min", below=True),
    Rule("health/colour_entropy_ratio", "entropy_min", below=True),
    Rule("health/dark_frac", "dark_max", below=False),
    Rule("health/saturated_frac", "saturated_max", below=False),
    Rule("health/repetition", "repetition_max", below=False),
    Rule("health/silence_frac", "silence_max", below=False),
    Rule("health/guard_drop", "guard_drop", below=False),
)
# The rules whose statistic the KL weight can hold up: a policy kept near its reference keeps its spread.
ADAPTING = ("health/diversity_ratio", "health/colour_entropy_ratio", "health/guard_drop")


@dataclass
class Alert:
    step: int
    metric: str
    value: float
    threshold: float
    action: str

    def line(self) -> str:
        side = "below" if next(r for r in RULES if r.metric == self.metric).below else "above"
        return (
            f"health: step {self.step}: {self.metric} {self.value:.4g} {side} its threshold "
            f"{self.threshold:g} (health.on_alert: {self.action})"
        )


class Alerts:
    """The state of every rule over the run; `observe` once per step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.past = {r.metric: 0 for r in RULES}  # consecutive steps past the threshold
        self.back = {r.metric: 0 for r in RULES}  # consecutive steps back since it alerted
        self.active: set[str] = set()
        self.history: list[Alert] = []
        self.base_beta = cfg.algo.kl_beta
        self.last: dict[str, float] = {}  # each adapting statistic's previous value (adapt's projection)

    def observe(self, step: int, logs: dict[str, float]) -> list[Alert]:
        """The alerts this step raises (each metric once per episode past its threshold)."""
        h, new = self.cfg.health, []
        for r in RULES:
            value = logs.get(r.metric, math.nan)
            if math.isnan(value):
                continue
            limit = getattr(h, r.field)
            bad = value < limit if r.below else value > limit
            self.past[r.metric] = self.past[r.metric] + 1 if bad else 0
            self.back[r.metric] = 0 if bad else self.back[r.metric] + 1
            if r.metric in self.active and self.back[r.metric] >= h.patience:
                self.active.discard(r.metric)
            if r.metric not in self.active and self.past[r.metric] >= h.patience:
                self.active.add(r.metric)
                alert = Alert(step, r.metric, value, limit, h.on_alert)
                self.history.append(alert)
                new.append(alert)
        return new

    def adapt(self, logs: dict[str, float]) -> float:
        """health.on_alert adapt: the next KL weight from this step's statistics (the module docstring)."""
        h, a = self.cfg.health, self.cfg.algo
        errors = []
        for r in RULES:
            value = logs.get(r.metric, math.nan)
            if r.metric not in ADAPTING or math.isnan(value):
                continue
            limit = getattr(h, r.field)
            # One step ahead: a move toward the wrong side goes on for the step the new weight takes to
            # reach the samples.
            last, self.last[r.metric] = self.last.get(r.metric, value), value
            value = value - max(0.0, last - value) if r.below else value + max(0.0, value - last)
            # Relative distance from the threshold, positive on the wrong side (a margin of 10% above a
            # lower bound counts as reached: the controller acts before the alert, not after).
            target = limit * 1.1 if r.below else limit
            e = (target - value) / max(abs(target), 1e-8) if r.below else (value - target) / max(target, 1e-8)
            errors.append(max(-1.0, min(1.0, e)))
        if not errors:
            return a.kl_beta
        e = max(errors)
        beta = a.kl_beta
        if e > 0 and beta < h.adapt_kl_init:
            beta = h.adapt_kl_init
        else:
            beta = beta * (1 + h.adapt_rate * e)
        if beta < max(self.base_beta, h.adapt_kl_init) and e < 0:
            beta = self.base_beta  # fully relaxed: back to the recipe's weight
        return min(beta, h.adapt_kl_max)
