"""Audio and audio-video rewards: the loudness reward on tracks whose level is known."""

import math
import re

import pytest
import torch
import yaml

from omnirl.errors import ConfigError
from omnirl.models.base import Output
from omnirl.rewards import check_modalities, get_reward, reward_inputs


def sine(amplitude: float, rate: int = 16000, seconds: float = 1.0, hz: float = 440.0) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return amplitude * torch.sin(2 * math.pi * hz * t)


def test_audio_loudness_on_known_tracks():
    """The RMS level in dBFS of the mono mix without its DC offset: a full-scale sine is -3.01 dB (RMS
    1/sqrt 2), a tenth of it 20 dB less, also on top of a DC offset of 0.3; silence, a constant and a stereo
    track whose channels cancel are the -100 dB floor."""
    from omnirl.rewards.audio import AudioLoudness

    loud, quiet = sine(1.0)[None], sine(0.1).repeat(2, 1)  # [1, T], [2, T]
    cancelling = torch.stack([sine(0.5), -sine(0.5)])  # [2, T]: mono mix is silence
    tracks = [loud, quiet, quiet + 0.3, torch.zeros(1, 800), torch.full((2, 800), 0.4), cancelling]
    inputs = reward_inputs([Output(audio=a.float(), sample_rate=16000) for a in tracks], "audio")
    scores = AudioLoudness()(inputs, [""] * 6, [{}] * 6)
    sine_db = -10 * math.log10(2)
    assert scores == pytest.approx([sine_db, sine_db - 20, sine_db - 20, -100.0, -100.0, -100.0], abs=1e-4)
    assert get_reward("audio_loudness") is AudioLoudness
    check_modalities(["audio_loudness"], frozenset({"video", "audio"}), "ltx2")
    with pytest.raises(ValueError, match="no samples"):
        AudioLoudness()([(torch.zeros(2, 0), 16000)], [""], [{}])


