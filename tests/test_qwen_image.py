"""The Qwen-Image adapter on a tiny random-init Qwen-Image (real diffusers / transformers classes), against
diffusers' own QwenImagePipeline. fp32 on CPU: everything must agree to 1e-5 (docs/architecture.md).

Prompt buckets here are [16, 32, 64] text tokens, so that one batch pads prompts of different lengths
into one bucket (and its negative prompts into a smaller one) and the trainer mixes buckets."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from omnirl.config import RolloutConfig
from omnirl.config_checks import check_values
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import flow_step
from omnirl.models.qwen_image.adapter import QwenImageAdapter, QwenImageSettings, padded_lengths
from omnirl.ops.diffusion import Pair, pair_logprob
from omnirl.rollout import compiled as rollout_compiled
from omnirl.rollout.compiled import compile_forwards, swapped
from omnirl.rollout.diffusion import DiffusionEngine
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
from tests.test_train import read_jsonl, torchrun

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = [16, 32, 64]
# Text tokens with the tiny tokenizer: prompts 19, 23, 18, 11 (bucket 32 for a batch of all four, else
# 16 for the last), negatives 11, 6, 13, 5 (bucket 16).
PROMPTS = ["two dogs in the snow", "a lighthouse at night", "OPEN 24 HOURS", "a red cat"]
NEGATIVES = ["blurry", " ", "low quality", ""]
# Bucket 64 (33 and 48 tokens), negatives bucket 32 (32 and 27 tokens).
LONG_PROMPTS = [
    'A storefront sign that reads "OPEN"',
    'a neon sign that says "flow grpo" above a busy street',
]
LONG_NEGATIVES = ["blurry, low quality, watermark", "dark, noisy, overexposed"]
TRUE_CFG = 4.0
STEPS = 6
SIZE = 32  # pixels: 16x16 latents (the tiny VAE downsamples 2x), 64 image tokens
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LORA_TARGETS += ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def make_adapter(path, buckets=BUCKETS, **lora) -> QwenImageAdapter:
    cfg = tiny_config("qwen_image", path, **lora)
    cfg.family = QwenImageSettings(prompt_length_buckets=buckets)
    return QwenImageAdapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, prompts=PROMPTS, negatives=NEGATIVES, first=0) -> list[Request]:
    return prompt_requests(params, prompts, negatives, first)


def noise_free(guidance: float = TRUE_CFG) -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, guidance, 0.0, "sde", 0, (0, 1))


def sde(sde_type: str = "sde") -> SamplingParams:
    return SamplingParams(SIZE, SIZE, STEPS, TRUE_CFG, 1.2, sde_type, 2, (0, 4))


def run_pipeline(pipe, adapter, requests, output_type):
    """The reference: diffusers' pipeline from the same initial latents the adapter draws per request,
    packed 2x2 as the pipeline takes them. Returns packed latents [B, 64, 16] or images [B, 3, H, W]."""
    c, h = adapter.policy.config.in_channels // 4, SIZE // adapter.vae_scale_factor
    latents = initial_latents(requests, (c, h, h))
    return pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[r.negative_prompt for r in requests],
        true_cfg_scale=requests[0].params.guidance_scale,
        num_inference_steps=requests[0].params.num_steps,
        height=SIZE,
        width=SIZE,
        latents=QwenImagePipeline._pack_latents(latents, len(requests), c, h, h),
        output_type=output_type,
    ).images


def final_latents(trajs) -> torch.Tensor:
    """The trajectories' final latents [B, C, h, w], packed as the pipeline returns them."""
    x = torch.stack([t.final_latents for t in trajs])
    return QwenImagePipeline._pack_latents(x, *x.shape)


@pytest.fixture(scope="module")
def adapter(tiny_qwen_image):
    return make_adapter(tiny_qwen_image)  # LoRA with B = 0: the policy equals the base model


