"""The DGPO update (arXiv 2510.08425, Luo-Yihong/DGPO): `DGPOOps`, for `DiffusionAdapter`s with algo.loss
dgpo.

DGPO learns a group preference by flow matching on the forward process of the rollout's final samples,
so its rows are not the rollout's transitions and it reads no log-prob: the rollout half is
`DiffusionOps`'s, inherited unchanged; the update half is here. A row (`DGPORow`) is (sample, time,
noise), a group's samples sharing their times and noises. `update_rows` first sums every (group, time)'s
margins over ranks in one no-grad pass and weights each row; the trust region's EMA copy of the trained
weights (`algo.dgpo.trust_region`, `ema_ref`, `ema_rollout_after`) moves in an optimizer-step hook and is
the run's `state()`.

How it works: docs/algorithms.md#dgpos-group-preference
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from omnirl import distributed as D
from omnirl.algos.losses import DGPOInputs, dgpo_margin
from omnirl.batching import equalise, global_positions
from omnirl.config import Config
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.models.base import DiffusionAdapter, Request, SamplingParams, Trajectory
from omnirl.ops.diffusion import DiffusionOps, micro_batch_embeds, reference
from omnirl.ops.nft import swapped


@dataclass
class DGPORow:
    """The k-th of the `algo.dgpo.timesteps` rows of a sample: its time index `time_index(max_step)` and
    its noise `noise()`, both drawn from its group's seed (the same for every sample of the group)."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (batching.global_positions)
    group_weight: float = 0.0  # its (group, time)'s weight, set by DGPOOps.update_rows

    def time_index(self, max_step: int) -> int:
        """The k-th of the group's permutation of the step indices 0 .. max_step."""
        g = torch.Generator().manual_seed(derive_seed(self.traj.request.group_seed, -5, -1))
        return int(torch.randperm(max_step + 1, generator=g)[self.k])

    def noise(self) -> torch.Tensor:
        """[*latent] the group's forward-process noise at its k-th time."""
        g = torch.Generator().manual_seed(derive_seed(self.traj.request.group_seed, -5, self.k))
        return torch.randn(self.traj.final_latents.shape, generator=g)


