"""The FLUX.2-klein adapter on a tiny random-init FLUX.2-klein (real diffusers / transformers classes:
Flux2Transformer2DModel, AutoencoderKLFlux2, Qwen3ForCausalLM, a Qwen2 tokenizer with Qwen3's chat
template), against diffusers' own Flux2KleinPipeline. fp32 on CPU: everything agrees to 1e-5."""

from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline
from safetensors.torch import load_file

from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.diffusers_setup import LORA_FILE
from omnirl.models.flow_sde import flow_step
from omnirl.models.flux2_klein.adapter import Flux2KleinAdapter
from tests.support_compare import (
    check_lora_in_pipeline,
    export_lora_twice,
    initial_latents,
    load_pipeline,
    max_diff,
    packed_serial_diffs,
    perturb_lora,
    prompt_requests,
    tiny_config,
)

PROMPTS = ["a red cat", "two dogs in the snow", "a lighthouse at night", "OPEN 24 HOURS"]
NEGATIVES = ["", "", "", ""]  # the pipeline's negative prompt is always ""
STEPS = 6
SIZE = 32  # pixels: a 4x16x16 VAE latent (the tiny VAE downsamples 2x), patchified 16x8x8: 64 tokens
LATENT = (16, 8, 8)
# LoRA on the attention and MLP projections of both block kinds (the single blocks' output projection
# `attn.to_out` shares its name with the double blocks' ModuleList, which peft cannot wrap).
TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
    "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
    "ff_context.linear_out", "attn.to_qkv_mlp_proj",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_flux2_klein(tmp_path_factory) -> Path:
    """The tiny random-init FLUX.2-klein (a Flux2KleinPipeline checkpoint), built once per session."""
    from omnirl.models.flux2_klein.tiny import make_tiny_flux2_klein

    torch.set_num_threads(2)  # the CI machine has 2 cores, shared
    return make_tiny_flux2_klein(tmp_path_factory.mktemp("tiny") / "flux2_klein")


def make_adapter(path, **lora) -> Flux2KleinAdapter:
    cfg = tiny_config("flux2_klein", path, target_modules=TARGETS, **lora)
    return Flux2KleinAdapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n])


def noise_free(cfg_scale: float = 1.0) -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, cfg_scale, 0.0, "sde", 0, (0, 1))


def run_pipeline(pipe, adapter, requests, output_type):
    """The reference: diffusers' pipeline from the same initial latents the adapter draws per request,
    with CFG above guidance 1 (two forwards, the negative prompt "")."""
    p = requests[0].params
    out = pipe(
        prompt=[r.prompt for r in requests],
        guidance_scale=p.guidance_scale,
        num_inference_steps=p.num_steps,
        height=SIZE,
        width=SIZE,
        latents=initial_latents(requests, LATENT),
        max_sequence_length=adapter.max_sequence_length,
        output_type=output_type,
    ).images
    return out  # "latent": the VAE's latents [B, 4, 16, 16]; "pt": images [B, 3, H, W]


def rollout_outputs(adapter, requests):
    trajs = adapter.rollout(requests)
    latents = adapter.vae_latents(torch.stack([t.final_latents for t in trajs]))
    return trajs, latents, torch.stack([t.output.image for t in trajs])


@pytest.fixture(scope="module")
def adapter(tiny_flux2_klein):
    return make_adapter(tiny_flux2_klein)  # LoRA with B = 0: the policy equals the base model


