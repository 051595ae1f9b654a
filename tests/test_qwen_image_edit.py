"""The Qwen-Image-Edit adapter on a tiny random-init Qwen-Image-Edit (real diffusers / transformers classes),
against diffusers' own QwenImageEditPipeline. fp32 on CPU: all must agree to 1e-5 (docs/architecture.md)."""

import dataclasses
import re

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_pipeline_module
import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image

from omnirl.data.prompts import PromptRow
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.qwen_image_edit.adapter import QwenImageEditAdapter, QwenImageEditSettings
from omnirl.ops.diffusion import Pair, pair_logprob
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

# Different lengths (the tiny tokenizer is one token per byte), all in the 320 bucket; negatives in 288.
PROMPTS = [
    'Make the sign read "OPEN"',
    'Change the text on the sign to "WELCOME"',
    'Edit the sign so it says "BAR"',
    'Replace the word on the board with "TAXI"',
]
NEGATIVES = [" ", "blurry", " ", "low quality"]
GUIDANCE = 4.0
STEPS = 4
SIZE = 32  # pixels: 16x16 latents (the tiny VAE downsamples 2x), 64 image tokens
AREA = SIZE * SIZE  # the conditioning area: 64x64 sources are conditioned at 32x32 (64 more tokens)


def source_image(seed: int, width: int = 64, height: int = 64) -> Image.Image:
    """A random RGB image: smooth blocks, so that resizing keeps some structure."""
    rng = np.random.default_rng(seed)
    cells = (rng.random((height // 8, width // 8, 3)) * 255).astype(np.uint8)
    return Image.fromarray(cells).resize((width, height), Image.BICUBIC)


def make_adapter(path, **lora) -> QwenImageEditAdapter:
    cfg = tiny_config("qwen_image_edit", path, **lora)
    cfg.family = QwenImageEditSettings(prompt_length_buckets=[288, 320, 352], condition_area=AREA)
    return QwenImageEditAdapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, images: list[Image.Image], n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n], images=images)


def noise_free(guidance: float = GUIDANCE) -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, guidance, 0.0, "sde", 0, (0, 1))


@pytest.fixture(scope="module")
def adapter(tiny_qwen_image_edit):
    return make_adapter(tiny_qwen_image_edit)  # LoRA with B = 0: the policy equals the base model


@pytest.fixture
def pipeline(tiny_qwen_image_edit, adapter, monkeypatch):
    """The reference pipeline, its hard-coded 1024 * 1024 conditioning area patched to the adapter's."""
    original = edit_pipeline_module.calculate_dimensions
    monkeypatch.setattr(
        edit_pipeline_module, "calculate_dimensions", lambda area, ratio: original(AREA, ratio)
    )
    # Loading a Qwen2VLProcessor needs torchvision (its video processor): hand the pipeline ours.
    return load_pipeline(QwenImageEditPipeline, tiny_qwen_image_edit, processor=adapter.processor)


def run_pipeline(pipe, adapter, request, output_type):
    """One request through the pipeline (it takes one condition image per call), from the initial
    latents the adapter draws for it."""
    c, h = adapter.policy.config.in_channels // 4, SIZE // adapter.vae_scale_factor
    latents = initial_latents([request], (c, h, h))  # [1, C, h, w]
    guided = request.params.guidance_scale > 1
    return pipe(
        image=request.inputs["image"],
        prompt=request.prompt,
        negative_prompt=request.negative_prompt if guided else None,
        true_cfg_scale=request.params.guidance_scale,
        num_inference_steps=request.params.num_steps,
        height=SIZE,
        width=SIZE,
        latents=QwenImageEditPipeline._pack_latents(latents, 1, c, h, h),
        output_type=output_type,
    ).images


