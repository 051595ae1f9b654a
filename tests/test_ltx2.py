"""The LTX-2 adapter (text to video + audio) on the tiny random-init LTX-2.3 checkpoint, against diffusers'
own LTX2Pipeline. fp32 on CPU: everything must agree to 1e-5 (docs/architecture.md, invariants)."""

import pytest
import torch
from diffusers import LTX2Pipeline

from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import flow_step
from omnirl.models.ltx2.adapter import LTX2Adapter
from omnirl.models.ltx2.tiny import MAX_SEQUENCE_LENGTH
from tests.support_compare import (
    compiled_rollout_diffs,
    export_lora_twice,
    initial_latents,
    load_pipeline,
    max_diff,
    perturb_lora,
    prompt_requests,
    tiny_config,
)

PROMPTS = ["a red cat", "two dogs in the snow", "a lighthouse at night", "waves"]
NEGATIVES = ["blurry", "", "low quality", ""]
GUIDANCE = 3.0
STEPS = 4
HEIGHT, WIDTH, FRAMES, FPS = 64, 64, 9, 24.0  # 8 video tokens (2 x 2 x 2) and 9 audio tokens


def make_adapter(path, **settings) -> LTX2Adapter:
    lora = {k: settings.pop(k) for k in ("rank", "alpha") if k in settings}
    cfg = tiny_config("ltx2", path, **lora)
    cfg.family.num_frames = FRAMES
    cfg.family.frame_rate = FPS
    for key, value in settings.items():
        setattr(cfg.family, key, value)
    return LTX2Adapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n])


def noise_free(guidance: float = GUIDANCE) -> SamplingParams:
    return SamplingParams(HEIGHT, WIDTH, STEPS, guidance, 0.0, "cps", 0, (0, 1))


def run_pipeline(pipe, adapter: LTX2Adapter, requests, output_type):
    """The reference: LTX2Pipeline from the initial latents the adapter draws per request (split into its
    packed video and audio latents), with the adapter's guidance settings and no STG or modality
    guidance. Returns (video, audio)."""
    s, grid = adapter.settings, adapter.grid(HEIGHT, WIDTH)
    video, audio = adapter.split(initial_latents(requests, adapter.latent_shape(HEIGHT, WIDTH)), grid)
    a = adapter.audio_vae
    # The pipeline normalises given audio latents: hand it the noise denormalised.
    audio = audio * a.latents_std + a.latents_mean
    out = pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[r.negative_prompt for r in requests],
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        frame_rate=FPS,
        num_inference_steps=requests[0].params.num_steps,
        guidance_scale=requests[0].params.guidance_scale,
        audio_guidance_scale=adapter.audio_scale(requests[0].params.guidance_scale),
        guidance_rescale=s.guidance_rescale,
        audio_guidance_rescale=s.audio_guidance_rescale,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        latents=video,
        audio_latents=audio,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        output_type=output_type,
    )
    return out.frames, out.audio


@pytest.fixture(scope="module")
def adapter(tiny_ltx2):
    return make_adapter(tiny_ltx2)


