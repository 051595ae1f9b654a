"""The FLUX.1 adapter on a tiny random-init FLUX.1-dev (real diffusers / transformers classes), against
diffusers' own FluxPipeline. fp32 on CPU: everything must agree to 1e-5 (docs/architecture.md)."""

import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import load_file

from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.diffusers_setup import LORA_FILE, attention_kernels
from omnirl.models.flow_sde import flow_step
from omnirl.models.flux.adapter import FluxAdapter
from omnirl.models.sd3.adapter import SD3Adapter
from tests.support_compare import (
    check_lora_in_pipeline,
    export_lora_twice,
    initial_latents,
    load_pipeline,
    max_diff,
    packed_serial_diffs,
    perturb_lora,
    prompt_requests,
    rollout_outputs,
    tiny_config,
)

PROMPTS = ["a red cat", "two dogs in the snow", "a lighthouse at night", "OPEN 24 HOURS"]
NEGATIVES = ["blurry", "", "low quality", ""]
STEPS = 6
SIZE = 32  # pixels: 16x16 latents (the tiny VAE downsamples 2x), 64 packed tokens
# LoRA on the attention and MLP projections of both block kinds (the double blocks' image and text
# streams, the single blocks' fused MLP and output projections).
TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
    "ff_context.net.2", "proj_mlp", "proj_out",
]  # fmt: skip


def make_adapter(path, shift=None, **lora) -> FluxAdapter:
    cfg = tiny_config("flux", path, target_modules=TARGETS, **lora)
    cfg.family.shift = shift
    return FluxAdapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n])


def noise_free(cfg_scale: float = 1.0) -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, cfg_scale, 0.0, "sde", 0, (0, 1))


def run_pipeline(pipe, adapter, requests, output_type):
    """The reference: diffusers' pipeline from the same initial latents the adapter draws per request
    (packed as the pipeline packs its own), with FLUX.1-dev's embedded guidance and, above 1, true CFG."""
    p, c, h = requests[0].params, adapter.policy.config.in_channels // 4, SIZE // adapter.vae_scale_factor
    latents = FluxPipeline._pack_latents(initial_latents(requests, (c, h, h)), len(requests), c, h, h)
    true_cfg = p.guidance_scale > 1
    out = pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[r.negative_prompt for r in requests] if true_cfg else None,
        true_cfg_scale=p.guidance_scale,
        guidance_scale=adapter.guidance,
        num_inference_steps=p.num_steps,
        height=SIZE,
        width=SIZE,
        latents=latents,
        max_sequence_length=adapter.max_sequence_length,
        output_type=output_type,
    ).images
    if output_type == "latent":  # packed [B, S, 4C] -> [B, C, h, w]
        return FluxPipeline._unpack_latents(out, SIZE, SIZE, adapter.vae_scale_factor)
    return out


@pytest.fixture(scope="module")
def adapter(tiny_flux):
    return make_adapter(tiny_flux)  # LoRA with B = 0: the policy equals the base model