def test_buckets_key_and_tokens(adapter, tiny_qwen_image):
    """Prompt lengths are not in the compatibility key: the packer sorts requests by their bucketed tokens
    and fills full batches across buckets, and a batch pads its texts to the bucket of its longest. With
    CFG as two forwards the negative prompt's exact length is in the key (its forward runs unpadded)."""
    requests = make_requests(sde())
    assert [adapter.prompt_length(p) for p in PROMPTS] == [19, 23, 18, 11]
    assert [adapter.prompt_length(n) for n in NEGATIVES] == [11, 6, 13, 5]
    assert {adapter.compat_key(r) for r in requests} == {requests[0].params.key + (0,)}
    # Image tokens + the bucket of the longer of the prompt and (fused CFG) the negative prompt.
    assert [adapter.num_tokens(r) for r in requests] == [64 + 32, 64 + 32, 64 + 32, 64 + 16]
    # Sorted by bucketed tokens (then queue position), two rows a batch: the 11-token prompt of bucket 16
    # shares a batch with a 19-token one, both padded to 32, the negatives to their bucket 16.
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=2))
    assert engine.packer.pack(requests) == [[3, 0], [1, 2]]
    assert padded_lengths(BUCKETS, [11, 19], [5, 11], fused_cfg=True) == (32, 16)
    unfused = make_requests(dataclasses.replace(sde(), fused_cfg=False))
    negatives = [adapter.prompt_length(n) for n in NEGATIVES]
    assert [adapter.compat_key(r)[-1] for r in unfused] == negatives
    assert [adapter.num_tokens(r) for r in unfused] == [64 + 32, 64 + 32, 64 + 32, 64 + 16]
    assert padded_lengths(BUCKETS, [11, 19], [6, 6], fused_cfg=False) == (32, 6)  # negatives unpadded
    unguided = make_requests(SamplingParams(SIZE, SIZE, STEPS, 1.0, 1.2, "sde", 2, (0, 4)))
    assert adapter.compat_key(unguided[0])[-1] == 0  # no negative prompt: it must not split batches
    assert adapter.num_tokens(unguided[1]) == 64 + 32 and padded_lengths(BUCKETS, [11], [], True) == (16, 0)
    # Longer than the largest bucket: truncated to it, as the pipeline's max_sequence_length does.
    assert adapter.prompt_length("word " * 40) == BUCKETS[-1]
    cfg = tiny_config("qwen_image", tiny_qwen_image)
    for bad in ([], [32, 16], [16, 16], [0, 8], [64, 2048]):
        cfg.family.prompt_length_buckets = bad
        with pytest.raises(ConfigError, match="family.prompt_length_buckets must be"):
            check_values(cfg)


@pytest.mark.slow
def test_decode_in_chunks_equals_one_batch(adapter, monkeypatch):
    """`decode` runs the VAE on DECODE_ROWS images at a time (a 64-image batch ran out of the H200's memory
    in one decode); each image decodes on its own, so chunks give what one batch gives."""
    from omnirl.models.qwen_image import adapter as qwen_image

    c, h = adapter.policy.config.in_channels // 4, SIZE // adapter.vae_scale_factor
    latents = torch.randn(5, c, h, h, generator=torch.Generator().manual_seed(0))
    whole = qwen_image.decode(adapter.vae, latents)
    monkeypatch.setattr(qwen_image, "DECODE_ROWS", 2)
    sizes, vae_decode = [], adapter.vae.decode

    def counted(x, **kwargs):
        sizes.append(len(x))
        return vae_decode(x, **kwargs)

    monkeypatch.setattr(adapter.vae, "decode", counted)
    chunked = qwen_image.decode(adapter.vae, latents)
    assert sizes == [2, 2, 1] and chunked.shape == (5, 3, SIZE, SIZE)
    assert max_diff(chunked, whole) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("guidance", [1.0, TRUE_CFG])
