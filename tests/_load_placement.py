"""Where the policy is when FSDP2 wraps it, on 2 ranks (gloo): the trainer's order (the adapter, its kind's
ops, `omnirl.fsdp.shard`) with the meta device given to the adapter as its device, which the host can tell
apart on CPU (tests/test_frozen_base.py launches it with torchrun; argv: the tiny SD3, Wan2.2 A14B and
Qwen2.5-VL checkpoints).

With distributed.frozen_base shard or offload every `fully_shard` call must find its unit's parameters on
the host, where they were loaded: FSDP2 moves each unit to its mesh's device itself (here the host, so the
move costs nothing). A parameter moved to the device on the way (by the adapter's constructor, by the
reference copy of a full fine-tune, by the kind's ops) would be on the meta device. With replicate the
policy is on the device before, as it always was. A full fine-tune's reference copy is wrapped in the
policy's units (as many `fully_shard` calls as the policy). Prints "load placement OK" on each rank.
"""

import sys
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.fsdp import shard
from omnirl.models import get_adapter
from omnirl.ops import ops_class
from omnirl.recipe import config_for


def check(name: str, path: str, frozen_base: str, finetune: str = "lora") -> None:
    cfg = config_for(name)
    cfg.model.path, cfg.model.finetune = path, finetune
    cfg.distributed.frozen_base = frozen_base
    cfg.distributed.rollout_gather = "unit" if frozen_base == "offload" else "phase"
    if get_adapter(name).kind == "omni":
        cfg.algo.loss, cfg.lora.target_modules = "grpo", ["q_proj", "k_proj", "v_proj", "o_proj"]
    else:
        cfg.algo.kl_beta = 0.01  # a full fine-tune then keeps a reference copy
    dist = D.init_distributed(group=True)
    adapter_cls = get_adapter(name)
    ops = ops_class(adapter_cls.kind, cfg.algo.loss)(cfg, adapter_cls(cfg, torch.device("meta")))
    models = [ops.policy] + ([ops.ref_model] if ops.ref_model is not None else [])
    assert (finetune == "full") == (len(models) == 2)
    found = []  # per fully_shard call: the devices of the parameters it shards, as it finds them
    fully_shard = fsdp.fully_shard

    def recording(module, **kwargs):
        found.append({p.device.type for p in module.parameters() if not isinstance(p, DTensor)})
        return fully_shard(module, **kwargs)

    with mock.patch.object(fsdp, "fully_shard", recording):
        shard(cfg, ops, dist)
    case = (name, frozen_base, finetune)
    units = len(ops.adapter.fsdp_units()) + 1  # and the root
    assert len(found) == units * len(models), (case, len(found))
    if frozen_base == "replicate":
        assert found[0] == {"meta"}, (case, found[0])  # moved to the device in the constructor
        return
    assert all(devices == {"cpu"} for devices in found), (case, found)
    for model in models:
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.to_local().device.type == "cpu", (case, n)


def main():
    sd3, wan, qwen_vl = sys.argv[1:4]
    check("sd3", sd3, "replicate")
    for frozen_base in ("shard", "offload"):
        check("sd3", sd3, frozen_base)
        check("sd3", sd3, frozen_base, finetune="full")
    check("wan", wan, "shard")
    check("qwen_vl", qwen_vl, "shard")
    print("load placement OK", flush=True)
    D.destroy()


if __name__ == "__main__":
    main()
    D.exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
