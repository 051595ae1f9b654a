"""The DiffusionNFT update (arXiv 2509.16117): `NFTOps`, for `DiffusionAdapter`s with algo.loss diffusion_nft.

DiffusionNFT trains by flow matching on the rollout's final samples, so its rows are not the rollout's
transitions and its loss reads no log-prob: the rollout half is `DiffusionOps`'s, inherited unchanged;
the update half is here. A row (`NFTRow`) is (sample, time, noise), int(0.99 T) per sample, drawn per
pass from the request's seed. The old policy is the paper's soft-updated copy of the trainable
parameters: `swapped` puts it in place for the rollout's "old" requests, `old_decay` gives its eta, and
`state` checkpoints it with the step count.

How it works: docs/algorithms.md#diffusionnfts-old-policy
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from omnirl.algos.losses import NFTInputs
from omnirl.batching import equalise, shuffled_rows
from omnirl.config import Config, DiffusionNFTConfig
from omnirl.distributed import derive_seed
from omnirl.models.base import DiffusionAdapter, Request, SamplingParams, Trajectory
from omnirl.ops.diffusion import DiffusionOps, micro_batch_embeds, reference

TIMESTEP_FRACTION = 0.99  # the reference's train.timestep_fraction: rows per sample int(0.99 T)


def rows_per_sample(num_steps: int) -> int:
    """The rows of one sample: int(0.99 T) of its T sigmas before 0, as the reference trains."""
    return int(num_steps * TIMESTEP_FRACTION)


@dataclass
class NFTRow:
    """One (sample, time, noise) row of the update, its k-th: in pass p (the row's `passes` so far: each
    pass trains every row once) its time is the sigma at `time_index()`, the k-th of a permutation of the
    sample's T sigmas before 0 drawn for that pass, and its noise `noise()` is drawn for that pass too."""

    traj: Trajectory
    k: int
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (batching.global_positions)
    passes: int = 0  # the passes that trained it so far (NFTOps.loss counts them)

    def time_index(self) -> int:
        """The index of the row's sigma in this pass: the k-th of the pass's permutation of the T sigmas
        before 0 (one permutation per sample and pass, stream -3 - pass of the request)."""
        g = torch.Generator().manual_seed(derive_seed(self.traj.request.seed, -3 - self.passes, -1))
        return int(torch.randperm(len(self.traj.sigmas) - 1, generator=g)[self.k])

    def noise(self) -> torch.Tensor:
        """[*latent] the row's forward-process noise in this pass, from its own generator."""
        g = torch.Generator().manual_seed(derive_seed(self.traj.request.seed, -3 - self.passes, self.k))
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


def old_decay(nft: DiffusionNFTConfig, optimizer_steps: int) -> float:
    """eta of the old policy's soft update after `optimizer_steps` optimizer steps: 0 during the first
    old_decay_delay steps, then growing by old_decay_rate a step up to old_decay_max (the reference's
    `return_decay(global_step, decay_type)`, its global_step counting optimizer steps)."""
    if optimizer_steps < nft.old_decay_delay:
        return 0.0
    return min((optimizer_steps - nft.old_decay_delay) * nft.old_decay_rate, nft.old_decay_max)


