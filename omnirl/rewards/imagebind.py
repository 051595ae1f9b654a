"""ImageBind alignment rewards (Girdhar et al. 2023): the cosine similarity of two embeddings in
ImageBind's joint space, in [-1, 1].

- `imagebind` (`ImageBindAudioVideo`): a sample's audio track against its video.
- `imagebind_text_audio`, `imagebind_text_video` (`ImageBindTextAudio`, `ImageBindTextVideo`): the prompt
  against the audio track / the video.

Weights: `reward.paths.<name>` holds the official `imagebind_huge.pth` and CLIP's BPE tokenizer files;
the towers are `omnirl.rewards.imagebind_model`. Inputs are prepared as the official loaders prepare
files (`video_clips`, `AudioClips`). The weights are CC-BY-NC 4.0: the reward says so once when it loads.

How it works: docs/rewards.md#imagebind
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from omnirl import distributed as D
from omnirl.errors import ConfigError
from omnirl.rewards import imagebind_model as M
from omnirl.rewards.audio import mono, require_scipy, resample

LICENCE = (
    "ImageBind's weights (imagebind_huge.pth) are licensed CC-BY-NC 4.0: for non-commercial use only "
    "(https://github.com/facebookresearch/ImageBind/blob/main/LICENSE)"
)
FILE = "imagebind_huge.pth"
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
AUDIO_RATE, AUDIO_MEAN, AUDIO_STD = 16000, -4.268, 9.138
CLIP_SECONDS, VIDEO_CLIPS, AUDIO_CLIPS = 2, 5, 3

_licence_shown = False


def show_licence() -> None:
    """Print the weights' licence, once per process (on the first rank)."""
    global _licence_shown
    if not _licence_shown and D.rank_and_world()[0] == 0:
        print(LICENCE, flush=True)
    _licence_shown = True


def clip_starts(duration: float, clips: int) -> list[float]:
    """The starts of `clips` windows of CLIP_SECONDS spread evenly over `duration` seconds (pytorchvideo's
    ConstantClipsPerVideoSampler, which the official loaders use): all at 0 for a shorter input."""
    step = max(duration - CLIP_SECONDS, 0.0) / max(clips - 1, 1)
    return [i * step for i in range(clips)]


def video_clips(video: torch.Tensor, fps: float) -> torch.Tensor:
    """A video [F, 3, H, W] in [0, 1] as ImageBind's vision clips [15, 3, 2, 224, 224] (module docstring)."""
    video = (video.float().clamp(0, 1) * 255).round() / 255  # 8-bit, as decoded from a stored video
    frames = len(video)
    windows = []
    for start in clip_starts(frames / fps, VIDEO_CLIPS):
        # the frames at i / fps in [start, end): rounding error must not move a frame across a bound
        first = min(math.ceil(start * fps - 1e-6), frames - 1)
        last = max(min(math.ceil((start + CLIP_SECONDS) * fps - 1e-6), frames) - 1, first)
        windows.append(video[[first, last]])  # [2, 3, H, W]: two frames spread evenly over the window
    clips = torch.stack(windows)  # [5, 2, 3, H, W]
    h, w = clips.shape[-2:]
    short = M.IMAGE_SIZE
    size = (math.floor(h / w * short), short) if w < h else (short, math.floor(w / h * short))
    clips = nn.functional.interpolate(clips.flatten(0, 1), size=size, mode="bilinear", align_corners=False)
    mean, std = torch.tensor(CLIP_MEAN).view(3, 1, 1), torch.tensor(CLIP_STD).view(3, 1, 1)
    clips = ((clips - mean) / std).unflatten(0, (VIDEO_CLIPS, 2)).transpose(1, 2)  # [5, 3, 2, h, w]
    h, w = size
    y, x = math.ceil((h - M.IMAGE_SIZE) / 2), math.ceil((w - M.IMAGE_SIZE) / 2)  # the centre crop
    corners = [(0, x), (y, x), (h - M.IMAGE_SIZE, x)] if h > w else [(y, 0), (y, x), (y, w - M.IMAGE_SIZE)]
    crops = [clip[..., y : y + M.IMAGE_SIZE, x : x + M.IMAGE_SIZE] for clip in clips for y, x in corners]
    return torch.stack(crops)


