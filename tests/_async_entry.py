"""tests._train_entry with every weight broadcast of distributed.mode async recorded, for test_async.py.

[torchrun ...] python -m tests._async_entry --recipe PATH [overrides]   (from the repository root)

OMNIRL_TEST_WEIGHTS names a folder: after the n-th broadcast (n = 1, 2, ...), training rank 0 writes the
trained tensors as it holds them (gathered from FSDP2's shards) and each rollout rank the ones it received
into its policy, to v{n}_rank{R}.safetensors, keyed by position (0000, 0001, ...). The broadcast runs in
buckets of 64 KiB here, so a full fine-tune's weights take many buckets and one tensor spans several.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

import omnirl.async_mode
from tests import _train_entry  # noqa: F401  (the test rewards)

broadcast = omnirl.async_mode.broadcast_trained
calls = [0]


def recorded_broadcast(model, group, bucket_bytes=omnirl.async_mode.BUCKET_BYTES):
    sent = broadcast(model, group, bucket_bytes=64 * 2**10)
    calls[0] += 1
    trained = [p for p in model.parameters() if p.requires_grad]
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in trained]  # every trainer
    if group is not None:
        folder = Path(os.environ["OMNIRL_TEST_WEIGHTS"])
        file = folder / f"v{calls[0]}_rank{tdist.get_rank()}.safetensors"
        save_file({f"{i:04d}": t.contiguous().clone() for i, t in enumerate(full)}, str(file))
    return sent


omnirl.async_mode.broadcast_trained = recorded_broadcast

from scripts.train import exit_now, main  # noqa: E402  (after the patch above)

if __name__ == "__main__":
    torch.set_num_threads(1)
    exit_now(main(sys.argv[1:]))