@pytest.mark.slow
@pytest.mark.parametrize("guidance", ["x0", "stock"])
def test_noise_free_rollout_is_the_pipeline(guidance, tiny_ltx2):
    """Video and audio equal LTX2Pipeline's from the same latents: the reference's one scale in x0 space,
    and the pipeline's own separate video / audio scales with rescale."""
    settings = {} if guidance == "x0" else dict(audio_guidance_scale=5.0, guidance_rescale=0.7,
                                                audio_guidance_rescale=0.5)  # fmt: skip
    adapter = make_adapter(tiny_ltx2, **settings)
    pipe = load_pipeline(LTX2Pipeline, tiny_ltx2)
    requests = make_requests(noise_free(), n=2)
    trajs = adapter.rollout(requests)
    ref_video, ref_audio = run_pipeline(pipe, adapter, requests, "pt")
    video = torch.stack([t.output.video for t in trajs])
    audio = torch.stack([t.output.audio for t in trajs])
    d_video, d_audio = max_diff(video, ref_video), max_diff(audio, ref_audio)
    print(f"{guidance}: pipeline vs rollout: video {d_video:.2e}, audio {d_audio:.2e}")
    assert video.shape == (2, FRAMES, 3, HEIGHT, WIDTH) and audio.shape[:2] == (2, 2)
    assert trajs[0].output.fps == FPS and trajs[0].output.sample_rate == 16000
    assert audio.abs().max() > 1e-3 and video.std() > 1e-3  # real outputs, not blanks
    assert d_video < 1e-5 and d_audio < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial_and_recomputed_logprobs_per_stream(adapter):
    """3 trained steps drawn per request from the first 4, not contiguous (the reference's subset); packed
    equals serial; the trainer's recomputation (`pair_logprob`) equals the rollout per stream, and the
    log-prob is the pooled sum of the streams' with the stated weights."""
    from omnirl.ops.diffusion import Pair, pair_logprob

    params = SamplingParams(
        HEIGHT, WIDTH, STEPS + 2, GUIDANCE, 0.8, "cps", 3, (0, 5), sde_window_schedule="subset"
    )
    requests = make_requests(params)
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    subsets = [t.step_indices.tolist() for t in packed]
    assert len({tuple(s) for s in subsets}) > 1 and any(s[-1] - s[0] > 2 for s in subsets), subsets
    for a, b in zip(packed, serial):
        assert a.step_indices.tolist() == b.step_indices.tolist()
        assert a.stream_logprobs is not None and a.stream_logprobs.shape == (3, 2)
        assert torch.all(a.stream_logprobs != 0)
        assert max_diff(a.final_latents, b.final_latents) < 1e-5 and max_diff(a.logprobs, b.logprobs) < 1e-5
        assert max_diff(a.stream_logprobs, b.stream_logprobs) < 1e-5
        assert max_diff(a.output.audio, b.output.audio) < 1e-5
    # 'joint' pooling: one mean over both streams' elements, i.e. each stream's mean by its share.
    n_video, n_audio = adapter.stream_sizes(adapter.grid(HEIGHT, WIDTH))
    t = packed[0]
    pooled = (n_video * t.stream_logprobs[:, 0] + n_audio * t.stream_logprobs[:, 1]) / (n_video + n_audio)
    assert max_diff(pooled, t.logprobs) < 1e-6
    pairs = [Pair(t, k, 1.0) for t in packed for k in range(3)]
    with torch.no_grad():
        for fused in (True, False):
            out = pair_logprob(adapter, pairs, params.__class__(**{**params.__dict__, "fused_cfg": fused}))
            assert out.streams is not None
            recorded = torch.stack([p.traj.stream_logprobs[p.k] for p in pairs])
            diff = max_diff(out.streams, recorded)
            print(f"recomputed vs rollout per-stream log-prob (fused_cfg={fused}): max {diff:.2e}")
            assert diff < 1e-5
            assert max_diff(out.logprob, torch.stack([p.traj.logprobs[p.k] for p in pairs])) < 1e-5


