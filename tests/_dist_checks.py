"""Checks of omnirl.fsdp.load_pretrained and omnirl.trainer.per_rank on 2 ranks (gloo); launched by
tests/test_distributed.py with torchrun. argv[1]: a tiny Qwen-Image checkpoint, argv[2]: a tiny Qwen3-Omni
one. Prints "dist checks OK" on each rank; any failure raises."""

import sys

import torch
from transformers import (
    AutoConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from transformers.core_model_loading import revert_weight_conversion

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.step import per_rank


def main() -> None:
    info = D.init_distributed()
    # bfloat16: from_pretrained keeps the rotary inv_freq buffers in float32, a meta build casts them; the
    # broadcast must leave rank 1 with exactly rank 0's (here: every rank's own from_pretrained) tensors.
    kwargs = dict(subfolder="text_encoder", dtype=torch.bfloat16)
    model = fsdp.load_pretrained(Qwen2_5_VLForConditionalGeneration, sys.argv[1], **kwargs)
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(sys.argv[1], **kwargs)
    mine = dict([*model.named_parameters(), *model.named_buffers()])
    theirs = [*ref.named_parameters(), *ref.named_buffers()]
    assert {t.dtype for _, t in theirs} == {torch.bfloat16, torch.float32}  # the case under test is there
    for name, t in theirs:
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name

    # The thinker of a full Qwen3-Omni checkpoint, loaded with a key_mapping (thinker.* -> *): every rank
    # gives its in-memory names back as the checkpoint's (what a vLLM weight push sends), rank 0 included.
    config = AutoConfig.from_pretrained(sys.argv[2]).thinker_config
    thinker = fsdp.load_pretrained(
        Qwen3OmniMoeThinkerForConditionalGeneration,
        sys.argv[2],
        config=config,
        key_mapping={r"^thinker\.": ""},
    )
    names = list(revert_weight_conversion(thinker, dict(thinker.named_parameters())))
    assert names and all(n.startswith("thinker.") for n in names), names[:3]

    # per_rank: every rank's value under KEY/rankR, the maximum under KEY; other keys are not touched.
    logs = {"mem/train_peak_gib": 1.0 + info.rank, "time/generate_s": 5.0 - info.rank, "loss/policy": 0.5}
    assert per_rank(logs) == {
        "mem/train_peak_gib/rank0": 1.0,
        "mem/train_peak_gib/rank1": 2.0,
        "mem/train_peak_gib": 2.0,
        "time/generate_s/rank0": 5.0,
        "time/generate_s/rank1": 4.0,
        "time/generate_s": 5.0,
    }
    print(f"rank {info.rank}: dist checks OK", flush=True)
    D.barrier()
    D.destroy()


if __name__ == "__main__":
    main()
    D.exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