def pipeline_outputs(pipe, adapter, requests):
    """Final latents [B, C, h, w] (unpacked like the adapter's) and images [B, 3, H, W] of the pipeline."""
    latents = torch.cat([run_pipeline(pipe, adapter, r, "latent") for r in requests])  # [B, S, 4C]
    unpacked = QwenImageEditPipeline._unpack_latents(latents, SIZE, SIZE, adapter.vae_scale_factor)[:, :, 0]
    images = torch.cat([run_pipeline(pipe, adapter, r, "pt") for r in requests])
    return unpacked, images


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [1.0, GUIDANCE])
def test_noise_free_rollout_is_the_pipeline_sampler(adapter, pipeline, guidance):
    requests = make_requests(noise_free(guidance), [source_image(0), source_image(1)], n=2)
    trajs = adapter.rollout(requests)
    ref_latents, ref_images = pipeline_outputs(pipeline, adapter, requests)
    d_latents = max_diff(torch.stack([t.final_latents for t in trajs]), ref_latents)
    d_images = max_diff(torch.stack([t.output.image for t in trajs]), ref_images)
    print(f"guidance {guidance}: pipeline vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert trajs[0].output.image.shape == (3, SIZE, SIZE)
    assert trajs[0].embeds["image_latents"].shape == (4, 16, 16)  # the 32x32 condition image's latents
    assert d_latents < 1e-5 and d_images < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    params = SamplingParams(SIZE, SIZE, STEPS, GUIDANCE, 1.2, "sde", 2, (0, 3))
    requests = make_requests(params, [source_image(0), source_image(1)])
    keys = {adapter.compat_key(r) for r in requests}
    lengths = [adapter.prompt_length(r.prompt, (SIZE, SIZE)) for r in requests]
    assert len(keys) == 1 and len(set(lengths)) == len(requests), (keys, lengths)  # one batch, all padded
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    d_latents, d_logprobs = packed_serial_diffs(packed, serial)
    print(
        f"packed vs serial: text lengths {lengths}, window starts {starts}, latents {d_latents:.2e}, "
        f"logprobs {d_logprobs:.2e}"
    )
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_recomputed_logprob_equals_rollout(adapter):
    """The trainer's recomputation (trainer.pair_logprob: batch_embeds + velocity) of every stored step in
    one batch that mixes prompt lengths and condition sizes (a 96x32 source is conditioned at 64x32: another
    compatibility key, so it was rolled out apart)."""
    params = SamplingParams(SIZE, SIZE, STEPS, GUIDANCE, 1.2, "sde", 2, (0, 3))
    requests = make_requests(params, [source_image(0), source_image(2, 96, 32)])
    assert len({adapter.compat_key(r) for r in requests}) == 2
    trajs = [t for part in (requests[0::2], requests[1::2]) for t in adapter.rollout(part)]
    assert {tuple(t.embeds["image_latents"].shape) for t in trajs} == {(4, 16, 16), (4, 16, 32)}
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    recorded = torch.stack([p.traj.logprobs[p.k] for p in pairs])
    with torch.no_grad():
        recomputed = pair_logprob(adapter, pairs, params).logprob
    diff = (recomputed - recorded).abs()
    print(f"recomputed vs rollout log-prob: mean |diff| {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.max() < 1e-5
    # train.compile pads the texts to their buckets, as the rollout does (masked: the same log-probs).
    texts = adapter.batch_embeds([p.traj.embeds for p in pairs], bucketed=True)
    assert (texts["prompt_embeds"].shape[1], texts["negative_prompt_embeds"].shape[1]) == (320, 288)
    assert adapter.batch_embeds([p.traj.embeds for p in pairs])["prompt_embeds"].shape[1] < 320
    with torch.no_grad():
        bucketed = pair_logprob(adapter, pairs, params, bucketed=True).logprob
    assert (bucketed - recorded).abs().max() < 1e-5


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_qwen_image_edit, pipeline, tmp_path):
    adapter = make_adapter(tiny_qwen_image_edit, rank=4, alpha=8.0)  # alpha != rank: the scale must travel
    perturb_lora(adapter, 0.1)
    export_lora_twice(adapter, tmp_path)  # also from the state dict, as an FSDP run: the same file

    requests = make_requests(noise_free(), [source_image(0)], n=1)
    check_lora_in_pipeline(
        pipeline,
        tmp_path,
        lambda: pipeline_outputs(pipeline, adapter, requests),
        lambda: rollout_outputs(adapter, requests),
    )


def test_bad_requests_and_paths(adapter, tiny_qwen_image_edit, tmp_path):
    assert get_adapter("qwen_image_edit") is QwenImageEditAdapter
    params = noise_free()
    no_image = Request("a", 0, 3, 0, params, metadata={"source": "edit.jsonl:4"})
    with pytest.raises(ValueError, match=r"request 3 \(edit.jsonl:4\).*inputs\['image'\]"):
        adapter.compat_key(no_image)
    too_long = Request("x" * 200, 0, 0, 0, params, inputs={"image": source_image(0)})
    expected = (
        r"the prompt \(200 characters\) with a \d+x\d+ condition image is \d+ text tokens, more than the "
    )
    with pytest.raises(ValueError, match=expected + r"largest of family.prompt_length_buckets \(352\)"):
        adapter.num_tokens(too_long)  # the packer asks every request's tokens before any rollout
    # The data check finds it first, by row, from the image file's header.
    source_image(0).save(tmp_path / "a.png")
    row = PromptRow("x" * 200, metadata={"source": "edit.jsonl:4"}, inputs={"image": tmp_path / "a.png"})
    expected = r"the instruction \(200 characters\) with its \d+x\d+ condition image is \d+ text tokens"
    assert re.match(expected, adapter.prompt_problem(row))
    assert adapter.prompt_problem(dataclasses.replace(row, prompt="Make it red")) is None
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        make_adapter(missing)