@pytest.mark.slow
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_noise_free_rollout_is_the_pipeline_sampler(adapter, tiny_flux, cfg_scale):
    pipe = load_pipeline(FluxPipeline, tiny_flux)
    requests = make_requests(noise_free(cfg_scale), n=2)
    trajs = adapter.rollout(requests)
    ref_latents = run_pipeline(pipe, adapter, requests, "latent")
    ref_images = run_pipeline(pipe, adapter, requests, "pt")
    d_latents = max_diff(torch.stack([t.final_latents for t in trajs]), ref_latents)
    d_images = max_diff(torch.stack([t.output.image for t in trajs]), ref_images)
    print(f"true CFG {cfg_scale}: pipeline vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert trajs[0].output.image.shape == (3, SIZE, SIZE)
    assert ref_latents.abs().max() > 0.1  # the comparison is not of two empty tensors
    assert d_latents < 1e-5 and d_images < 1e-5


def test_schedule_shift_grows_with_resolution_unless_fixed(tiny_flux, adapter):
    """The pipeline's shift (calculate_shift of the image tokens) moves the schedule with the image size;
    family.shift fixes it: 3 gives DanceGRPO's sd3_time_shift(3, linspace(1, 0, T + 1))."""
    small, large = adapter.sigmas(STEPS, 64), adapter.sigmas(STEPS, 4096)
    assert torch.all(large[1:-1] > small[1:-1])
    fixed = make_adapter(tiny_flux, shift=3.0)
    t = torch.linspace(1, 0, STEPS + 1)
    expected = 3 * t / (1 + 2 * t)
    torch.testing.assert_close(fixed.sigmas(STEPS, 64), expected)
    torch.testing.assert_close(fixed.sigmas(STEPS, 4096), expected)


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    params = SamplingParams(SIZE, SIZE, STEPS, 1.0, 0.7, "sde", 2, (0, 3))
    requests = make_requests(params)
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    d_latents, d_logprobs = packed_serial_diffs(packed, serial)
    print(f"packed vs serial: window starts {starts}, latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_recomputed_logprob_equals_rollout(adapter):
    params = SamplingParams(SIZE, SIZE, STEPS, 1.0, 0.3, "dance_sde", 2, (0, 3))
    trajs = adapter.rollout(make_requests(params))
    k = len(trajs[0].step_indices)
    steps = torch.cat([t.step_indices for t in trajs])
    sigmas = trajs[0].sigmas
    x = torch.cat([t.latents for t in trajs])
    x_next = torch.cat([t.next_latents for t in trajs])
    embeds = {key: torch.stack([t.embeds[key] for t in trajs for _ in range(k)]) for key in trajs[0].embeds}
    with torch.no_grad():
        v = adapter.velocity(x, sigmas[steps], embeds, 1.0)
        out = flow_step(
            v, x, sigmas[steps], sigmas[steps + 1], float(sigmas[1]), 0.3, "dance_sde", prev_sample=x_next
        )
    diff = max_diff(out.logprob, torch.cat([t.logprobs for t in trajs]))
    print(f"recomputed vs rollout log-prob: max {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_flux, tmp_path):
    adapter = make_adapter(tiny_flux, rank=4, alpha=8.0)  # alpha != rank: the export must carry the scale
    perturb_lora(adapter, 0.05)
    export_lora_twice(adapter, tmp_path)  # also from the state dict, as an FSDP run: the same file
    exported = load_file(tmp_path / LORA_FILE)
    for block in ("transformer_blocks.0.", "single_transformer_blocks.0."):  # both block kinds
        assert any(block in k for k in exported), block

    pipe = load_pipeline(FluxPipeline, tiny_flux)
    requests = make_requests(noise_free(), n=2)
    check_lora_in_pipeline(
        pipe,
        tmp_path,
        lambda: [run_pipeline(pipe, adapter, requests, kind) for kind in ("latent", "pt")],
        lambda: rollout_outputs(adapter, requests),
    )


def test_registered_with_both_block_kinds_as_units(adapter):
    assert get_adapter("flux") is FluxAdapter
    units = adapter.fsdp_units()
    kinds = {type(u).__name__ for u in units}
    assert kinds == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    names = [n for n, _ in adapter.policy.named_parameters() if "lora_" in n]
    lora = {n.split(".lora_")[0].split(".", 2)[-1] for n in names}
    assert {"attn.to_q", "ff.net.2", "ff_context.net.2", "proj_mlp", "proj_out"} <= lora


def test_cudnn_attention_is_off_on_a_gpu_only(adapter):
    """FLUX turns PyTorch's cuDNN attention off on a CUDA device (its trained backward failed there),
    not on the CPU; the other families keep it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention_kernels(adapter, torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        sd3 = SD3Adapter.__new__(SD3Adapter)  # the class's choice only: no checkpoint needed
        attention_kernels(sd3, torch.device("cuda"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        attention_kernels(adapter, torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_full_finetune_trains_every_weight_in_float32(tiny_flux):
    cfg = tiny_config("flux", tiny_flux)
    cfg.model.finetune = "full"
    adapter = FluxAdapter(cfg, torch.device("cpu"))
    params = adapter.trainable_parameters()
    assert len(params) == len(list(adapter.policy.parameters()))
    assert all(p.dtype == torch.float32 for p in params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe", ["flux_tiny_flowgrpo", "flux_tiny_dancegrpo", "flux_tiny_mixgrpo", "flux_tiny_dgpo"]
)
def test_tiny_recipes_under_torchrun_fsdp(recipe, tiny_flux, tmp_path):
    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    r = torchrun(
        2, ROOT / f"yaml/{recipe}.yaml", "--model.path", str(tiny_flux), "--run.output_dir", str(out),
        "--run.steps", "2", "--log.image_every", "1",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1] and all(m["train/updates"] == 1 for m in metrics)
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    assert (out / "lora/pytorch_lora_weights.safetensors").is_file()
    assert (out / "samples/step_000001.png").is_file()
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_random_init_dry_run_counts_flux():
    """--dry-run --random-init builds FLUX.1-dev's full-size models from their public configs on the meta
    device and counts them: the transformer 11.9 B, T5-XXL's encoder 4.76 B, CLIP-L's text tower 0.12 B."""
    import re
    import subprocess
    import sys

    from tests.test_train import ROOT

    cmd = [sys.executable, "-m", "benchmarks.rollout_packing", "--model", "flux", "--random-init"]
    r = subprocess.run(
        [*cmd, "--dry-run", "--images", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    counts = dict(re.findall(r"^  (\w+) +\w+ +[\d,]+ params \(([\d.]+) B\)", r.stdout, re.M))
    assert 11.8 < float(counts["transformer"]) < 12.0, r.stdout
    assert 4.7 < float(counts["text_encoder_2"]) < 4.8 and 0.1 < float(counts["text_encoder"]) < 0.13, (
        r.stdout
    )
    assert "TFLOP per image" in r.stdout