@pytest.mark.slow
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_noise_free_rollout_is_the_pipeline_sampler(adapter, tiny_flux2_klein, cfg_scale):
    pipe = load_pipeline(Flux2KleinPipeline, tiny_flux2_klein)
    requests = make_requests(noise_free(cfg_scale), n=2)
    trajs, latents, images = rollout_outputs(adapter, requests)
    ref_latents = run_pipeline(pipe, adapter, requests, "latent")
    ref_images = run_pipeline(pipe, adapter, requests, "pt")
    d_latents, d_images = max_diff(latents, ref_latents), max_diff(images, ref_images)
    print(f"CFG {cfg_scale}: pipeline vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert trajs[0].output.image.shape == (3, SIZE, SIZE)
    assert ref_latents.abs().max() > 0.1  # the comparison is not of two empty tensors
    assert d_latents < 1e-5 and d_images < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    params = SamplingParams(SIZE, SIZE, STEPS, 1.0, 0.7, "sde", 2, (0, 3))
    requests = make_requests(params)
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    d_latents, d_logprobs = packed_serial_diffs(packed, serial, LATENT)
    print(f"packed vs serial: window starts {starts}, latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_recomputed_logprob_equals_rollout(adapter):
    """The trainer's recomputation (velocity with CFG from the stored embeddings, then the step's log-prob)
    equals the rollout's record."""
    params = SamplingParams(SIZE, SIZE, STEPS, 4.0, 0.7, "sde", 2, (0, 3))
    trajs = adapter.rollout(make_requests(params))
    k = len(trajs[0].step_indices)
    steps = torch.cat([t.step_indices for t in trajs])
    sigmas = trajs[0].sigmas
    x = torch.cat([t.latents for t in trajs])
    x_next = torch.cat([t.next_latents for t in trajs])
    embeds = {key: torch.stack([t.embeds[key] for t in trajs for _ in range(k)]) for key in trajs[0].embeds}
    assert "negative_prompt_embeds" in embeds
    with torch.no_grad():
        v = adapter.velocity(x, sigmas[steps], embeds, 4.0)
        out = flow_step(
            v, x, sigmas[steps], sigmas[steps + 1], float(sigmas[1]), 0.7, "sde", prev_sample=x_next
        )
    diff = max_diff(out.logprob, torch.cat([t.logprobs for t in trajs]))
    print(f"recomputed vs rollout log-prob: max {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_flux2_klein, tmp_path):
    adapter = make_adapter(tiny_flux2_klein, rank=4, alpha=8.0)  # alpha != rank: the scale must travel
    perturb_lora(adapter, 0.2)
    export_lora_twice(adapter, tmp_path)  # also from the state dict, as an FSDP run: the same file
    exported = load_file(tmp_path / LORA_FILE)
    for block in ("transformer_blocks.0.", "single_transformer_blocks.0."):  # both block kinds
        assert any(block in k for k in exported), block

    pipe = load_pipeline(Flux2KleinPipeline, tiny_flux2_klein)
    requests = make_requests(noise_free(), n=2)
    check_lora_in_pipeline(
        pipe,
        tmp_path,
        lambda: [run_pipeline(pipe, adapter, requests, kind) for kind in ("latent", "pt")],
        lambda: rollout_outputs(adapter, requests)[1:],
    )


def test_registered_with_both_block_kinds_as_units(adapter):
    assert get_adapter("flux2_klein") is Flux2KleinAdapter
    kinds = {type(u).__name__ for u in adapter.fsdp_units()}
    assert kinds == {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"}
    names = [n for n, _ in adapter.policy.named_parameters() if "lora_" in n]
    lora = {n.split(".lora_")[0].split(".", 2)[-1] for n in names}
    assert {"attn.to_q", "ff.linear_out", "ff_context.linear_in", "attn.to_qkv_mlp_proj"} <= lora


def test_schedule_shift_grows_with_resolution(adapter):
    """compute_empirical_mu grows with the image token count: a larger image spends more steps at high
    noise."""
    small, large = adapter.sigmas(STEPS, 64), adapter.sigmas(STEPS, 4096)
    assert torch.all(large[1:-1] > small[1:-1]) and small[0] == 1 and small[-1] == 0


def test_distilled_checkpoint_refuses_cfg(tiny_flux2_klein, tmp_path):
    import json
    import shutil

    distilled = tmp_path / "distilled"
    shutil.copytree(tiny_flux2_klein, distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    cfg = tiny_config("flux2_klein", distilled, target_modules=TARGETS)
    cfg.sampling.guidance_scale = 4.0
    with pytest.raises(ConfigError, match="sampling.guidance_scale"):
        Flux2KleinAdapter(cfg, torch.device("cpu"))


@pytest.mark.slow
def test_tiny_recipe_trains_under_torchrun_fsdp(tiny_flux2_klein, tmp_path):
    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    r = torchrun(
        2, ROOT / "yaml/flux2_klein_tiny_flowgrpo.yaml", "--model.path", str(tiny_flux2_klein),
        "--run.output_dir", str(out), "--run.steps", "2", "--log.image_every", "1",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1] and all(m["train/updates"] == 1 for m in metrics)
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    # The trained LoRA moved away from its initialisation (B = 0).
    exported = load_file(out / "lora/pytorch_lora_weights.safetensors")
    assert max(t.abs().max().item() for k, t in exported.items() if "lora_B" in k) > 0
    assert (out / "samples/step_000001.png").is_file()
    assert "Traceback" not in r.stderr
