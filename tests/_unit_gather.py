"""distributed.rollout_gather unit on 2 ranks (gloo), the tiny SD3 with its frozen base sharded
(tests/test_frozen_base.py launches it with torchrun).

Rank 1 has one request, rank 0 two, one per batch: rank 1 runs one padding batch so both run the same
forwards. At each block's forward at most two blocks are gathered (it, and the next one's prefetched
all-gather); with phase gathering every block is. Prints "unit gather OK" on each rank.
"""

import sys

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.batching import make_requests
from omnirl.data.prompts import load_prompts
from omnirl.errors import ConfigError
from omnirl.fsdp import shard
from omnirl.models import get_adapter
from omnirl.ops.diffusion import DiffusionOps, sampling_params
from omnirl.recipe import load_config


def gathered(block) -> bool:
    group = block._get_fsdp_state()._fsdp_param_group
    return group.is_unsharded or group._all_gather_result is not None  # done, or in flight


def check(path: str, mode: str) -> None:
    cfg = load_config(
        "sd3_tiny_flowgrpo",
        ["--model.path", path, "--distributed.frozen_base", "shard", "--distributed.rollout_gather", mode,
         "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--sampling.num_steps", "2",
         "--rollout.max_num_seqs", "1"],
    )  # fmt: skip
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    shard(cfg, ops, dist)
    whole = sum(p.numel() * 4 for p in ops.policy.parameters())
    assert fsdp.gather_bytes(ops.policy) == whole  # before the first forward (FSDP2's lazy init) too
    blocks = ops.adapter.fsdp_units()
    assert fsdp.forward_chains(ops.policy, blocks) == list(zip(blocks, blocks[1:]))
    seen = []
    for b in blocks:
        b.register_forward_pre_hook(lambda m, args: seen.append(sum(gathered(x) for x in blocks)))
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    requests = requests[: 2 - dist.rank]
    trajs = ops.generate(requests, lambda t: None)
    assert len(trajs) == len(requests)
    forwards = D.all_gather_object(len(seen))
    if mode == "unit":
        assert forwards[0] == forwards[1], forwards
        assert ops.engine.stats["padding_batches"] == dist.rank
        assert max(seen) == 2, seen
    else:
        assert forwards[0] == 2 * forwards[1], forwards  # no padding: nothing to wait for
        assert min(seen) == len(blocks)
    assert not any(gathered(b) for b in blocks)  # resharded after the rollout
    # What a whole-model gather allocates: every parameter whole, the frozen transformer's and the LoRA's
    # (float32 here), against free memory before it starts (the check only runs on an accelerator).
    ops.policy.reshard()  # FSDP2 leaves the root gathered after a forward
    assert fsdp.gather_bytes(ops.policy) == whole
    fsdp.check_gather_fits(ops.policy, whole)
    try:
        fsdp.check_gather_fits(ops.policy, whole - 1)
    except ConfigError as e:
        message = str(e)
        assert "rollout_gather phase gathers the whole sharded base" in message, message
        assert "rollout_gather unit" in message, message
    else:
        raise AssertionError("a gather larger than the free memory was not refused")


def main(path: str) -> None:
    check(path, "unit")
    check(path, "phase")
    print("unit gather OK", flush=True)
    D.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
    D.exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
