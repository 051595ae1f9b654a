"""Training that cannot fool itself: the run's self-checks, on by default (`health:` section).

`Health` is what the trainer calls, at five points of the loop: built once the LoRA is attached (the
LoRA proof, `omnirl.health.lora`); `resume(history)` (the diversity baseline and adapted KL weight from
the rows logged before); `before_update(step, trajs)` (the fingerprint of the module the rollout runs,
the sample statistics `omnirl.health.monitors`, adapt's KL weight); `after_step(...)` (the fingerprint
check, the parity gate `omnirl.health.parity`, the guard set, the alerts `omnirl.health.alerts`; returns
the health/* metrics); `stop_if_needed(save)` and `finish()` (a fatal check or a stopping alert ends the
run on every rank together; the run's alerts printed and written).

How it works: docs/health.md
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnirl import distributed as D
from omnirl.config import Config
from omnirl.health import lora as L
from omnirl.health import monitors as M
from omnirl.health import parity as P
from omnirl.health.alerts import ADAPTING, Alert, Alerts
from omnirl.health.parity import ParityError

ALERTS_FILE = "health_alerts.jsonl"
GUARD_STEP = -2  # the guard's seeds: derive_seed(run.seed, GUARD_STEP, i), apart from training (>= 0) and
# validation's (-1)


class HealthError(RuntimeError):
    """A run that trains nothing or the wrong thing (an update that did not reach the rollout, the parity
    gate) or an alert with health.on_alert stop: one `error:` line, exit status 1."""


class Health:
    def __init__(self, cfg: Config, ops: Any, rewards: Any, dist: D.DistInfo):
        self.cfg, self.ops, self.rewards, self.dist = cfg, ops, rewards, dist
        self.trained = ops.adapter.trained_modules() if hasattr(ops.adapter, "trained_modules") else {}
        self.trained = self.trained or {"policy": ops.policy}
        self.full = cfg.model.finetune == "full"
        if cfg.health.lora_proof and not self.full:
            counts = L.census(cfg, self.trained)
            D.print0(f"health: LoRA proof: {L.describe(counts)}")
            L.check_census(cfg, counts)
        self.alerts = Alerts(cfg)
        self.first_update = True  # the run's first step that applied an optimizer step is still to come
        self.before: dict[str, float] | None = None
        self.reached = not cfg.health.lora_proof  # the first update reached the rollout's module
        self.fatal: str | None = None
        self.stop_alert: Alert | None = None
        self.baseline: dict[str, list[float]] = {"diversity": [], "colour_entropy": []}
        self.guard_first: float | None = None
        self.reward_first: list[float] = []
        self.guard_pool = None
        self.sample_stats: dict[str, float] | None = None  # this step's, from before_update
        self.last_guard: dict[str, float] = {}  # the last guard's drop, for adapt
        # rollout.backend vllm: the weights vLLM holds (its fingerprint after each rollout) must change after
        # the first optimizer step, which the next rollout's push carries to it
        self.vllm_watch = cfg.rollout.backend == "vllm" and cfg.health.lora_proof
        self.vllm_before: float | None = None  # the fingerprint of the last rollout before the first update
        self.vllm_pending = False  # an update came after it: the next rollout's must differ
        if self.vllm_watch:
            ops.engine.fingerprints = True

    def resume(self, history: list[dict]) -> None:
        """Continue a resumed run: the baseline of its first steps and its last adapted KL weight."""
        h = self.cfg.health
        for row in history:
            for k in self.baseline:
                if row.get("step", 0) < h.baseline_steps and f"health/{k}" in row:
                    self.baseline[k].append(row[f"health/{k}"])
            if "health/guard_reward" in row and self.guard_first is None:
                self.guard_first = row["health/guard_reward"]
            if row.get("step", 0) < h.baseline_steps and "reward/mean" in row:
                self.reward_first.append(row["reward/mean"])
        if history and "health/kl_beta" in history[-1]:
            self.cfg.algo.kl_beta = history[-1]["health/kl_beta"]
        if history:
            # adapt's one-step projection goes on from the last logged statistics
            self.alerts.last = {k: v for k, v in history[-1].items() if k in ADAPTING}
            self.first_update = False
            self.reached = True
            self._stop_watching_vllm()

    def before_update(self, step: int, trajs: list) -> None:
        """Before the step's update (collective): at the run's first, the fingerprint of the module the
        rollout runs; the step's sample statistics, and with health.on_alert adapt the KL weight this
        update uses, set from them (and the last guard's drop): the update right after the samples that
        show a fall already counters it."""
        if not self.reached and self.before is None:
            self.before = L.fingerprint(self.trained, self.full)
        h = self.cfg.health
        self.sample_stats = self._monitors(step, trajs) if h.monitors else {}
        if h.monitors and h.on_alert == "adapt":
            self.cfg.algo.kl_beta = self.alerts.adapt({**self.last_guard, **self.sample_stats})

    def after_step(
        self,
        step: int,
        logs: dict[str, float],
        trajs: list,
        logger: Any,
        wake: Callable[[], Any],
    ) -> dict[str, float]:
        """The step's health/* metrics (every rank the same); see the module docstring. Collective."""
        out: dict[str, float] = {}
        updated = logs.get("train/updates", 0.0) > 0
        if updated and not self.reached and self.before is not None:
            after = L.fingerprint(self.trained, self.full)
            same = [k for k in after if after[k] == self.before[k]]
            if same:
                self.fatal = (
                    f"step {step}: the first optimizer step left the rollout's module unchanged ("
                    f"{', '.join(same)}: LoRA update |B A| sum {after[same[0]]:.6g} before and after): the "
                    "rollout would sample the initial policy for the whole run"
                )
            self.reached = True
        if self.vllm_watch and "vllm/weights_fingerprint" in logs:
            self._check_vllm(step, logs["vllm/weights_fingerprint"], updated)
        if any(k.startswith("consistency/") for k in logs):
            due = P.due(self.cfg, step, self.first_update)
            try:
                gate = P.gate(self.cfg, step, logs)
                out.update(gate)
            except ParityError as e:
                if due:
                    self.fatal = self.fatal or str(e)
                out["health/parity_gap"] = e.gap
        if updated:
            self.first_update = False
        h = self.cfg.health
        if h.monitors:
            stats = self.sample_stats if self.sample_stats is not None else self._monitors(step, trajs)
            out.update(stats)
            if step < h.baseline_steps and math.isfinite(logs.get("reward/mean", math.nan)):
                self.reward_first.append(logs["reward/mean"])
        self.sample_stats = None
        if h.guard_every and (step + 1) % h.guard_every == 0:
            with wake():
                out.update(self._guard(step, logs, logger))
            self.last_guard = {k: v for k, v in out.items() if k == "health/guard_drop"}
        if h.monitors:
            for alert in self.alerts.observe(step, {**logs, **out}):
                D.print0(("warning: " if h.on_alert != "stop" else "") + alert.line())
                if h.on_alert == "stop" and self.stop_alert is None:
                    self.stop_alert = alert
        # the weight this step's update used (adapt sets it in before_update)
        out["health/kl_beta"] = self.cfg.algo.kl_beta
        out["health/alerts"] = float(len(self.alerts.history))
        return out

    def _check_vllm(self, step: int, held: float, updated: bool) -> None:
        """The fingerprint of the weights vLLM generated this step's rollout with: after an optimizer step,
        the same as before it means the push did not reach vLLM."""
        if not self.vllm_pending:
            self.vllm_before, self.vllm_pending = held, updated
            return
        if held == self.vllm_before:
            self.fatal = self.fatal or (
                f"step {step}: the first optimizer step did not reach vLLM: the weights it holds after this "
                f"step's push (fingerprint {held:.10g}) are those it generated with before the update: the "
                "rollout would sample the initial policy for the whole run"
            )
        self._stop_watching_vllm()

    def _stop_watching_vllm(self) -> None:
        if self.vllm_watch:
            self.ops.engine.fingerprints = False
        self.vllm_watch = False

    def _monitors(self, step: int, trajs: list) -> dict[str, float]:
        """The step's sample statistics (collective), the ratios to the first steps' baseline among them."""
        means = M.reduce_means(M.step_sums(trajs), M.STATISTICS)
        out = {f"health/{k}": v for k, v in means.items() if not math.isnan(v)}
        h = self.cfg.health
        for k, ratio in (("diversity", "diversity_ratio"), ("colour_entropy", "colour_entropy_ratio")):
            v = means[k]
            if math.isnan(v):
                continue
            if step < h.baseline_steps:
                self.baseline[k].append(v)
            base = float(np.mean(self.baseline[k])) if self.baseline[k] else math.nan
            if base > 0 and step >= h.baseline_steps:
                out[f"health/{ratio}"] = v / base
        return out

    def _guard(self, step: int, logs: dict[str, float], logger: Any) -> dict[str, float]:
        """The guard prompts with fixed seeds through the validation sampler, scored by the training reward
        and health.guard_reward; the grid of rank 0's samples to tensorboard (guard) and guard/."""
        from omnirl.distributed import derive_seed
        from omnirl.models.base import Request
        from omnirl.rewards.pool import RewardPool
        from omnirl.scoring import rollout_and_score

        h, cfg = self.cfg.health, self.cfg
        if h.guard_reward and self.guard_pool is None:
            r = cfg.reward
            self.guard_pool = RewardPool(
                h.guard_reward, r.num_workers, r.timeout_s, r.paths, adapter=self.ops.adapter, cfg=cfg
            )
        params = self.ops.validation_params()
        requests = [
            Request(p, i, i, derive_seed(cfg.run.seed, GUARD_STEP, i), params, cfg.sampling.negative_prompt)
            for i, p in enumerate(h.guard_prompts)
            if i % self.dist.world_size == self.dist.rank
        ]
        trajs, _ = rollout_and_score(self.ops, self.rewards, requests)
        train = [t.reward for t in trajs]
        guard = train
        if self.guard_pool is not None and trajs:
            outputs = [t.output for t in trajs]
            result = self.guard_pool.score(outputs, [t.request.prompt for t in trajs], [{} for _ in trajs])
            guard = result.total.tolist()
        t = D.all_reduce(torch.tensor([sum(train), sum(guard), float(len(trajs))], dtype=torch.float64))
        train_mean, guard_mean = (t[0] / t[2]).item(), (t[1] / t[2]).item()
        out = {"health/guard_train_reward": train_mean, "health/guard_reward": guard_mean}
        if self.guard_first is None:
            self.guard_first = guard_mean
        first_reward = float(np.mean(self.reward_first)) if self.reward_first else math.nan
        rising = logs.get("reward/mean", math.nan) > first_reward
        drop = (self.guard_first - guard_mean) / max(abs(self.guard_first), 1e-8)
        out["health/guard_drop"] = drop if rising else 0.0
        images = [t.output.image for t in trajs if t.output.image is not None]
        if images and logger.enabled:
            from PIL import Image

            from omnirl.metrics import make_grid

            grid = make_grid(images)
            folder = Path(cfg.run.output_dir) / "guard"
            folder.mkdir(exist_ok=True)
            Image.fromarray(grid).save(folder / f"step_{step:06d}.png")
            tb = getattr(logger, "_tb", None)
            if tb is not None:
                tb.add_image("guard", grid, step, dataformats="HWC")
        return out

    def stop_if_needed(self, save: Callable[[], object] | None) -> None:
        """After the step is logged: a fatal check raises; an alert with on_alert stop saves a checkpoint
        (`save`; None: this step's was saved already), then raises. Collective: the ranks decide together
        (a check one rank failed, say the fingerprint of its own vLLM engine, stops every rank, with the
        lowest such rank's line), so no rank goes on into a collective that the others have left."""
        stop = None if self.stop_alert is None else self.stop_alert.line()
        decisions = D.all_gather_object((self.fatal, stop))
        fatal = next((f for f, _ in decisions if f), None)
        stop = next((a for _, a in decisions if a), None)
        if fatal:
            raise HealthError(fatal)
        if stop is not None:
            if save is not None:
                save()
            raise HealthError(stop + "; a checkpoint of this step was saved")

    def finish(self) -> None:
        """The run's alerts: printed, and written to output_dir/health_alerts.jsonl (rank 0)."""
        if self.guard_pool is not None:
            self.guard_pool.close()
        if not self.dist.is_main:
            return
        path = Path(self.cfg.run.output_dir) / ALERTS_FILE
        with open(path, "a") as f:
            for a in self.alerts.history:
                f.write(json.dumps(a.__dict__) + "\n")
        if self.alerts.history:
            print(f"health: {len(self.alerts.history)} alert(s) in this run:", flush=True)
            for a in self.alerts.history:
                print("  " + a.line(), flush=True)
        elif self.cfg.health.monitors:
            print("health: no alerts in this run", flush=True)
