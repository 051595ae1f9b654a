"""Rewards run for real: JPEG sizes through Pillow, OCR through rapidocr's packaged models."""

import threading

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from omnirl.errors import ConfigError, DataError
from omnirl.models.base import MODALITIES, Output
from omnirl.rewards import LOCAL_CHECKPOINTS, REWARDS, check_modalities, get_reward, reward_inputs, to_pil
from omnirl.rewards.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_kb
from omnirl.rewards.ocr import OcrReward, ocr_score, target_text
from omnirl.rewards.pool import RewardError, RewardPool


def flat_and_noise():
    flat = Image.new("RGB", (256, 256), (120, 140, 160))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    return [flat, noise]


def outputs(images: list[Image.Image]) -> list[Output]:
    """PIL images as the image outputs a rollout hands the pool (8-bit values, so to_pil gives them back)."""
    return [Output(image=torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255) for im in images]


def render(text):
    img = Image.new("RGB", (512, 128), "white")
    ImageDraw.Draw(img).text((16, 32), text, fill="black", font=ImageFont.load_default(size=48))
    return img


def test_registry_resolves_every_name_and_rejects_unknown():
    for name in REWARDS:
        if name not in LOCAL_CHECKPOINTS:  # those are built with their checkpoint, in their own tests
            assert callable(get_reward(name)())
        modality = get_reward(name).modality  # None: reads no output; a tuple: reads several
        read = modality if isinstance(modality, tuple) else [modality]
        assert all(m in (*MODALITIES, None) for m in read), name
    with pytest.raises(ValueError, match="unknown reward 'clip'; known: .*jpeg_compressibility"):
        get_reward("clip")


def test_reward_of_a_modality_the_model_lacks_is_refused():
    check_modalities({"ocr": 1.0, "jpeg_compressibility": 1.0}, frozenset({"image"}), "sd3")
    with pytest.raises(
        ConfigError, match="reward 'mmk12' reads text outputs, but model.adapter 'sd3' produces image"
    ):
        check_modalities({"jpeg_compressibility": 1.0, "mmk12": 1.0}, frozenset({"image"}), "sd3")
    with pytest.raises(ConfigError, match="reward 'ocr' reads image .* 'qwen_vl' produces text"):
        check_modalities({"ocr": 1.0}, frozenset({"text"}), "qwen_vl")


def test_reward_inputs_per_modality():
    images = flat_and_noise()
    converted = reward_inputs(outputs(images), "image")
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(converted, images))
    video, audio = torch.rand(3, 3, 8, 8), torch.rand(2, 100) * 2 - 1
    both = Output(video=video, fps=8.0, audio=audio, sample_rate=16000)
    assert both.modalities == {"video", "audio"}
    [(v, fps)], [(a, rate)] = reward_inputs([both], "video"), reward_inputs([both], "audio")
    assert v is video and fps == 8.0 and a is audio and rate == 16000
    assert reward_inputs([Output(text="4")], "text") == ["4"]
    with pytest.raises(ValueError, match="sample 0 has no image output"):
        reward_inputs([both], "image")
    assert np.array_equal(np.asarray(to_pil(torch.zeros(3, 2, 2))), np.zeros((2, 2, 3), np.uint8))


def test_jpeg_flat_image_is_more_compressible_than_noise():
    images = flat_and_noise()
    comp = JpegCompressibility()(images, ["a", "b"], [{}, {}])
    incomp = JpegIncompressibility()(images, ["a", "b"], [{}, {}])
    assert comp[0] > comp[1]
    assert incomp == [-c for c in comp]
    assert comp[1] < -50  # 256x256 RGB noise: ~77 kB at quality 95 (4:2:0 chroma subsampling); raw is 197 kB
    assert jpeg_kb(images[0]) < 5