class AudioClips:
    """Audio tracks as ImageBind's log-mel clips [3, 1, 128, 204] (module docstring)."""

    def __init__(self):
        from transformers import ASTFeatureExtractor

        with (
            warnings.catch_warnings()
        ):  # 128 bins over 257 FFT bins leave the lowest filters empty, as in Kaldi
            warnings.filterwarnings("ignore", "At least one mel filter has all zero values")
            self.fbank = ASTFeatureExtractor(
                sampling_rate=AUDIO_RATE, num_mel_bins=M.MEL_BINS, max_length=M.MEL_FRAMES, do_normalize=False
            )

    def __call__(self, audio: torch.Tensor, rate: int) -> torch.Tensor:
        wave = resample(mono(audio), int(rate), AUDIO_RATE)  # [T]
        clips = []
        for start in clip_starts(len(wave) / AUDIO_RATE, AUDIO_CLIPS):
            begin = int(start * AUDIO_RATE)
            piece = (wave[begin : begin + CLIP_SECONDS * AUDIO_RATE]).numpy().astype(np.float32)
            mel = self.fbank(piece, sampling_rate=AUDIO_RATE, return_tensors="pt").input_values[
                0
            ]  # [204, 128]
            clips.append((mel.T[None] - AUDIO_MEAN) / AUDIO_STD)  # [1, 128, 204]
        return torch.stack(clips)


class ImageBindReward:
    """The model, its inputs and the cosine of two embeddings; the subclasses choose which two."""

    name = "imagebind"
    arch = M.HUGE  # the towers' widths and depths (the tests build a tiny one)

    def __init__(self, path: str | None = None):
        if path is None:
            raise ConfigError(
                f"reward {self.name} needs reward.paths.{self.name}: a directory holding {FILE} and CLIP's "
                "tokenizer files"
            )
        require_scipy(self.name)
        from transformers import CLIPTokenizer

        show_licence()
        self.device = torch.device(D.device_type())
        self.tokenizer = CLIPTokenizer.from_pretrained(path)
        self.model = M.load_imagebind(os.path.join(path, FILE), self.arch).eval().requires_grad_(False)
        self.model.to(self.device)
        self.audio_clips = AudioClips()

    def embed_video(self, video: torch.Tensor, fps: float) -> torch.Tensor:
        return self.model.vision(video_clips(video, fps).to(self.device)).mean(0)  # [out_dim]

    def embed_audio(self, audio: torch.Tensor, rate: int) -> torch.Tensor:
        return self.model.audio(self.audio_clips(audio, rate).to(self.device)).mean(0)  # [out_dim]

    def tokens(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [N, 77] (0 after the end token) and the end tokens' positions [N]."""
        ids = torch.zeros(len(prompts), M.CONTEXT, dtype=torch.long)
        encoded = self.tokenizer(prompts, truncation=True, max_length=M.CONTEXT)["input_ids"]
        for i, row in enumerate(encoded):
            ids[i, : len(row)] = torch.tensor(row)
        return ids, torch.tensor([len(row) - 1 for row in encoded])

    def embed_text(self, prompts: list[str]) -> torch.Tensor:
        ids, eot = self.tokens(prompts)
        return self.model.text(ids.to(self.device), eot.to(self.device))  # [N, out_dim]

    @staticmethod
    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(nn.functional.cosine_similarity(a.float(), b.float(), dim=-1))


class ImageBindAudioVideo(ImageBindReward):
    modality = ("video", "audio")

    @torch.no_grad()
    def __call__(
        self,
        samples: list[tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, int]]],
        prompts: list[str],
        metadata: list[dict[str, Any]],
    ) -> list[float]:
        return [self.cosine(self.embed_video(*video), self.embed_audio(*audio)) for video, audio in samples]


class ImageBindTextAudio(ImageBindReward):
    name = "imagebind_text_audio"
    modality = "audio"

    @torch.no_grad()
    def __call__(
        self, tracks: list[tuple[torch.Tensor, int]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        text = self.embed_text(prompts)
        return [self.cosine(self.embed_audio(*track), t) for track, t in zip(tracks, text)]


class ImageBindTextVideo(ImageBindReward):
    name = "imagebind_text_video"
    modality = "video"

    @torch.no_grad()
    def __call__(
        self, videos: list[tuple[torch.Tensor, float]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        text = self.embed_text(prompts)
        return [self.cosine(self.embed_video(*video), t) for video, t in zip(videos, text)]
