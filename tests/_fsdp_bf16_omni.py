"""FSDP2 in bfloat16 must not change what an omni model computes (launched by tests/test_distributed.py with
torchrun on 2 ranks; argv[1]: a tiny Qwen3-Omni checkpoint). Prints "fsdp bf16 checks OK" on each rank.

The same tiny thinker, bf16 with a fresh LoRA (B = 0: a trained LoRA computes in float32 unsharded and in
bf16 under FSDP, by design), is built twice: plain, and sharded as the trainer shards it (FSDP2, param_dtype
bfloat16). Prompts are longer than 256 tokens, so their M-RoPE positions (float32: Qwen3-Omni's
get_rope_index returns float positions) are not all representable in bfloat16: a root that cast its inputs
to bfloat16 moved them to even numbers. Both the rollout (engine) and the trainer (token_logprobs) must give
the plain model's samples and log-probs, and the rotary embedding must see the exact float32 positions.
"""

import sys
from types import SimpleNamespace

import torch

from omnirl import distributed as D
from omnirl.fsdp import shard
from omnirl.models import get_adapter
from omnirl.models.base import GenerationParams, Request
from omnirl.models.lm import pad_responses
from omnirl.recipe import config_for
from omnirl.rollout.generate import GenerationEngine


def build(path: str, info: D.DistInfo, fsdp: bool):
    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.adapter, cfg.model.dtype = path, "qwen3_omni_thinker", "bfloat16"
    cfg.model.finetune, cfg.lora.rank, cfg.lora.alpha = "lora", 8, 16
    cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cfg.distributed.fsdp, cfg.distributed.param_dtype = fsdp, "bfloat16"
    torch.manual_seed(0)  # the same LoRA init in both
    adapter = get_adapter("qwen3_omni_thinker")(cfg, info.device)
    if fsdp:
        shard(cfg, SimpleNamespace(adapter=adapter, policy=adapter.policy, ref_model=None), info)
    return adapter


def rollout_and_score(adapter, requests):
    trajs = GenerationEngine(adapter, 4, 0.25).generate(requests)
    seen = []  # the positions the rotary embedding is called with in the trainer's forward
    rotary = adapter.model.body.language_model.rotary_emb
    hook = rotary.register_forward_hook(lambda m, args, out: seen.append(args[1].detach().clone()))
    batch = {k: v.to(adapter.device) for k, v in adapter.collate([t.prompt_inputs() for t in trajs]).items()}
    seqs, mask = pad_responses([t.response_ids for t in trajs], adapter.pad_token_id)
    with torch.no_grad():
        lp = adapter.token_logprobs(batch, seqs.to(adapter.device), mask.to(adapter.device), 1.0).cpu()
    hook.remove()
    return trajs, lp, mask, seen[0], adapter.rope_positions(batch)


def main() -> None:
    info = D.init_distributed()
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    params = GenerationParams(max_new_tokens=12, temperature=1.0)
    requests = [
        Request(" ".join(words[(i + j) % 12] for j in range(300 + 40 * i)), i, i, 100 + i, params)
        for i in range(3)
    ]
    plain = rollout_and_score(build(sys.argv[1], info, fsdp=False), requests)
    sharded_adapter = build(sys.argv[1], info, fsdp=True)
    sharded = rollout_and_score(sharded_adapter, requests)
    # generation.merge_lora under FSDP2: the merge reads the gathered weights (B = 0: W + 0 is W exactly)
    merged = GenerationEngine(sharded_adapter, 4, 0.25, merge_lora=True).generate(requests)
    (p_trajs, p_lp, mask, _, _), (s_trajs, s_lp, _, s_seen, s_pos) = plain, sharded
    assert max(len(t.prompt_ids) for t in p_trajs) > 600  # positions past 512: bf16 steps of 4
    for a, b in zip(p_trajs, s_trajs):
        assert torch.equal(a.response_ids, b.response_ids), "FSDP changed the rollout's samples"
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6, "FSDP changed the rollout's log-probs"
    for a, b in zip(p_trajs, merged):
        assert torch.equal(a.response_ids, b.response_ids), "a merged LoRA under FSDP changed the samples"
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6, "a merged LoRA under FSDP changed the log-probs"
    assert (p_lp[mask] - s_lp[mask]).abs().max() <= 1e-6, "FSDP changed the trainer's log-probs"
    assert s_seen.dtype == torch.float32 and torch.equal(s_seen[:, :, : s_pos.shape[2]], s_pos), (
        "the rotary embedding did not get the exact M-RoPE positions"
    )
    print(f"rank {info.rank}: fsdp bf16 checks OK", flush=True)
    D.barrier()
    D.destroy()


if __name__ == "__main__":
    main()
    D.exit_now(0)  # the checks passed: no interpreter finalization (omnirl.distributed.exit_now)