class DGPOOps(DiffusionOps):
    """DGPO's update over `DiffusionOps`'s rollout (the module docstring)."""

    def __init__(self, cfg: Config, adapter: DiffusionAdapter):
        super().__init__(cfg, adapter)
        if cfg.algo.dgpo.max_step >= cfg.sampling.num_steps:
            raise ConfigError(
                f"algo.dgpo.max_step ({cfg.algo.dgpo.max_step}) must be below sampling.num_steps "
                f"({cfg.sampling.num_steps}): it is a step index of the rollout's schedule"
            )
        if self.ref_model is None and cfg.model.finetune == "full":
            # DGPO always compares with the reference policy: a full fine-tune keeps a frozen copy (which
            # the trainer shards like the policy), as `build_reference` does for a KL term.
            self.ref_model = copy.deepcopy(adapter.policy).requires_grad_(False).eval()
        a = cfg.algo
        self.ema_on = a.dgpo.trust_region or a.dgpo.ema_ref or a.dgpo.ema_rollout_after is not None
        # The EMA copy's parameters (made at the first update or checkpoint load, after FSDP2 has sharded
        # the policy, from the weights no optimizer step has moved yet) and the optimizer steps so far.
        self._ema: list[torch.Tensor] | None = None
        self._steps = torch.zeros((), dtype=torch.int64)
        if self.ema_on:  # (a weak reference: the hook is global, it must not keep these ops alive)
            ops = weakref.ref(self)
            self._hook = register_optimizer_step_post_hook(
                lambda optimizer, args, kwargs: (o := ops()) and o._optimizer_stepped(optimizer)
            )

    def trainable(self) -> list[nn.Parameter]:
        """The trained parameters as they are now (FSDP2 replaces them with sharded ones after __init__)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def ema(self) -> list[torch.Tensor]:
        """The EMA copy's parameters, in `trainable()` order (a copy of them at first)."""
        assert self.ema_on
        if self._ema is None:
            self._ema = [p.detach().clone() for p in self.trainable()]
        return self._ema

    def ema_decay(self) -> float:
        """d of the copy's next move: min(0.3, 0.001 s) after s optimizer steps."""
        return min(0.3, 0.001 * int(self._steps))

    @torch.no_grad()
    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """After every optimizer step of the policy's optimizer: the EMA copy moves towards the weights."""
        trainable = self.trainable()
        if not any(p is trainable[0] for group in optimizer.param_groups for p in group["params"]):
            return  # another optimizer's step
        d = self.ema_decay()
        for e, p in zip(self.ema(), trainable, strict=True):
            e.add_(p.detach() - e, alpha=1 - d)
        self._steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        """The EMA copy's parameters by name and the optimizer-step count (only when it is kept)."""
        if not self.ema_on:
            return {}
        names = [n for n, p in self.policy.named_parameters() if p.requires_grad]
        ema = {f"dgpo_ema.{n}": t for n, t in zip(names, self.ema(), strict=True)}
        return {"dgpo_optimizer_steps": self._steps, **ema}

    def step_params(self, step: int) -> SamplingParams:
        """The rollout's parameters: sampled by the EMA copy ("ema") once more than
        algo.dgpo.ema_rollout_after optimizer steps were taken."""
        params = super().step_params(step)
        after = self.cfg.algo.dgpo.ema_rollout_after
        ema = after is not None and int(self._steps) > after
        return dataclasses.replace(params, lora="ema") if ema else params

    def generate(self, requests: list[Request], on_done) -> list[Trajectory]:
        if not requests or requests[0].params.lora != "ema":
            return super().generate(requests, on_done)
        assert all(r.params.lora == "ema" for r in requests), "one policy per generate call"
        with swapped(self.trainable(), self.ema()):
            return super().generate(requests, on_done)

    def ema_velocity(self, x_t: torch.Tensor, t: torch.Tensor, embeds: dict) -> torch.Tensor:
        """The EMA copy's conditional velocity, no gradient (its values swapped into the parameters)."""
        with torch.no_grad(), swapped(self.trainable(), self.ema()):
            return self.adapter.velocity(x_t, t, embeds, 1.0)

    def inputs(self, mb: list[DGPORow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """x_t [M, *latent], t [M], target eps - x0 [M, *latent] and the embeddings of a micro-batch."""
        device, max_step = self.adapter.device, self.cfg.algo.dgpo.max_step
        x0 = torch.stack([r.traj.final_latents for r in mb]).to(device).float()  # [M, *latent]
        noise = torch.stack([r.noise() for r in mb]).to(device)  # [M, *latent]
        t = torch.stack([r.traj.sigmas[r.time_index(max_step)] for r in mb]).to(device).float()  # [M]
        tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
        embeds = micro_batch_embeds(self.adapter, [r.traj.embeds for r in mb], self.cfg.train.compile)
        return (1 - tt) * x0 + tt * noise, t, noise - x0, embeds

    # The update's rows are DGPORow, not DiffusionOps's Pair (it reuses DiffusionOps's rollout only): the
    # update methods override DiffusionOps's with their own row type.
    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[DGPORow]:  # pyright: ignore[reportIncompatibleMethodOverride]
        dgpo, r = self.cfg.algo.dgpo, self.cfg.rollout
        if self.ema_on:
            self.ema()  # made before the first optimizer step: the initial weights
        m = dgpo.timesteps
        where = global_positions(gen, r.prompts_per_step * r.group_size * m)
        rows = [
            DGPORow(t, k, 1.0, position=where[t.request.index * m + k])
            for t, kept in zip(trajs, keep.tolist())
            if kept
            for k in range(m)
        ]
        # The group weights: every row's margin, summed per (group, time) over all ranks.
        sums = torch.zeros(r.prompts_per_step * m, dtype=torch.float64)
        with torch.no_grad():
            for mb in self.micro_batches(rows, trajs[0]):
                x_t, t, target, embeds = self.inputs(mb)
                v = self.adapter.velocity(x_t, t, embeds, 1.0)
                if dgpo.ema_ref:
                    v_ref = self.ema_velocity(x_t, t, embeds)
                else:
                    with reference(self.adapter, self.ref_model) as ref:
                        v_ref = self.adapter.velocity(x_t, t, embeds, 1.0, policy=ref)
                adv = torch.tensor([row.traj.advantage for row in mb], device=v.device)
                margin = dgpo_margin(v, v_ref, target, adv, dgpo.beta, r.group_size).cpu().double()
                for row, value in zip(mb, margin.tolist()):
                    if row.weight:
                        sums[row.traj.request.group_id * m + row.k] += value
        weights = torch.sigmoid(D.all_reduce(sums))
        for row in rows:
            row.group_weight = float(weights[row.traj.request.group_id * m + row.k])
        return sorted(rows, key=lambda row: row.position)

    def recompute_old(self, rows: list[DGPORow], pad_traj: Trajectory) -> dict[str, float]:  # pyright: ignore[reportIncompatibleMethodOverride]
        raise AssertionError("dgpo has no old log-probs (check_config refuses recompute)")

    def micro_batches(self, rows: list[DGPORow], pad_traj: Trajectory) -> list[list[DGPORow]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        size = self.cfg.optim.micro_batch_size
        return equalise([rows[i : i + size] for i in range(0, len(rows), size)], DGPORow(pad_traj, 0, 0.0))

    def loss(self, mb: list[DGPORow], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:  # pyright: ignore[reportIncompatibleMethodOverride]
        a, adapter = self.cfg.algo, self.adapter
        x_t, t, target, embeds = self.inputs(mb)
        # The EMA copy's velocity first: swapping its values into the parameters in place after v's forward
        # would change tensors v's graph saved.
        v_ema = self.ema_velocity(x_t, t, embeds) if a.dgpo.trust_region else None
        v = adapter.velocity(x_t, t, embeds, 1.0)  # [M, *latent] the conditional velocity
        v_ref = None
        if a.kl_beta > 0:
            with torch.no_grad(), reference(adapter, self.ref_model) as ref:
                v_ref = adapter.velocity(x_t, t, embeds, 1.0, policy=ref)
        device = v.device
        adv = torch.tensor([r.traj.advantage for r in mb], device=device)
        group_weight = torch.tensor([r.group_weight for r in mb], device=device)
        w = torch.tensor([r.weight for r in mb], device=device)
        inputs = DGPOInputs(v, target, adv, group_weight, w, ref_velocity=v_ref, ema_velocity=v_ema)
        return self.loss_fn(inputs, a, normaliser)

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        out = super().measured(optimizer_steps)
        if self.ema_on:
            out["dgpo/ema_decay"] = self.ema_decay()  # the decay of the copy's next move
        return out