def test_ocr_target_and_score_normalisation():
    assert target_text('A sign that reads "Hello  World"', {}) == "helloworld"
    assert target_text("A cup with “Good\tMorning” and “Tea”", {}) == "goodmorningtea"
    assert target_text('a sign "ignored"', {"text": "Use Me"}) == "useme"
    assert ocr_score("thesignsaysopen24hours", "open") == 1.0  # contained
    assert ocr_score("helloword", "helloworld") == pytest.approx(0.9)  # one deletion in 10
    assert ocr_score("completely different text", "abc") == 0.0  # distance clamped to len(target)


def test_ocr_missing_quoted_text_names_the_row():
    reward = OcrReward()
    with pytest.raises(DataError, match="ocr.jsonl:7: .*quotes"):
        reward([render("x")], ["a sign with no quotes"], [{"source": "ocr.jsonl:7"}])
    with pytest.raises(DataError, match="'a sign with no quotes'"):
        reward([render("x")], ["a sign with no quotes"], [{}])
    assert reward._engine is None  # the row was rejected before any OCR ran


@pytest.mark.slow
def test_ocr_reward_with_rapidocr():
    images = [render("Hello World"), render("OPEN 24 HOURS"), Image.new("RGB", (512, 128), "white")]
    prompts = ['A sign that reads "hello WORLD"', 'A sign that reads "OPEN 25 HOURS"', 'A sign "Hello"']
    scores = OcrReward()(images, prompts, [{}, {}, {}])
    # "open25hours" vs the recognised "open24hours": one substitution in 11 characters.
    assert scores == [1.0, pytest.approx(1 - 1 / 11), 0.0]


class PromptLength:
    modality = "image"

    def __call__(self, images, prompts, metadata):
        return [float(len(p)) for p in prompts]


class Broken:
    modality = "image"

    def __init__(self, out=None, exc=None, wait=None):
        self.out, self.exc, self.wait = out, exc, wait

    def __call__(self, images, prompts, metadata):
        if self.wait is not None:
            self.wait.wait(10)
        if self.exc is not None:
            raise self.exc
        return self.out


