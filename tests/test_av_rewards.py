"""Audio and audio-video rewards: the loudness reward on tracks whose level is known."""

import math

import pytest
import torch

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