@pytest.mark.slow
def test_compiled_rollout_equals_eager_without_recompiling(adapter, monkeypatch):
    """`generation.compile`: the audio-video blocks trace whole (fullgraph), once for the batch's shape,
    and the compiled rollout is the eager one."""
    params = SamplingParams(HEIGHT, WIDTH, STEPS, GUIDANCE, 0.8, "cps", 2, (0, 3))
    graphs, d_latents, d_logprobs = compiled_rollout_diffs(
        adapter, lambda: make_requests(params, 3), 4, monkeypatch
    )
    print(f"compiled ({graphs} graphs) vs eager: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert graphs > 0 and d_latents < 1e-5 and d_logprobs < 1e-5


def test_equal_pooling_weights_each_stream_by_half(adapter):
    adapter.settings.logprob_pooling = "equal"
    try:
        pool = adapter.logprob_pool(noise_free())
    finally:
        adapter.settings.logprob_pooling = "joint"
    assert pool.names == ("video", "audio") and pool.weights == (0.5, 0.5)
    x = torch.randn(2, sum(pool.sizes))
    v, noise = torch.randn_like(x), torch.randn_like(x)
    s, s_next = torch.full((2,), 0.9), torch.full((2,), 0.8)
    out = flow_step(v, x, s, s_next, 0.95, 0.8, "cps", noise=noise, pool=pool)
    whole = flow_step(v, x, s, s_next, 0.95, 0.8, "cps", prev_sample=out.prev_sample)
    n_video = pool.sizes[0]
    by_hand = [
        -((out.prev_sample - out.mean)[:, sl] ** 2).mean(1)
        for sl in (slice(0, n_video), slice(n_video, None))
    ]
    assert max_diff(out.streams, torch.stack(by_hand, 1)) < 1e-6
    assert max_diff(out.logprob, 0.5 * (by_hand[0] + by_hand[1])) < 1e-6
    assert max_diff(out.logprob, whole.logprob) > 1e-4  # not the plain mean


def test_registered_latent_layout_and_bad_frames(adapter, tiny_ltx2):
    assert get_adapter("ltx2") is LTX2Adapter
    assert adapter.modalities == frozenset({"video", "audio"})
    grid = adapter.grid(HEIGHT, WIDTH)
    assert (grid.frames, grid.height, grid.width, grid.audio_frames) == (2, 2, 2, 9)
    req = make_requests(noise_free(), 1)[0]
    assert adapter.num_tokens(req) == 8 + 9
    assert FRAMES in adapter.compat_key(req) and FPS in adapter.compat_key(req)
    assert adapter.latent_shape(HEIGHT, WIDTH) == (8 * 8 + 9 * 8,)
    with pytest.raises(ConfigError, match="num_frames - 1 must divide by 8"):
        make_adapter(tiny_ltx2, num_frames=12)


@pytest.mark.slow
def test_exported_lora_loads_into_the_pipeline(tiny_ltx2, tmp_path):
    adapter = make_adapter(tiny_ltx2, rank=4, alpha=8.0)  # alpha != rank: the scale must travel
    perturb_lora(adapter, 0.1)
    export_lora_twice(adapter, tmp_path)
    pipe = load_pipeline(LTX2Pipeline, tiny_ltx2)
    requests = make_requests(noise_free(), n=2)
    base_video, base_audio = run_pipeline(pipe, adapter, requests, "pt")
    pipe.load_lora_weights(tmp_path)
    ref_video, ref_audio = run_pipeline(pipe, adapter, requests, "pt")
    trajs = adapter.rollout(requests)
    video = torch.stack([t.output.video for t in trajs])
    audio = torch.stack([t.output.audio for t in trajs])
    change = max(max_diff(ref_video, base_video), max_diff(ref_audio, base_audio))
    d_video, d_audio = max_diff(video, ref_video), max_diff(audio, ref_audio)
    print(f"LoRA changes the pipeline by {change:.2e}; vs rollout: video {d_video:.2e}, audio {d_audio:.2e}")
    assert change > 1e-3 and d_video < 1e-5 and d_audio < 1e-5


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_learns_and_writes_mp4_with_audio(tiny_ltx2, tmp_path):
    """The tiny recipe on 2 ranks (FSDP): the audio's loudness rises (from -65.1 dBFS at step 0 by about
    3 dB in 8 steps, benchmarks/results/tiny_recipes_cpu.md), each stream's log-prob is logged apart, and
    the samples are mp4 files with the video's own audio track."""
    import av

    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    recipe = ROOT / "yaml/ltx23_tiny_t2av_flowgrpo.yaml"
    steps = ["--run.steps", "8", "--log.image_every", "7"]
    r = torchrun(2, recipe, "--model.path", str(tiny_ltx2), "--run.output_dir", str(out), *steps)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(8)) and all(m["train/updates"] == 1 for m in metrics)
    loudness = [m["reward/audio_loudness"] for m in metrics]
    rise = sum(loudness[-3:]) / 3 - sum(loudness[:2]) / 2
    print(f"audio loudness per step: {[round(x, 2) for x in loudness]}; rise {rise:.2f} dB")
    assert rise > 1.0, loudness
    for m in metrics:  # each stream's mean log-prob of the trained steps (CPS: negative)
        assert m["loss/logprob_video"] < 0 and m["loss/logprob_audio"] < 0
    assert (out / "lora/pytorch_lora_weights.safetensors").is_file()
    with av.open(str(out / "samples/step_000007_0.mp4")) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.frames == FRAMES and video.average_rate == FPS
        assert audio.codec_context.name == "aac" and audio.rate == 16000 and audio.codec_context.channels == 2
    assert "Traceback" not in r.stderr
