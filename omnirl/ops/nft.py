"""The DiffusionNFT update (arXiv 2509.16117): `NFTOps`, for `DiffusionAdapter`s with algo.loss diffusion_nft.

Why a class of its own: DiffusionNFT trains on the forward process, by flow matching on the rollout's
final samples, so its training rows are not the rollout's transitions and its loss needs no log-prob. The
rollout half (requests, generation, validation, samples) is `DiffusionOps`'s, inherited unchanged; the
update half (rows, micro-batches, the old policy's velocity, the loss) is here. `omnirl.ops.OPS` selects
the class by the loss's name, so the loop still sees one interface, `KindOps`, and the Flow-GRPO path
carries no NFT branches.

A row (`NFTRow`) is (sample, time, noise): the sample's clean latents x0 (`Trajectory.final_latents`), the
time t = the rollout schedule's sigma of step k, for every step but the last (the reference's
timestep_fraction 0.99), and a standard-normal noise drawn from a generator seeded by (the request's seed,
k): the same on any number of ranks and in every pass over the rows. The forward-noised
x_t = (1 - t) x0 + t noise goes through the policy at guidance 1 (the conditional velocity: DiffusionNFT is
CFG-free; recipes sample at guidance 1 too), the target is noise - x0, and `losses.diffusion_nft_loss`
mixes the old velocity in.

The old policy is the one that sampled the rollout (the reference's decay 0; its soft-updated old policy,
an average of past weights, is not implemented). Until the first optimizer step of an update (the first
mini-batch) that is the policy itself, so v_old = v.detach() costs no forward. With more optimizer steps
per rollout (optim.mini_batches or optim.epochs > 1) the trainable parameters are copied before the update
and later mini-batches run one no-grad forward with that copy swapped in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from omnirl.config import Config
from omnirl.models.base import DiffusionAdapter, Trajectory, derive_seed
from omnirl.ops.diffusion import DiffusionOps, reference
from omnirl.step import equalise, global_positions


@dataclass
class NFTRow:
    """One (sample, time, noise) row of the update: time and noise are those of the sample's step k."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (step.global_positions)

    def noise(self) -> torch.Tensor:
        """[*latent] the row's forward-process noise, from its own generator (stream -2 of the request)."""
        g = torch.Generator().manual_seed(derive_seed(self.traj.request.seed, -2, self.k))
        return torch.randn(self.traj.final_latents.shape, generator=g)


@contextlib.contextmanager
def swapped(params: list[nn.Parameter], values: list[torch.Tensor]):
    """The parameters hold `values` inside the context and their own values again after it (in place, so
    FSDP2's sharded parameters keep their storage)."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)


class NFTOps(DiffusionOps):
    """DiffusionNFT's update over `DiffusionOps`'s rollout (the module docstring)."""

    def __init__(self, cfg: Config, adapter: DiffusionAdapter):
        super().__init__(cfg, adapter)
        self._old: list[torch.Tensor] | None = None  # the rollout policy's parameters, while updating

    def trainable(self) -> list[nn.Parameter]:
        """The trained parameters as they are now (FSDP2 replaces them with sharded ones after __init__)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[NFTRow]:
        o = self.cfg.optim
        if o.mini_batches * o.epochs > 1:  # later mini-batches need the rollout policy's velocity
            self._old = [p.detach().clone() for p in self.trainable()]
        steps = self.params.num_steps - 1
        r = self.cfg.rollout
        where = global_positions(gen, r.prompts_per_step * r.group_size * steps)
        rows = [
            NFTRow(t, k, 1.0, position=where[t.request.index * steps + k])
            for t, kept in zip(trajs, keep.tolist())
            if kept
            for k in range(steps)
        ]
        return sorted(rows, key=lambda row: row.position)

    def recompute_old(self, rows: list[NFTRow], pad_traj: Trajectory) -> dict[str, float]:
        raise AssertionError("diffusion_nft has no old log-probs (check_config refuses recompute)")

    def micro_batches(self, rows: list[NFTRow], pad_traj: Trajectory) -> list[list[NFTRow]]:
        size = self.cfg.optim.micro_batch_size
        return equalise([rows[i : i + size] for i in range(0, len(rows), size)], NFTRow(pad_traj, 0, 0.0))

    def loss(self, mb: list[NFTRow], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        a, adapter = self.cfg.algo, self.adapter
        device = adapter.device
        x0 = torch.stack([r.traj.final_latents for r in mb]).to(device).float()  # [M, *latent]
        noise = torch.stack([r.noise() for r in mb]).to(device)  # [M, *latent]
        t = torch.stack([r.traj.sigmas[r.k] for r in mb]).to(device).float()  # [M]
        tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - tt) * x0 + tt * noise
        embeds = {k: e.to(device) for k, e in adapter.batch_embeds([r.traj.embeds for r in mb]).items()}
        v = adapter.velocity(x_t, t, embeds, 1.0)  # [M, *latent] the conditional velocity: CFG-free
        if measure or self._old is None:  # no optimizer step yet: the policy is the rollout's
            v_old = v.detach()
        else:
            with torch.no_grad(), swapped(self.trainable(), self._old):
                v_old = adapter.velocity(x_t, t, embeds, 1.0)
        v_ref = None
        if a.kl_beta > 0:
            with torch.no_grad(), reference(adapter, self.ref_model) as ref:
                v_ref = adapter.velocity(x_t, t, embeds, 1.0, policy=ref)
        adv = torch.tensor([r.traj.advantage for r in mb], device=device)
        w = torch.tensor([r.weight for r in mb], device=device)
        return self.loss_fn(
            v, v_old, noise - x0, t, adv, w, a.nft_beta, a.adv_clip, normaliser, v_ref, a.kl_beta
        )

    def measured(self) -> dict[str, float]:
        self._old = None  # the copy is dead once the update is done
        return {}
