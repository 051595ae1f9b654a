"""Cheap video rewards that need no weights: they run anywhere, so a tiny video recipe can show learning.

`video_brightness` is the mean pixel value of the whole video in [0, 1] (all frames, all channels). It is
a fair test of learning because it is a property of the generated pixels alone, which the policy can only
change by moving its samples (the prompt does not decide it), and it is smooth and monotone, so a
group's samples differ in it from the first step and the advantages carry signal.
`video_temporal_smoothness` is minus the mean absolute difference of consecutive frames (x 100): still,
consistent videos score higher.
"""

from __future__ import annotations

from typing import Any

import torch


class VideoBrightness:
    modality = "video"

    def __call__(
        self, videos: list[tuple[torch.Tensor, float]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [float(video.float().mean()) for video, _ in videos]


class VideoTemporalSmoothness:
    modality = "video"

    def __call__(
        self, videos: list[tuple[torch.Tensor, float]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        # video [F, 3, H, W]; a single frame has no motion: 0.
        return [-100 * float((v[1:] - v[:-1]).abs().mean()) if len(v) > 1 else 0.0 for v, _ in videos]