def test_pool_weighted_sum_equals_hand_sum():
    images, prompts, meta = flat_and_noise(), ["a cat", "a red dog"], [{}, {}]
    kb = np.array([jpeg_kb(im) for im in images])
    pool = RewardPool(
        {"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5}, num_workers=2, timeout_s=60
    )
    res = pool.score(outputs(images), prompts, meta)
    np.testing.assert_allclose(res.per_reward["jpeg_compressibility"], -kb)
    np.testing.assert_allclose(res.total, 2.0 * -kb + 0.5 * kb)
    pool.close()

    pool = RewardPool.from_instances(
        {"jpeg": (JpegIncompressibility(), 1.0), "len": (PromptLength(), -0.1)}, num_workers=2, timeout_s=60
    )
    futures = [pool.submit(outputs(images), prompts, meta) for _ in range(3)]  # several batches in flight
    for fut in futures:
        res = pool.result(fut)
        assert res.total.dtype == np.float64
        np.testing.assert_allclose(res.total, kb - 0.1 * np.array([5.0, 9.0]))
    pool.close()


def test_pool_unknown_reward_fails_at_construction():
    with pytest.raises(ValueError, match="unknown reward 'aesthetic'"):
        RewardPool({"jpeg_compressibility": 1.0, "aesthetic": 1.0}, num_workers=1, timeout_s=60)


@pytest.mark.parametrize(
    "reward, words",
    [
        (Broken(exc=RuntimeError("model exploded")), "'bad' raised .*model exploded"),
        (Broken(out=[1.0, float("nan")]), "'bad' returned 1 non-finite .*'a red dog'"),
        (Broken(out=[1.0, float("inf")]), "'bad' returned 1 non-finite"),
        (Broken(out=[1.0]), r"'bad' returned shape \(1,\) for a batch of 2"),
        (Broken(out=None), "'bad' returned NoneType, expected a list of 2 floats"),
    ],
)
def test_pool_bad_scorer_is_a_loud_error(reward, words):
    pool = RewardPool.from_instances({"ok": (PromptLength(), 1.0), "bad": (reward, 1.0)}, 1, timeout_s=60)
    with pytest.raises(RewardError, match=words):
        pool.score(outputs(flat_and_noise()), ["a cat", "a red dog"], [{}, {}])
    pool.close()


def test_pool_timeout_names_the_reward():
    release = threading.Event()
    pool = RewardPool.from_instances({"slow": (Broken(out=[0.0], wait=release), 1.0)}, 1, timeout_s=0.2)
    try:
        first = pool.submit(outputs(flat_and_noise()[:1]), ["a cat"], [{}])
        second = pool.submit(outputs(flat_and_noise()[:1]), ["a dog"], [{}])
        # Waiting on the second batch, queued behind the hung first one, still reports the hang.
        with pytest.raises(RewardError, match="'slow' took longer than timeout_s=0.2"):
            pool.result(second)
        with pytest.raises(RewardError, match="'slow' took longer than timeout_s=0.2"):
            pool.result(first)
        assert not first.done()
    finally:
        release.set()  # let the abandoned worker thread finish
        pool.close()


def test_uniform_noise_draws_per_rank_and_reads_any_output(monkeypatch):
    """`uniform_noise` (the measuring runs' spread): it reads no output, so it fits any model (images or
    texts alike); one draw in [0, 1) per sample, the same draws for the same rank and others for another."""
    from omnirl.rewards.noise import UniformNoise

    assert get_reward("uniform_noise") is UniformNoise and UniformNoise.modality is None
    check_modalities(["uniform_noise"], frozenset({"text"}), "qwen3_omni_thinker")
    images = [Output(image=torch.rand(3, 8, 8)) for _ in range(2)]
    texts = [Output(text="a response"), Output(text="another")]
    assert reward_inputs(images, UniformNoise.modality) == images
    monkeypatch.setenv("RANK", "0")
    first = UniformNoise()(images, ["a", "b"], [{}, {}])
    assert len(first) == 2 and all(0.0 <= x < 1.0 for x in first) and first[0] != first[1]
    assert UniformNoise()(texts, ["a", "b"], [{}, {}]) == first
    monkeypatch.setenv("RANK", "1")
    assert UniformNoise()(images, ["a", "b"], [{}, {}]) != first


@pytest.mark.parametrize(
    "name, package, extra",
    [("ocr", "rapidocr", "ocr"), ("text_edit", "onnxruntime", "ocr"), ("mmk12", "math_verify", "math")],
)
def test_reward_without_its_extra_names_the_extra(name, package, extra, monkeypatch):
    """A reward whose package is not installed fails when it is built (before the model loads), naming the
    pip extra that brings it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else find_spec(n, *a))
    with pytest.raises(ConfigError, match=rf"pip install 'omnirl\[{extra}\]'"):
        get_reward(name)()


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import sys

    from omnirl.data.mmk12 import load_mmk12

    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(
        DataError, match=r"train\.parquet: reading parquet needs pyarrow: pip install 'omnirl\[math\]'"
    ):
        load_mmk12(tmp_path / "train.parquet")


def test_video_rewards_on_known_videos():
    from omnirl.rewards.video import VideoBrightness, VideoTemporalSmoothness

    dark, bright = torch.full((5, 3, 8, 8), 0.2), torch.full((5, 3, 8, 8), 0.8)
    flicker = torch.stack([torch.full((3, 8, 8), float(i % 2)) for i in range(5)])  # [5, 3, 8, 8]
    videos = reward_inputs([Output(video=v, fps=16.0) for v in (dark, bright, flicker)], "video")
    assert VideoBrightness()(videos, [""] * 3, [{}] * 3) == pytest.approx([0.2, 0.8, 0.4])
    assert VideoTemporalSmoothness()(videos, [""] * 3, [{}] * 3) == pytest.approx([0.0, 0.0, -100.0])
    assert get_reward("video_brightness").modality == "video"


def test_clip_video_reward_averages_frames(tmp_path):
    """A tiny random CLIP of the real classes, saved and loaded from its local path: the score is the mean
    over frames of the per-frame cosine similarity, computed here frame by frame."""
    from omnirl.rewards.clip_video import ClipVideoAlignment
    from omnirl.testing.rewards import make_tiny_pickscore

    make_tiny_pickscore(tmp_path)  # a tiny random CLIPModel + CLIPProcessor, as a CLIP checkpoint is laid out
    with pytest.raises(ConfigError, match="reward.paths.clip_video"):
        ClipVideoAlignment()
    reward = ClipVideoAlignment(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    videos = [torch.rand(3, 3, 48, 40, generator=g), torch.rand(2, 3, 48, 40, generator=g)]
    prompts = ["a red cat", "waves at night"]
    scores = reward(reward_inputs([Output(video=v, fps=8.0) for v in videos], "video"), prompts, [{}, {}])
    for video, prompt, score in zip(videos, prompts, scores):
        per_frame = [reward([(frame[None], 8.0)], [prompt], [{}])[0] for frame in video]
        assert score == pytest.approx(sum(per_frame) / len(per_frame), abs=1e-5)
        assert -1 <= score <= 1
    assert len(set(scores)) == 2
    pool = RewardPool({"clip_video": 1.0}, 1, 60, paths={"clip_video": str(tmp_path)})
    pool.close()
    with pytest.raises(ConfigError, match="'hpsv3', which reward.weights does not use"):
        RewardPool({"clip_video": 1.0}, 1, 60, paths={"clip_video": str(tmp_path), "hpsv3": "x"})


def make_tiny_hpsv3(out_dir):
    """A tiny HPSv3 in the published layout: a tiny Qwen2-VL checkpoint (real classes, tokenizer with chat
    template, image processor) with HPSv3.safetensors (the model grown by <|Reward|> + rm_head.*) beside."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from omnirl.models.qwen3_omni_thinker.tiny import (
        _qwen_omni_tokenizer,
        _save_qwen_processor_parts,
        _tiny_qwen_text_config,
    )
    from omnirl.rewards.hpsv3 import REWARD_TOKEN, reward_head

    tok = _qwen_omni_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in tok.all_special_tokens}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(
            text_config=_tiny_qwen_text_config(tok),
            vision_config=vision,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )
    model.eval().save_pretrained(out_dir)
    _save_qwen_processor_parts(out_dir, tok, Qwen2VLImageProcessorPil(patch_size=14, merge_size=2))
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # HPSv3's weights differ from the base model's
    head = reward_head(64)
    state = {**model.state_dict(), **{f"rm_head.{k}": v for k, v in head.state_dict().items()}}
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / "HPSv3.safetensors")
    return model, head, tok


