"""Two Wan experts under FSDP2 on 2 ranks (gloo), each rank holding rows of one expert only: rank 0 only
high-noise rows (transformer), rank 1 only low-noise ones (transformer_2). Without the adapter's balancing
one-row passes the experts' collectives would not match and the ranks would hang; with them the backward
completes and both experts' LoRA receive gradients on every rank. tests/test_wan.py launches it with
torchrun; prints "experts OK" on each rank.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.models.wan.adapter import WanAdapter
from omnirl.recipe import config_for


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config_for("wan")
    cfg.model.path, cfg.family.num_frames = sys.argv[1], 9
    adapter = WanAdapter(cfg, torch.device("cpu"))
    for name, p in adapter.policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    frozen = {p for p in adapter.policy.parameters() if not p.requires_grad}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp.apply_fsdp(adapter.policy, adapter.fsdp_units(), mesh, "float32", "float32", frozen)
    sigmas = adapter.sigmas(6)
    sigma = sigmas[0 if rank == 0 else 4].expand(2)  # 1.0 (transformer) or 0.71 (transformer_2)
    latents = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(rank))
    embeds = adapter.encode(["a red cat", "waves"], ["", ""])
    adapter.velocity(latents, sigma, embeds, 4.0).square().mean().backward()
    grads = {
        e: [p.grad for n, p in adapter.policy[e].named_parameters() if "lora_" in n] for e in adapter.experts
    }
    for expert, gs in grads.items():
        assert gs and all(g is not None for g in gs), f"rank {rank}: {expert} got no gradient"
        total = sum(float(g.full_tensor().abs().sum()) for g in gs)  # summed over ranks by FSDP
        assert total > 0, f"rank {rank}: {expert} gradient is zero"
    print("experts OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    D.exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