def test_clap_is_the_cosine_of_the_model_embeddings(tmp_path):
    """A tiny random CLAP of the real classes (its feature extractor at 16 kHz), loaded from its local path:
    a stereo 24 kHz track is scored as the cosine of ClapModel's own audio and text embeddings of its mono
    mix resampled to 16 kHz (scipy's resample_poly by 2/3, here), a mono 16 kHz track as it is."""
    from scipy.signal import resample_poly
    from transformers import ClapModel, ClapProcessor

    from omnirl.rewards.clap import ClapAlignment
    from omnirl.testing.rewards import make_tiny_clap

    make_tiny_clap(tmp_path)
    with pytest.raises(ConfigError, match="reward.paths.clap"):
        ClapAlignment()
    reward = ClapAlignment(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    stereo = torch.stack([sine(0.5, 24000, 0.75), sine(0.3, 24000, 0.75, hz=1000)]).float()  # [2, 18000]
    noise = (torch.rand(1, 12000, generator=g) - 0.5).float()  # [1, 12000] at 16 kHz
    tracks, prompts = [(stereo, 24000), (noise, 16000)], ["a flute and a whistle", "rain on a roof"]
    outputs = [Output(audio=a, sample_rate=r) for a, r in tracks]
    scores = reward(reward_inputs(outputs, "audio"), prompts, [{}, {}])

    model, processor = ClapModel.from_pretrained(tmp_path).eval(), ClapProcessor.from_pretrained(tmp_path)
    waves = [resample_poly(stereo.double().mean(0).numpy(), 2, 3), noise[0].numpy()]
    inputs = processor(text=prompts, audio=waves, sampling_rate=16000, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    expected = torch.nn.functional.cosine_similarity(out.audio_embeds, out.text_embeds, dim=-1)
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(scores)) == 2 and all(-1 <= s <= 1 for s in scores)
    assert len(reward.features([(stereo, 24000)])[0]) == 12000  # 0.75 s at 16 kHz


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # the train script's @record
@pytest.mark.parametrize("reward", ["clap", "imagebind", "imagebind_text_audio"])
def test_recipe_without_the_reward_weights_fails_at_load(reward, tmp_path, capsys, monkeypatch):
    """The tiny LTX-2.3 recipe rewarded by CLAP or ImageBind with no reward.paths entry, or one to a
    directory without the model, stops with one `error:` line before the model loads."""
    from omnirl.models.ltx2.adapter import LTX2Adapter
    from tests.test_bad_input import ROOT, assert_one_error_line, load_train_script

    loaded = []
    monkeypatch.setattr(LTX2Adapter, "__init__", lambda *a: loaded.append(a))  # nothing may load
    recipe = yaml.safe_load((ROOT / "yaml/ltx23_tiny_t2av_flowgrpo.yaml").read_text())
    recipe["reward"]["weights"] = {reward: 1.0, "audio_loudness": 0.5}
    recipe["data"]["train_path"] = str(ROOT / recipe["data"]["train_path"])
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = ": no readable transformers config.json" if reward == "clap" else " lacks imagebind_huge.pth"
    for paths, expected in [
        ({}, f"reward {reward} needs reward.paths.{reward}: a local"),
        ({reward: str(empty)}, f"reward.paths.{reward} '{empty}'" + missing),
    ]:
        recipe["reward"]["paths"] = paths
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        out = tmp_path / "out"
        args = ["--recipe", str(tmp_path / "recipe.yaml"), "--model.path", str(empty)]
        status = load_train_script().main([*args, "--run.output_dir", str(out)])
        assert_one_error_line(status, capsys, expected)
        assert not out.exists() and not loaded


@pytest.fixture
def tiny_imagebind(tmp_path, monkeypatch):
    """The tiny ImageBind's directory, the reward classes set to its towers, the licence not yet shown."""
    from omnirl.rewards import imagebind as IB
    from omnirl.testing.rewards import make_tiny_imagebind, tiny_imagebind_arch

    monkeypatch.setattr(IB.ImageBindReward, "arch", tiny_imagebind_arch())
    monkeypatch.setattr(IB, "_licence_shown", False)
    return make_tiny_imagebind(tmp_path / "imagebind")


def av_outputs() -> list[Output]:
    """Two 24 fps clips with stereo 24 kHz audio: 81 frames (3.4 s, as the LTX-2 reference) and 30."""
    g = torch.Generator().manual_seed(0)
    videos = [torch.rand(81, 3, 64, 96, generator=g), torch.rand(30, 3, 80, 48, generator=g)]
    tracks = [sine(0.5, 24000, 81 / 24).repeat(2, 1), (torch.rand(2, 30 * 1000, generator=g) - 0.5)]
    return [Output(video=v, fps=24.0, audio=a.float(), sample_rate=24000) for v, a in zip(videos, tracks)]


@pytest.mark.slow  # 15 vision clips of 224 px per video, three rewards: several seconds on 2 cores
def test_imagebind_rewards_are_the_cosine_of_the_model_embeddings(tiny_imagebind, capsys):
    """The tiny ImageBind in the official key layout, loaded by the reward: each score is the cosine of
    the towers' embeddings (each the mean over a sample's clips) computed here by calling the model on the
    same clips; the licence is printed once however many rewards load."""
    from scipy.signal import resample_poly

    from omnirl.rewards import imagebind as IB
    from omnirl.rewards.imagebind_model import UNUSED, ImageBind
    from omnirl.testing.rewards import tiny_imagebind_arch

    outputs, prompts = av_outputs(), ["a flute in a field", "waves"]
    av = IB.ImageBindAudioVideo(str(tiny_imagebind))
    ta, tv = IB.ImageBindTextAudio(str(tiny_imagebind)), IB.ImageBindTextVideo(str(tiny_imagebind))
    assert capsys.readouterr().out.count("CC-BY-NC 4.0") == 1
    scores = {
        "av": av(reward_inputs(outputs, ("video", "audio")), prompts, [{}, {}]),
        "ta": ta(reward_inputs(outputs, "audio"), prompts, [{}, {}]),
        "tv": tv(reward_inputs(outputs, "video"), prompts, [{}, {}]),
    }

    state = torch.load(tiny_imagebind / IB.FILE, weights_only=True)
    model = ImageBind(tiny_imagebind_arch()).eval()
    model.load_state_dict({k: v for k, v in state.items() if k.split(".")[1] not in UNUSED})
    ids = torch.zeros(2, 77, dtype=torch.long)
    for i, p in enumerate(prompts):  # the CLIP BPE: start, the text, end, then 0
        row = av.tokenizer(p)["input_ids"]
        ids[i, : len(row)] = torch.tensor(row)
    cos = torch.nn.functional.cosine_similarity
    with torch.no_grad():
        text = model.text(ids, (ids != 0).sum(1) - 1)
        for i, out in enumerate(outputs):
            assert out.video is not None and out.audio is not None and out.fps is not None
            video = model.vision(IB.video_clips(out.video, out.fps)).mean(0)
            mono16k = torch.from_numpy(resample_poly(out.audio.double().mean(0).numpy(), 2, 3)).float()
            audio = model.audio(av.audio_clips(mono16k[None], 16000)).mean(0)
            assert scores["av"][i] == pytest.approx(float(cos(video, audio, dim=0)), abs=1e-5)
            assert scores["ta"][i] == pytest.approx(float(cos(audio, text[i], dim=0)), abs=1e-5)
            assert scores["tv"][i] == pytest.approx(float(cos(video, text[i], dim=0)), abs=1e-5)
    assert all(len(set(s)) == 2 and all(-1 <= x <= 1 for x in s) for s in scores.values())


def test_imagebind_inputs_are_the_official_loaders_clips():
    """Video: five 2 s windows evenly spaced over 81 frames at 24 fps, the first and last frame of each
    (frame i is filled with i / 100 here, so each clip says which frames it holds), the short side scaled
    to 224, three crops along the long side. Audio: three 2 s windows of 16 kHz log-mels; silence is the
    log floor, padding is 0, both normalised by ImageBind's mean and std."""
    from omnirl.rewards import imagebind as IB

    video = torch.arange(81.0).div(100).view(81, 1, 1, 1).expand(81, 3, 32, 48)  # [F, 3, H, W]
    clips = IB.video_clips(video, 24.0)  # [15, 3, 2, 224, 224]
    assert clips.shape == (15, 3, 2, 224, 224)
    frames = clips[:, 0, :, 0, 0] * IB.CLIP_STD[0] + IB.CLIP_MEAN[0]  # [15, 2]: the frames' values
    expected = torch.tensor([[0, 47], [9, 56], [17, 64], [25, 72], [33, 80]]).repeat_interleave(3, 0) / 100
    torch.testing.assert_close(frames, expected, atol=2e-3, rtol=0)  # 8-bit values
    ramp = torch.linspace(0, 1, 48).expand(1, 3, 32, 48)  # brighter to the right: the crops' offsets show
    left, centre, right = IB.video_clips(ramp, 24.0)[:3, 0, 0, 0, 0]
    assert left < centre < right

    half_second = torch.zeros(1, 8000)  # 0.5 s of silence at 16 kHz: 48 frames of 25 ms every 10 ms
    mels = IB.AudioClips()(half_second, 16000)
    assert mels.shape == (3, 1, 128, 204)
    floor = (math.log(1.192092955078125e-07) - IB.AUDIO_MEAN) / IB.AUDIO_STD  # log of the mel floor
    torch.testing.assert_close(mels[..., :48], torch.full((3, 1, 128, 48), floor))
    torch.testing.assert_close(mels[..., 48:], torch.full((3, 1, 128, 156), -IB.AUDIO_MEAN / IB.AUDIO_STD))
    assert IB.clip_starts(3.0, 3) == [0.0, 0.5, 1.0] and IB.clip_starts(1.0, 5) == [0.0] * 5


def test_imagebind_file_is_matched_key_by_key(tiny_imagebind, tmp_path):
    """Every key of the three towers must be in the file with its shape, and every other key must be one
    of the official towers not built here (depth, thermal, IMU); else an error naming the key."""
    from omnirl.errors import ConfigError
    from omnirl.rewards.imagebind import FILE
    from omnirl.rewards.imagebind_model import load_imagebind
    from omnirl.testing.rewards import tiny_imagebind_arch

    state = torch.load(tiny_imagebind / FILE, weights_only=True)
    assert any(k.startswith("modality_trunks.thermal.") for k in state)  # skipped, not an error
    load_imagebind(str(tiny_imagebind / FILE), tiny_imagebind_arch())
    key = "modality_trunks.audio.blocks.1.attn.bias_k"
    for change, expected in [
        (lambda s: s.pop(key), f"lacks '{key}' (ImageBind's audio tower)"),
        (
            lambda s: s.update({"modality_trunks.audio.blocks.2.norm_1.weight": torch.ones(16)}),
            "key 'modality_trunks.audio.blocks.2.norm_1.weight' is not one",
        ),
        (
            lambda s: s.update({key: torch.zeros(1, 1, 32)}),
            f"'{key}' has shape [1, 1, 32]; this ImageBind's is [1, 1, 16]",
        ),
    ]:
        bad = dict(state)
        change(bad)
        torch.save(bad, tmp_path / "bad.pth")
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_imagebind(str(tmp_path / "bad.pth"), tiny_imagebind_arch())
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="bad.pth: not a PyTorch weight file: not the zip archive"):
        load_imagebind(str(tmp_path / "bad.pth"), tiny_imagebind_arch())