def test_noise_free_rollout_is_the_pipeline_sampler(adapter, tiny_qwen_image, guidance):
    """True-CFG with its norm rescaling, prompts padded to their bucket (the pipeline pads to the longest)."""
    pipe = load_pipeline(QwenImagePipeline, tiny_qwen_image)
    requests = make_requests(noise_free(guidance))[:3]
    trajs = adapter.rollout(requests)
    ref_latents = run_pipeline(pipe, adapter, requests, "latent")
    ref_images = run_pipeline(pipe, adapter, requests, "pt")
    d_latents = max_diff(final_latents(trajs), ref_latents)
    d_images = max_diff(torch.stack([t.output.image for t in trajs]), ref_images)
    print(f"true_cfg {guidance}: pipeline vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert trajs[0].output.image.shape == (3, SIZE, SIZE)
    assert d_latents < 1e-5 and d_images < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    """Packed: 4 requests (prompts of buckets 16 and 32, all padded to 32), their cond and negative rows in
    one forward. Serial: one request at a time, its True-CFG as two batch-1 forwards (the reference's
    serial rollout)."""
    requests = make_requests(sde())
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in make_requests(dataclasses.replace(sde(), fused_cfg=False))]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    assert len({t.embeds["prompt_embeds"].shape[0] for t in packed}) == 4  # stored unpadded
    d_latents, d_logprobs = packed_serial_diffs(packed, serial)
    print(f"packed vs serial: window starts {starts}, latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_recomputed_logprob_equals_rollout(adapter, sde_type):
    """The trainer's micro-batch mixes two rollouts of different prompt buckets: every (sample, trained
    step) pair in one forward, texts re-padded to the longest of the micro-batch by batch_embeds."""
    params = sde(sde_type)
    short = make_requests(params)[:3]
    long = make_requests(params, LONG_PROMPTS, LONG_NEGATIVES, first=3)
    lengths = [(adapter.prompt_length(r.prompt), adapter.prompt_length(r.negative_prompt)) for r in long]
    assert padded_lengths(BUCKETS, *map(list, zip(*lengths)), fused_cfg=True) == (64, 32)
    trajs = adapter.rollout(short) + adapter.rollout(long)
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    recorded = torch.stack([p.traj.logprobs[p.k] for p in pairs])
    with torch.no_grad():
        trainer_lp = pair_logprob(adapter, pairs, params).logprob
    d_trainer = (trainer_lp - recorded).abs()
    print(f"{sde_type} trainer vs rollout log-prob: mean {d_trainer.mean():.2e}, max {d_trainer.max():.2e}")
    assert d_trainer.max() < 1e-5

    # The two CFG layouts give the same log-probs; unmasked padding gives others, by far more than 1e-5.
    steps = torch.stack([p.traj.step_indices[p.k] for p in pairs])
    sigmas = trajs[0].sigmas
    x = torch.stack([p.traj.latents[p.k] for p in pairs])
    x_next = torch.stack([p.traj.next_latents[p.k] for p in pairs])
    embeds = adapter.batch_embeds([p.traj.embeds for p in pairs])
    assert embeds["prompt_embeds"].shape[1] == 48 and embeds["negative_prompt_embeds"].shape[1] == 32
    unmasked = {k: torch.ones_like(e) if k.endswith("_mask") else e for k, e in embeds.items()}
    diffs = {}
    for name, emb, fused in (("two CFG forwards", embeds, False), ("unmasked padding", unmasked, True)):
        with torch.no_grad():
            v = adapter.velocity(x, sigmas[steps], emb, TRUE_CFG, fused_cfg=fused)
        out = flow_step(
            v, x, sigmas[steps], sigmas[steps + 1], float(sigmas[1]), 1.2, sde_type, prev_sample=x_next
        )
        diffs[name] = max_diff(out.logprob, recorded)
        print(f"{sde_type} {name} vs rollout log-prob: max {diffs[name]:.2e}")
    assert diffs["two CFG forwards"] < 1e-5
    assert diffs["unmasked padding"] > 1e-4


@pytest.mark.slow
def test_compiled_update_meets_one_text_length_per_bucket(adapter, monkeypatch):
    """train.compile pads a micro-batch's texts to their bucket, as the rollout pads its batches: two
    micro-batches whose longest prompts differ (23 and 18 tokens, both bucket 32) meet one compiled shape
    and give the log-probs of the unbucketed padding (masked, so the same math). Unbucketed, the second
    compiles again. The 'eager' backend: dynamo decides recompiles from its guards before a backend runs."""
    monkeypatch.setattr(rollout_compiled, "COMPILE_BACKEND", "eager")
    params = sde()
    trajs = adapter.rollout(make_requests(params)[:3])  # prompts 19, 23, 18; negatives 11, 6, 13 tokens
    first = [Pair(trajs[0], 0, 1.0), Pair(trajs[1], 0, 1.0)]
    second = [Pair(trajs[2], 0, 1.0), Pair(trajs[2], 1, 1.0)]
    for mb, longest in ((first, 23), (second, 18)):
        texts = [p.traj.embeds for p in mb]
        assert adapter.batch_embeds(texts)["prompt_embeds"].shape[1] == longest
        assert adapter.batch_embeds(texts, bucketed=True)["prompt_embeds"].shape[1] == 32
        assert adapter.batch_embeds(texts, bucketed=True)["negative_prompt_embeds"].shape[1] == 16
    compiled = compile_forwards(adapter.fsdp_units())
    counters = torch._dynamo.utils.counters

    def logprobs(bucketed: bool, recompile_is_error: bool) -> tuple[list[torch.Tensor], int]:
        torch._dynamo.reset()
        out = []
        with torch.no_grad(), swapped(compiled):
            out.append(pair_logprob(adapter, first, params, bucketed=bucketed).logprob)
            start = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=recompile_is_error):
                out.append(pair_logprob(adapter, second, params, bucketed=bucketed).logprob)
        return out, counters["stats"]["unique_graphs"] - start

    bucketed, new_graphs = logprobs(bucketed=True, recompile_is_error=True)
    assert new_graphs == 0
    plain, new_graphs = logprobs(bucketed=False, recompile_is_error=False)
    assert new_graphs > 0, "the unbucketed second micro-batch should compile again"
    for a, b, mb in zip(bucketed, plain, (first, second)):
        recorded = torch.stack([p.traj.logprobs[p.k] for p in mb])
        assert max_diff(a, b) < 1e-5 and max_diff(a, recorded) < 1e-5


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_qwen_image, tmp_path):
    # alpha != rank: the export must carry the scale; the reference recipe's targets, MLPs included.
    adapter = make_adapter(tiny_qwen_image, rank=4, alpha=8.0, target_modules=LORA_TARGETS)
    perturb_lora(adapter, 0.05)
    export_lora_twice(adapter, tmp_path)  # also from the state dict, as an FSDP run: the same file

    pipe = load_pipeline(QwenImagePipeline, tiny_qwen_image)
    requests = make_requests(noise_free())[:2]

    def rollout():
        trajs = adapter.rollout(requests)
        return final_latents(trajs), torch.stack([t.output.image for t in trajs])

    check_lora_in_pipeline(
        pipe,
        tmp_path,
        lambda: [run_pipeline(pipe, adapter, requests, kind) for kind in ("latent", "pt")],
        rollout,
    )


