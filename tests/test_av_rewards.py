"""Audio and audio-video rewards: the loudness reward on tracks whose level is known."""

import math

import pytest
import torch
import yaml

from omnirl.config import ConfigError
from omnirl.models.base import Output
from omnirl.rewards import check_modalities, get_reward, reward_inputs


def sine(amplitude: float, rate: int = 16000, seconds: float = 1.0, hz: float = 440.0) -> torch.Tensor:
    t = torch.arange(int(rate * seconds), dtype=torch.float64) / rate
    return amplitude * torch.sin(2 * math.pi * hz * t)


def test_audio_loudness_on_known_tracks():
    """The RMS level in dBFS of the mono mix: a full-scale sine is -3.01 dB (RMS 1/sqrt 2), a tenth of it
    20 dB less, silence and a stereo track whose channels cancel are the -100 dB floor."""
    from omnirl.rewards.audio import AudioLoudness

    loud, quiet = sine(1.0)[None], sine(0.1).repeat(2, 1)  # [1, T], [2, T]
    cancelling = torch.stack([sine(0.5), -sine(0.5)])  # [2, T]: mono mix is silence
    tracks = [loud, quiet, torch.zeros(1, 800), cancelling]
    inputs = reward_inputs([Output(audio=a.float(), sample_rate=16000) for a in tracks], "audio")
    scores = AudioLoudness()(inputs, [""] * 4, [{}] * 4)
    assert scores == pytest.approx([-10 * math.log10(2), -10 * math.log10(2) - 20, -100.0, -100.0], abs=1e-4)
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

    from omnirl.models.tiny_rewards import make_tiny_clap
    from omnirl.rewards.clap import ClapAlignment

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


@pytest.mark.parametrize("reward", ["clap"])
def test_recipe_without_the_reward_weights_fails_at_load(
    reward, tiny_wan_ti2v, tmp_path, capsys, monkeypatch
):
    """A recipe naming an audio reward with no reward.paths entry, or one to a directory without the model,
    stops with one `error:` line before the model loads. (The tiny TI2V recipe, its Wan adapter declared
    to produce audio too: the check reads only the declaration.)"""
    from omnirl.models.wan import WanAdapter
    from tests.test_bad_input import ROOT, assert_one_error_line, load_train_script

    loaded = []
    monkeypatch.setattr(WanAdapter, "__init__", lambda *a: loaded.append(a))  # nothing may load
    monkeypatch.setattr(WanAdapter, "modalities", frozenset({"video", "audio"}))
    recipe = yaml.safe_load((ROOT / "yaml/wan22_ti2v_tiny_dancegrpo.yaml").read_text())
    recipe["reward"]["weights"] = {reward: 1.0, "audio_loudness": 0.5}
    recipe["data"]["train_path"] = str(ROOT / recipe["data"]["train_path"])
    empty = tmp_path / "empty"
    empty.mkdir()
    for paths, expected in [
        ({}, f"reward {reward} needs reward.paths.{reward}: a local"),
        ({reward: str(empty)}, f"reward.paths.{reward} '{empty}'"),
    ]:
        recipe["reward"]["paths"] = paths
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        out = tmp_path / "out"
        args = ["--recipe", str(tmp_path / "recipe.yaml"), "--model.path", str(tiny_wan_ti2v)]
        status = load_train_script().main([*args, "--run.output_dir", str(out)])
        assert_one_error_line(status, capsys, expected)
        assert not out.exists() and not loaded