def test_a_reward_of_two_modalities_gets_both(tiny_imagebind):
    """`modality = ("video", "audio")`: the model must produce both (else the recipe is refused, naming
    them), each sample's input is the pair, and the pool hands it that pair."""
    from omnirl.errors import ConfigError
    from omnirl.rewards import imagebind as IB
    from omnirl.rewards.pool import RewardPool

    assert get_reward("imagebind") is IB.ImageBindAudioVideo
    check_modalities(["imagebind", "clap"], frozenset({"video", "audio"}), "ltx2")
    with pytest.raises(
        ConfigError,
        match="reward 'imagebind' reads video and audio outputs, but model.adapter 'wan' produces video",
    ):
        check_modalities(["imagebind"], frozenset({"video"}), "wan")
    outputs = av_outputs()
    [(video, audio)] = reward_inputs(outputs[:1], ("video", "audio"))
    assert video == (outputs[0].video, 24.0) and audio == (outputs[0].audio, 24000)
    paths = {"imagebind": str(tiny_imagebind)}
    pool = RewardPool({"imagebind": 1.0, "audio_loudness": 0.0}, 2, 60, paths=paths)
    try:
        scored = pool.score(outputs, ["a", "b"], [{}, {}]).per_reward["imagebind"]
        direct = pool.rewards["imagebind"](reward_inputs(outputs, ("video", "audio")), ["a", "b"], [{}, {}])
        assert scored.tolist() == pytest.approx(direct, abs=1e-6)
    finally:
        pool.close()