def test_bad_paths(tmp_path):
    assert get_adapter("qwen_image") is QwenImageAdapter
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        make_adapter(missing)
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    with pytest.raises(ValueError, match="holds a StableDiffusion3Pipeline, not a QwenImagePipeline"):
        make_adapter(tmp_path)


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_fsdp(tiny_qwen_image, tmp_path):
    out = tmp_path / "run"
    r = torchrun(
        2,
        ROOT / "yaml/qwen_image_tiny_flowgrpo.yaml",
        "--model.path",
        str(tiny_qwen_image),
        "--run.output_dir",
        str(out),
        "--run.steps",
        "2",
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["train/updates"] == 1 and m["train/grad_norm"] > 0 for m in metrics), metrics
    lora = load_file(out / "lora/pytorch_lora_weights.safetensors")
    # 12 target modules x 2 blocks, A and B each; B starts at 0, so a non-zero B is a real update.
    assert len(lora) == 12 * 2 * 2
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)
    pipe = load_pipeline(QwenImagePipeline, tiny_qwen_image)
    pipe.load_lora_weights(out / "lora")
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_tiny_dppo_recipe_under_torchrun_fsdp(tiny_qwen_image, tmp_path):
    """qwen_image_tiny_flowdppo for 2 steps on 2 ranks: two passes per rollout, the rollout's recorded step
    means as mu_old (no old-policy pass), the divergence and mask logged, and the per-timestep
    trainer-vs-rollout gap of the trained window steps."""
    out = tmp_path / "run"
    r = torchrun(
        2, ROOT / "yaml/qwen_image_tiny_flowdppo.yaml", "--model.path", str(tiny_qwen_image),
        "--run.output_dir", str(out), "--run.steps", "2", "--log.image_every", "0",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["train/updates"] == 2 and m["train/grad_norm"] > 0
        assert m["dppo/kl_new_old_max"] >= m["dppo/kl_new_old"] > 0  # the second pass moved the means
        assert 0 <= m["dppo/mask_frac"] <= 1 and m["consistency/logprob_abs_diff_max"] < 1e-4
        steps = {k.split("/")[1] for k in m if k.startswith("consistency/t")}
        assert steps and steps <= {f"t{t:02d}" for t in range(5)}  # a window of 2 inside [0, 5)
    assert "Traceback" not in r.stderr
