"""Rewards: name -> "module:Class", imported only when named, so heavy dependencies (OCR models, CLIP,
a VLM judge) load only in runs that use them.

A reward is a class constructed with no arguments whose instances are called on a batch:
`reward(images, prompts, metadata) -> list[float]`, one finite float per image. `metadata[i]` is the data
row of sample i (`omnirl.data.prompts.PromptRow.metadata`, with "source" = "file.jsonl:LINE" for error
messages). `omnirl.rewards.pool.RewardPool` combines several rewards with weights and never calls one
reward instance from two threads at once.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from PIL import Image

from omnirl.config import ConfigError

REWARDS = {
    "jpeg_compressibility": "omnirl.rewards.jpeg:JpegCompressibility",
    "jpeg_incompressibility": "omnirl.rewards.jpeg:JpegIncompressibility",
    "ocr": "omnirl.rewards.ocr:OcrReward",
    "text_edit": "omnirl.rewards.text_edit:TextEditReward",
    "mmk12": "omnirl.rewards.mmk12:Mmk12Reward",
}


class Reward(Protocol):
    def __call__(
        self, images: list[Image.Image] | list[str], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        """One finite score per sample; higher is better. `images` holds the generated outputs: PIL
        images from diffusion models, the response texts from text-output (omni) models."""


def get_reward(name: str) -> type[Reward]:
    """The reward class registered under `name` (imports its module now)."""
    if name not in REWARDS:
        raise ConfigError(f"unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}")
    module, cls = REWARDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
