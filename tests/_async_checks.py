"""Checks of omnirl.async_mode.broadcast_trained on 2 ranks (gloo); launched by tests/test_async.py with
torchrun. Rank 0 holds the trained tensors, rank 1 other values: after the broadcast rank 1's trained
tensors equal rank 0's bit for bit (float32 and bfloat16, in buckets smaller than one tensor and larger
than several), and its frozen ones are untouched. Then rank 1 ends (status 0, so torchrun lets rank 0 go
on) while rank 0 waits for its samples: rank 0's receive fails with one line naming rank 1. Prints
"async checks OK" on each rank; any failure raises."""

import torch
import torch.distributed as dist
from torch import nn

from omnirl import distributed as D
from omnirl.async_mode import PeerLost, broadcast_trained, receive_samples


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 4), nn.Linear(4, 4))
    m[3].requires_grad_(False)  # a frozen part: never sent
    return m


def main() -> None:
    D.init_distributed()
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    for bucket in (64, 2**20):  # one tensor per bucket (and tensors larger than it); everything in one
        m = model(1 if rank == 0 else 2 + bucket)
        frozen = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
        sent = broadcast_trained(m, group, bucket_bytes=bucket)
        trained = {n: p for n, p in m.named_parameters() if p.requires_grad}
        assert sent == sum(p.numel() * p.element_size() for p in trained.values()), sent
        # Bit for bit: the raw bytes of every trained tensor, as rank 0 has them.
        mine = {n: p.detach().contiguous().view(torch.uint8).reshape(-1).tolist() for n, p in trained.items()}
        theirs = D.all_gather_object(mine)[0]
        assert mine == theirs, f"rank {rank}: broadcast tensors differ from rank 0's (bucket {bucket})"
        for n, p in m.named_parameters():
            if n in frozen:
                assert torch.equal(p, frozen[n]), n
        assert {p.dtype for p in trained.values()} == {torch.float32, torch.bfloat16}
    D.barrier()
    if rank == 1:  # a rollout rank that ends without a word
        print("async checks OK on rank 1", flush=True)
        D.exit_now(0)
    try:
        receive_samples(3, [1])
    except PeerLost as e:
        message = str(e)
    else:
        raise AssertionError("a receive from a rank that ended returned")
    want = "distributed.mode async: receiving step 3's samples failed: rollout rank 1 ended or stopped "
    want += "answering ("
    assert message.startswith(want) and "\n" not in message, message
    print(f"async checks OK on rank 0 ({message})", flush=True)
    D.exit_now(0)  # no destroy: its peer is gone


if __name__ == "__main__":
    main()
