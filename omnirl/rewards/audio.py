"""Audio tracks as the audio rewards read them, and a cheap audio reward that needs no weights.

An audio sample reaches a reward as a track [C, T] in [-1, 1] with its sample rate (`reward_inputs`).
The rewards that run a model read it as the model was trained: one channel (the mean of the channels,
`mono`) at the model's own rate (`resample`, scipy's polyphase resampler, the `audio` extra).

`audio_loudness` is the track's RMS level in dBFS (decibels relative to a full-scale square wave) of the
mono mix with its mean removed (a DC offset is inaudible, and a random-init vocoder's output carries a
large one), floored at -100 dB for silence. Like `video_brightness` it is a property of the generated
samples alone, smooth and monotone, so a tiny audio model's group samples differ in it from the first
step and a tiny recipe can show learning on CPU.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from omnirl.errors import ConfigError

SILENCE_DB = -100.0  # the level of a silent track (the RMS floor 1e-5)


def require_scipy(reward: str) -> None:
    """A ConfigError naming the extra unless scipy (the resampler) is installed."""
    if importlib.util.find_spec("scipy") is None:
        raise ConfigError(f"reward {reward} resamples audio with scipy: pip install 'omnirl[audio]'")


def mono(audio: torch.Tensor) -> torch.Tensor:
    """A track [C, T] (or [T]) as one float32 channel [T]: the mean of its channels."""
    audio = audio.float()
    return audio.mean(0) if audio.ndim == 2 else audio


def resample(wave: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """A mono track [T] at `rate` Hz resampled to `target` Hz (float32), by scipy's polyphase filter
    (`resample_poly`, the up / down factors of the reduced ratio); unchanged when the rates agree."""
    if rate == target:
        return wave.float()
    from scipy.signal import resample_poly

    g = math.gcd(int(rate), int(target))
    out = resample_poly(wave.double().cpu().numpy(), int(target) // g, int(rate) // g)
    return torch.from_numpy(out).float()


def loudness_db(audio: torch.Tensor) -> float:
    """The RMS level of the mono mix of a track [C, T], its DC offset removed, in dBFS, at least
    SILENCE_DB."""
    if audio.shape[-1] == 0:
        raise ValueError(f"an audio track of no samples (shape {list(audio.shape)}) has no level")
    wave = mono(audio).double()
    rms = (wave - wave.mean()).square().mean().sqrt()
    return 20 * math.log10(max(float(rms), 10 ** (SILENCE_DB / 20)))


class AudioLoudness:
    modality = "audio"

    def __call__(
        self, tracks: list[tuple[torch.Tensor, int]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [loudness_db(audio) for audio, _ in tracks]