class NFTOps(DiffusionOps):
    """DiffusionNFT's update over `DiffusionOps`'s rollout (the module docstring)."""

    def __init__(self, cfg: Config, adapter: DiffusionAdapter):
        super().__init__(cfg, adapter)
        nft = cfg.algo.diffusion_nft
        self.soft = nft.old_decay_rate > 0 and nft.old_decay_max > 0  # the soft-updated old policy
        # soft: the old policy's parameters (made at the first update or checkpoint load, after FSDP2 has
        # sharded the policy); else the rollout policy's, copied for the later mini-batches of an update.
        self._old: list[torch.Tensor] | None = None
        self._steps = torch.zeros((), dtype=torch.int64)  # optimizer steps so far: eta's clock

    def trainable(self) -> list[nn.Parameter]:
        """The trained parameters as they are now (FSDP2 replaces them with sharded ones after __init__)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def old_policy(self) -> list[torch.Tensor]:
        """The soft-updated old policy's parameters, in `trainable()` order (a copy of them at first)."""
        assert self.soft
        if self._old is None:
            self._old = [p.detach().clone() for p in self.trainable()]
        return self._old

    def old_is_policy(self) -> bool:
        """Whether, between updates, the old policy holds the policy's own values: every soft update so far
        had eta 0 (each one then copied the policy). Asked before an update's first optimizer step."""
        return old_decay(self.cfg.algo.diffusion_nft, int(self._steps)) == 0

    def state(self) -> dict[str, torch.Tensor]:
        """The old policy's parameters by name, and the optimizer-step count (only with the soft update)."""
        if not self.soft:
            return {}
        names = [n for n, p in self.policy.named_parameters() if p.requires_grad]
        old = {f"nft_old_policy.{n}": t for n, t in zip(names, self.old_policy(), strict=True)}
        return {"nft_optimizer_steps": self._steps, **old}

    def step_params(self, step: int) -> SamplingParams:
        """The rollout's parameters: sampled by the old policy ("old") with the soft update."""
        params = super().step_params(step)
        return dataclasses.replace(params, lora="old") if self.soft else params

    def generate(self, requests: list[Request], on_done) -> list[Trajectory]:
        if not requests or requests[0].params.lora != "old" or self.old_is_policy():
            return super().generate(requests, on_done)
        assert all(r.params.lora == "old" for r in requests), "one policy per generate call"
        with swapped(self.trainable(), self.old_policy()):
            return super().generate(requests, on_done)

    # The update's rows are NFTRow, not DiffusionOps's Pair (it reuses DiffusionOps's rollout only): the
    # update methods override DiffusionOps's with their own row type.
    def update_rows(self, trajs: list[Trajectory], keep: torch.Tensor, gen: torch.Generator) -> list[NFTRow]:  # pyright: ignore[reportIncompatibleMethodOverride]
        o = self.cfg.optim
        if self.soft:
            self.old_policy()  # made before the first optimizer step: the policy that sampled step 0
        elif o.mini_batches * o.epochs > 1:  # later mini-batches need the rollout policy's velocity
            self._old = [p.detach().clone() for p in self.trainable()]
        steps = rows_per_sample(self.params.num_steps)
        samples = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return shuffled_rows(
            trajs, keep, gen, samples, steps, lambda t, k, at: NFTRow(t, k, 1.0, position=at)
        )

    def recompute_old(self, rows: list[NFTRow], pad_traj: Trajectory) -> dict[str, float]:  # pyright: ignore[reportIncompatibleMethodOverride]
        raise AssertionError("diffusion_nft has no old log-probs (check_config refuses recompute)")

    def micro_batches(self, rows: list[NFTRow], pad_traj: Trajectory) -> list[list[NFTRow]]:  # pyright: ignore[reportIncompatibleMethodOverride]
        size = self.cfg.optim.micro_batch_size
        return equalise([rows[i : i + size] for i in range(0, len(rows), size)], NFTRow(pad_traj, 0, 0.0))

    def loss(self, mb: list[NFTRow], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:  # pyright: ignore[reportIncompatibleMethodOverride]
        a, adapter = self.cfg.algo, self.adapter
        device = adapter.device
        x0 = torch.stack([r.traj.final_latents for r in mb]).to(device).float()  # [M, *latent]
        noise = torch.stack([r.noise() for r in mb]).to(device)  # [M, *latent]
        t = torch.stack([r.traj.sigmas[r.time_index()] for r in mb]).to(device).float()  # [M]
        for r in mb:
            r.passes += 1  # its next pass draws a new time and noise
        tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - tt) * x0 + tt * noise
        embeds = micro_batch_embeds(adapter, [r.traj.embeds for r in mb], self.cfg.train.compile)
        # No optimizer step yet, and the old policy is the policy itself: its velocity is v. Otherwise the
        # old velocity comes first: swapping the old values into the parameters in place after v's forward
        # would change tensors v's graph saved (unsharded parameters, without FSDP2's gathered copies).
        fresh = (measure and self.old_is_policy()) if self.soft else (measure or self._old is None)
        v_old = None
        if not fresh:
            assert self._old is not None  # made by update_rows (soft: the old policy; else a copy)
            with torch.no_grad(), swapped(self.trainable(), self._old):
                v_old = adapter.velocity(x_t, t, embeds, 1.0)
        v = adapter.velocity(x_t, t, embeds, 1.0)  # [M, *latent] the conditional velocity: CFG-free
        if v_old is None:  # fresh
            v_old = v.detach()
        v_ref = None
        if a.kl_beta > 0:
            with torch.no_grad(), reference(adapter, self.ref_model) as ref:
                v_ref = adapter.velocity(x_t, t, embeds, 1.0, policy=ref)
        adv = torch.tensor([r.traj.advantage for r in mb], device=device)
        w = torch.tensor([r.weight for r in mb], device=device)
        inputs = NFTInputs(v, v_old, noise - x0, t, adv, w, ref_velocity=v_ref)
        return self.loss_fn(inputs, a, normaliser)

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        """The old policy's soft update after the update's `optimizer_steps` (logged: nft/old_decay, its
        eta); without it the rollout policy's copy, dead once the update is done, is dropped."""
        if not self.soft:
            self._old = None
            return {}
        self._steps += optimizer_steps
        eta = old_decay(self.cfg.algo.diffusion_nft, int(self._steps))
        with torch.no_grad():
            for old, p in zip(self.old_policy(), self.trainable(), strict=True):
                if eta == 0:
                    old.copy_(p.detach())  # exactly the policy, as without the soft update
                else:
                    old.mul_(eta).add_(p.detach(), alpha=1 - eta)
        return {"nft/old_decay": eta}
