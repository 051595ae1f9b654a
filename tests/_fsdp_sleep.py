"""FSDP2 + AdamW under sleep/wake, 2 ranks on gloo (tests/test_memory.py launches it with torchrun).

Two identical FSDP2 models take a step on the same per-rank data. The first one's optimizer state (DTensor
exp_avg / exp_avg_sq: their local shards) and parameters sleep and wake; then both take a second step,
which must agree bit for bit. Prints "sleep/wake OK" on each rank; any failure raises.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from omnirl.distributed import exit_now
from omnirl.memory import Sleeper, module_tensors, optimizer_state


def build(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    for block in (model[0], model[2], model[4]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())  # different data on each rank
    model(torch.randn(8, 16, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def bits(t: torch.Tensor) -> torch.Tensor:
    return local(t).detach().reshape(-1).view(torch.uint8).clone()


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a, opt_a = build(mesh)
    b, opt_b = build(mesh)
    train_step(a, opt_a, 0)
    train_step(b, opt_b, 0)

    state = optimizer_state(opt_a)
    params = list(a.parameters())
    assert sum(isinstance(t, DTensor) for t in state) == 2 * len(params)  # exp_avg, exp_avg_sq each
    before = [bits(t) for t in state]
    state_bytes = sum(local(t).untyped_storage().nbytes() for t in state)  # one storage each
    probe = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out_before = a(probe)

    # Chunks of 4 KiB: the 64x64 shards straddle chunks, the biases are packed together.
    sleeper = Sleeper(torch.device("cpu"), chunk_bytes=4096)
    for cycle in range(3):
        assert sleeper.sleep("optimizer", state) == state_bytes
        assert all(local(t).untyped_storage().size() == 0 for t in state)
        assert sleeper.sleep("params", module_tensors([a])) > 0
        assert all(p.to_local().untyped_storage().size() == 0 for p in params)
        chunks = [id(c) for c in sleeper.chunks]
        if cycle == 0:
            first = chunks
        assert chunks == first, "the host chunks are reused, not allocated again"
        sleeper.wake("params")
        with torch.no_grad():
            assert torch.equal(a(probe), out_before)
        sleeper.wake("optimizer")
        assert all(torch.equal(bits(t), x) for t, x in zip(state, before))

    train_step(a, opt_a, 1)
    train_step(b, opt_b, 1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(bits(pa), bits(pb))
    for ta, tb in zip(optimizer_state(opt_a), optimizer_state(opt_b)):
        assert torch.equal(bits(ta), bits(tb))
    with torch.no_grad():
        assert not torch.equal(a(probe), out_before), "the second step changed the model"
    print(f"rank {dist.get_rank()}: sleep/wake OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
