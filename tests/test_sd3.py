"""The SD3 adapter on a tiny random-init SD3 (real diffusers / transformers classes), against diffusers'
own StableDiffusion3Pipeline. fp32 on CPU: everything must agree to 1e-5 (docs/architecture.md)."""

import re

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import flow_step
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
GUIDANCE = 4.5
STEPS = 6
SIZE = 32  # pixels: 16x16 latents (the tiny VAE downsamples 2x)


def make_adapter(path, **lora) -> SD3Adapter:
    return SD3Adapter(tiny_config("sd3", path, **lora), torch.device("cpu"))


def make_requests(params: SamplingParams, n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n])


def noise_free(guidance: float = GUIDANCE) -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, guidance, 0.0, "sde", 0, (0, 1))


def run_pipeline(pipe, adapter, requests, output_type):
    """The reference: diffusers' pipeline from the same initial latents the adapter draws per request."""
    c, h = adapter.policy.config.in_channels, SIZE // adapter.vae_scale_factor
    return pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[r.negative_prompt for r in requests],
        guidance_scale=requests[0].params.guidance_scale,
        num_inference_steps=requests[0].params.num_steps,
        height=SIZE,
        width=SIZE,
        latents=initial_latents(requests, (c, h, h)),
        max_sequence_length=adapter.max_sequence_length,
        output_type=output_type,
    ).images


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    return make_adapter(tiny_sd3)  # LoRA with B = 0: the policy equals the base model


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [1.0, GUIDANCE])
def test_noise_free_rollout_is_the_pipeline_sampler(adapter, tiny_sd3, guidance):
    pipe = load_pipeline(StableDiffusion3Pipeline, tiny_sd3)
    requests = make_requests(noise_free(guidance), n=2)
    trajs = adapter.rollout(requests)
    ref_latents = run_pipeline(pipe, adapter, requests, "latent")
    ref_images = run_pipeline(pipe, adapter, requests, "pt")
    d_latents = max_diff(torch.stack([t.final_latents for t in trajs]), ref_latents)
    d_images = max_diff(torch.stack([t.output.image for t in trajs]), ref_images)
    print(f"guidance {guidance}: pipeline vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert trajs[0].output.image.shape == (3, SIZE, SIZE)
    assert d_latents < 1e-5 and d_images < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    params = SamplingParams(SIZE, SIZE, STEPS, GUIDANCE, 0.7, "sde", 2, (0, 3))
    requests = make_requests(params)
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    d_latents, d_logprobs = packed_serial_diffs(packed, serial)
    print(f"packed vs serial: window starts {starts}, latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_recomputed_logprob_equals_rollout(adapter, sde_type):
    params = SamplingParams(SIZE, SIZE, STEPS, GUIDANCE, 0.7, sde_type, 2, (0, 3))
    trajs = adapter.rollout(make_requests(params))
    # Every (sample, trained step) pair in one batch, as the trainer stacks them: rows at different sigmas.
    k = len(trajs[0].step_indices)
    steps = torch.cat([t.step_indices for t in trajs])
    sigmas = trajs[0].sigmas
    x = torch.cat([t.latents for t in trajs])
    x_next = torch.cat([t.next_latents for t in trajs])
    embeds = {key: torch.stack([t.embeds[key] for t in trajs for _ in range(k)]) for key in trajs[0].embeds}
    recorded = torch.cat([t.logprobs for t in trajs])
    with torch.no_grad():
        for fused in (True, False):
            v = adapter.velocity(x, sigmas[steps], embeds, GUIDANCE, fused_cfg=fused)
            out = flow_step(
                v, x, sigmas[steps], sigmas[steps + 1], float(sigmas[1]), 0.7, sde_type, prev_sample=x_next
            )
            diff = max_diff(out.logprob, recorded)
            print(f"{sde_type} recomputed vs rollout log-prob (fused_cfg={fused}): max {diff:.2e}")
            assert diff < 1e-5


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_sd3, tmp_path):
    adapter = make_adapter(tiny_sd3, rank=4, alpha=8.0)  # alpha != rank: the export must carry the scale
    perturb_lora(adapter, 0.05)
    export_lora_twice(adapter, tmp_path)  # also from the state dict, as an FSDP run: the same file

    pipe = load_pipeline(StableDiffusion3Pipeline, tiny_sd3)
    requests = make_requests(noise_free(), n=2)
    check_lora_in_pipeline(
        pipe,
        tmp_path,
        lambda: [run_pipeline(pipe, adapter, requests, kind) for kind in ("latent", "pt")],
        lambda: rollout_outputs(adapter, requests),
    )


def test_bad_names_and_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown adapter 'nope'; known: .*sd3"):
        get_adapter("nope")
    assert get_adapter("sd3") is SD3Adapter
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        make_adapter(missing)


def test_mixgrpo_flash_rollout_on_the_compressed_schedule(adapter):
    """MixGRPO-Flash on SD3's own schedule (shift 3): 10 steps, a window at steps 0-1, so
    n = int(0.4 * (10 - 1)) = 3 points from sigma_2 to 0, evenly spaced in the unshifted time t = sigma /
    (3 - 2 sigma): 2 steps after the window, 4 in all. The trainer recomputes the window's log-probs."""
    params = SamplingParams(
        SIZE, SIZE, 10, GUIDANCE, 0.7, "sde", 2, (0, 2), ode_solver="dpm2",
        sde_window_schedule="sliding_compressed", ode_compress_ratio=0.4,
    )  # fmt: skip
    trajs = adapter.rollout(make_requests(params, n=2))
    full = adapter.sigmas(10)
    s2 = float(full[2])
    t = torch.linspace(s2 / (3 - 2 * s2), 0, 3, dtype=torch.float64)
    expected = torch.cat([full[:3], (3 * t / (1 + 2 * t)).float()[1:]])
    for traj in trajs:
        torch.testing.assert_close(traj.sigmas, expected)
        assert traj.step_indices.tolist() == [0, 1] and torch.isfinite(traj.final_latents).all()
    steps = torch.cat([t.step_indices for t in trajs])
    x, x_next = torch.cat([t.latents for t in trajs]), torch.cat([t.next_latents for t in trajs])
    embeds = {key: torch.stack([t.embeds[key] for t in trajs for _ in range(2)]) for key in trajs[0].embeds}
    sig = trajs[0].sigmas
    with torch.no_grad():
        v = adapter.velocity(x, sig[steps], embeds, GUIDANCE)
        out = flow_step(v, x, sig[steps], sig[steps + 1], float(sig[1]), 0.7, "sde", prev_sample=x_next)
    assert max_diff(out.logprob, torch.cat([t.logprobs for t in trajs])) < 1e-5


def test_random_weights_are_built_from_the_configs_alone(tiny_sd3, tmp_path):
    """model.weights random builds every model from the configs at model.path: a copy without the weight
    files loads, the same weights on every build (every rank), none of them the checkpoint's; model.weights
    pretrained (the default) reads the checkpoint's weights, and finds none in that copy."""
    import shutil

    from diffusers import AutoencoderKL
    from transformers import T5EncoderModel

    from omnirl.models import build_adapter

    configs = tmp_path / "configs"
    shutil.copytree(tiny_sd3, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    cpu = torch.device("cpu")
    random_cfg = tiny_config("sd3", configs)
    random_cfg.model.weights = "random"
    first, second = build_adapter(random_cfg, cpu), build_adapter(random_cfg, cpu)
    pretrained = build_adapter(tiny_config("sd3", tiny_sd3), cpu)
    stock = {
        "vae": AutoencoderKL.from_pretrained(tiny_sd3, subfolder="vae"),
        "text_encoder_3": T5EncoderModel.from_pretrained(tiny_sd3, subfolder="text_encoder_3"),
    }
    for name, model in stock.items():
        want = model.state_dict()
        for adapter, same in ((pretrained, True), (first, False)):
            got = getattr(adapter, name).state_dict()
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want) == same, (name, same)
    for a, b in zip(first.transformer.state_dict().values(), second.transformer.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(OSError):  # the pretrained path reads weight files, and the copy has none
        build_adapter(tiny_config("sd3", configs), cpu)
