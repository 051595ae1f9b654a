"""Export through the adapter: a Wan2.2 T2V-A14B run (two experts) exported from its checkpoint and from
its LoRA directory, as a LoRA and merged, holds both experts' weights, checked against diffusers' own
WanPipeline with both LoRAs loaded (`load_lora_weights(..., load_into_transformer_2=True)`)."""

import json

import peft
import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.models.wan.adapter import LORA_FILE, LORA_FILE_2, LORA_FILES, WanAdapter
from tests.support_compare import load_pipeline, max_diff, perturb_lora, tiny_config
from tests.test_checkpoint import run_export
from tests.test_wan import FRAMES, GUIDANCE_2, make_requests, noise_free, run_pipeline


def a14b_cfg(path, finetune: str = "lora"):
    """The config of an A14B run on the tiny checkpoint at `path`: LoRA rank 4, alpha 8 (alpha != rank:
    every export must carry the scale), or a full fine-tune."""
    cfg = tiny_config("wan", path, rank=4, alpha=8.0)
    cfg.model.finetune = finetune
    cfg.family.num_frames, cfg.family.guidance_scale_2 = FRAMES, GUIDANCE_2
    return cfg


def save(adapter: WanAdapter, cfg, out) -> str:
    """`adapter` (of `cfg`) saved as the step-1 checkpoint of a run into `out`, with a fresh optimizer."""
    cfg.run.output_dir = str(out)
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    return str(checkpoint.save(cfg, 1, adapter.policy, opt, D.init_distributed()))


@pytest.fixture(scope="module")
def a14b_lora(tiny_wan_a14b):
    """The A14B adapter with a LoRA of rank 4, alpha 8 on both experts, each perturbed differently."""
    cfg = a14b_cfg(tiny_wan_a14b)
    adapter = WanAdapter(cfg, torch.device("cpu"))
    perturb_lora(adapter, 0.05)
    return adapter, cfg


@pytest.mark.slow
def test_a14b_lora_exports_both_experts(a14b_lora, tiny_wan_a14b, tmp_path):
    adapter, cfg = a14b_lora
    ckpt = save(adapter, cfg, tmp_path / "run")
    run_export(ckpt, tmp_path / "lora")
    run_export(ckpt, tmp_path / "merged", "--merge")
    run_export(tmp_path / "lora", tmp_path / "copy")  # a run's lora/ directory
    run_export(tmp_path / "lora", tmp_path / "merged_from_lora", "--merge", "--model-path", tiny_wan_a14b)
    run_export(ckpt, tmp_path / "peft", "--format", "peft")
    run_export(tmp_path / "lora", tmp_path / "peft_from_lora", "--format", "peft")

    for f in (LORA_FILE, LORA_FILE_2):
        assert (tmp_path / "copy" / f).read_bytes() == (tmp_path / "lora" / f).read_bytes(), f
    requests = make_requests(noise_free(), n=2)
    reference = load_pipeline(WanPipeline, tiny_wan_a14b)
    base = run_pipeline(reference, adapter, requests, "latent", GUIDANCE_2)
    reference.load_lora_weights(tmp_path / "lora")
    reference.load_lora_weights(tmp_path / "lora", weight_name=LORA_FILE_2, load_into_transformer_2=True)
    expected = run_pipeline(reference, adapter, requests, "latent", GUIDANCE_2)
    ours = torch.stack([t.final_latents for t in adapter.rollout(requests)])
    assert max_diff(expected, base) > 1e-2 and max_diff(expected, ours) < 1e-5

    # Each expert of a merged pipeline is its base with its own LoRA fused in; the pipeline samples as the
    # reference does.
    lora = {n: load_file(tmp_path / "lora" / f) for n, f in LORA_FILES.items()}
    for merged_dir in ("merged", "merged_from_lora"):
        merged = load_pipeline(WanPipeline, tmp_path / merged_dir)
        assert max_diff(run_pipeline(merged, adapter, requests, "latent", GUIDANCE_2), expected) < 1e-5
        for name in ("transformer", "transformer_2"):
            base_sd = WanTransformer3DModel.from_pretrained(tiny_wan_a14b, subfolder=name).state_dict()
            merged_sd = getattr(merged, name).state_dict()
            changed = 0
            for key, w in base_sd.items():
                module = key.rsplit(".", 1)[0]
                a = lora[name].get(f"transformer.{module}.lora_A.weight")
                if a is not None and key.endswith("weight"):
                    b = lora[name][f"transformer.{module}.lora_B.weight"]
                    torch.testing.assert_close(merged_sd[key], w + 2.0 * b @ a, atol=1e-6, rtol=0)
                    changed += 1
                else:
                    assert torch.equal(merged_sd[key], w), (merged_dir, name, key)
            assert changed > 0, (merged_dir, name)

    # The peft format: one adapter per expert, each loading onto its base expert.
    for peft_dir in ("peft", "peft_from_lora"):
        pipe = load_pipeline(WanPipeline, tiny_wan_a14b)
        for name in ("transformer", "transformer_2"):
            config = json.loads((tmp_path / peft_dir / name / "adapter_config.json").read_text())
            assert config["lora_alpha"] == 8 and config["r"] == 4
            model = peft.PeftModel.from_pretrained(getattr(pipe, name), tmp_path / peft_dir / name)
            setattr(pipe, name, model.get_base_model())  # peft injected the LoRA into it in place
        assert max_diff(run_pipeline(pipe, adapter, requests, "latent", GUIDANCE_2), expected) < 1e-5


@pytest.mark.slow
def test_a14b_full_finetune_merges_both_experts(tiny_wan_a14b, tmp_path):
    cfg = a14b_cfg(tiny_wan_a14b, "full")
    adapter = WanAdapter(cfg, torch.device("cpu"))
    with torch.no_grad():  # "trained": each expert differently
        adapter.policy["transformer"].proj_out.weight.add_(0.5)
        adapter.policy["transformer_2"].proj_out.weight.sub_(0.25)
    ckpt = save(adapter, cfg, tmp_path / "run")
    run_export(ckpt, tmp_path / "merged", "--merge")
    for name in ("transformer", "transformer_2"):
        merged = WanTransformer3DModel.from_pretrained(tmp_path / "merged", subfolder=name).state_dict()
        trained = adapter.policy[name].state_dict()
        assert merged.keys() == trained.keys() and all(torch.equal(v, trained[k]) for k, v in merged.items())
    assert WanPipeline.load_config(tmp_path / "merged")["boundary_ratio"] == adapter.boundary_ratio