@pytest.mark.slow
def test_hpsv3_scores_frames_and_averages_them(tmp_path, monkeypatch):
    import omnirl.rewards.hpsv3 as H

    model, head, tok = make_tiny_hpsv3(tmp_path)
    monkeypatch.setattr(H, "PIXELS", 56 * 56)  # 4 merged image tokens a frame instead of 256
    with pytest.raises(ConfigError, match="reward.paths.hpsv3"):
        H.HPSv3Reward(str(tmp_path / "missing"))
    reward = H.HPSv3Reward(str(tmp_path))
    assert torch.equal(reward.vlm.lm_head.weight, model.lm_head.weight)  # HPSv3's weights, not the base's
    g = torch.Generator().manual_seed(0)
    videos = [torch.rand(3, 3, 56, 56, generator=g), torch.rand(2, 3, 56, 56, generator=g)]
    prompts = ["a red cat", "waves at night under the moon"]
    scores = reward(reward_inputs([Output(video=v, fps=8.0) for v in videos], "video"), prompts, [{}, {}])
    # Each frame alone through the model's own forward (with the reward token's hidden state): the same.
    for video, prompt, score in zip(videos, prompts, scores):
        alone = [float(reward.score_images([to_pil(f)], [prompt])[0]) for f in video]
        assert score == pytest.approx(sum(alone) / len(alone), abs=1e-4)
    assert len(set(scores)) == 2 and all(np.isfinite(scores))
