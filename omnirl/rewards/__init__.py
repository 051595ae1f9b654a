"""Rewards: name -> "module:Class", imported only when named, so heavy dependencies (OCR models, CLIP,
a VLM judge) load only in runs that use them.

A reward is a class built with no arguments (or its local checkpoint directory, `reward.paths`; a latent
reward also with the adapter and the config) whose instances are called on a batch,
`reward(samples, prompts, metadata) -> list[float]`, one finite float per sample. It declares the
modality it reads (`modality`), and `samples` holds that part of each sample's `Output`
(`reward_inputs`); a recipe that pairs a reward with a model that cannot produce its modality fails when
it loads (`check_modalities`). `omnirl.rewards.pool.RewardPool` combines several rewards with weights,
holds a latent reward's batches for the trainer's thread, and never calls one instance from two threads.

The contract, the modalities and the latent rewards: docs/extending.md#how-to-add-a-reward.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image
from torch import nn

from omnirl.errors import ConfigError
from omnirl.models.base import Output
from omnirl.weights import check_weight_files

REWARDS = {
    "jpeg_compressibility": "omnirl.rewards.jpeg:JpegCompressibility",
    "jpeg_incompressibility": "omnirl.rewards.jpeg:JpegIncompressibility",
    "ocr": "omnirl.rewards.ocr:OcrReward",
    "text_edit": "omnirl.rewards.text_edit:TextEditReward",
    "mmk12": "omnirl.rewards.mmk12:Mmk12Reward",
    "uniform_noise": "omnirl.rewards.noise:UniformNoise",
    "video_brightness": "omnirl.rewards.video:VideoBrightness",
    "clip_video": "omnirl.rewards.clip_video:ClipVideoAlignment",
    "hpsv3": "omnirl.rewards.hpsv3:HPSv3Reward",
    "video_temporal_smoothness": "omnirl.rewards.video:VideoTemporalSmoothness",
    "pickscore": "omnirl.rewards.pickscore:PickScore",
    "dina_lrm": "omnirl.rewards.dina_lrm:DinaLRM",
    "audio_loudness": "omnirl.rewards.audio:AudioLoudness",
    "clap": "omnirl.rewards.clap:ClapAlignment",
    "imagebind": "omnirl.rewards.imagebind:ImageBindAudioVideo",
    "imagebind_text_audio": "omnirl.rewards.imagebind:ImageBindTextAudio",
    "imagebind_text_video": "omnirl.rewards.imagebind:ImageBindTextVideo",
}


@dataclass(frozen=True)
class LocalCheckpoint:
    """What a reward loads from its `reward.paths` directory: for each group of `files` one of its files
    (paths relative to the directory) and, unless `model_type` is None, a transformers config.json of that
    model type."""

    model_type: str | None
    files: tuple[tuple[str, ...], ...]

    def check(self, name: str, path: str) -> None:
        """A ConfigError naming reward.paths.<name> unless `path` is such a directory. Reward paths are local
        (nothing is downloaded), so a path that does not exist is never looked up on the hub."""
        key = f"reward.paths.{name}"
        if not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"{key} {path!r} {what} (a local checkpoint directory: nothing is downloaded)")
        if self.model_type is not None:
            try:
                with open(os.path.join(path, "config.json")) as f:
                    model_type = json.load(f).get("model_type")
            except (OSError, ValueError, AttributeError) as e:
                raise ConfigError(f"{key} {path!r}: no readable transformers config.json ({e})") from None
            if model_type != self.model_type:
                raise ConfigError(
                    f"{key} {path!r} holds a {model_type!r} model; reward {name} loads a "
                    f"{self.model_type!r} one"
                )
        for group in self.files:
            if not any(os.path.isfile(os.path.join(path, f)) for f in group):
                raise ConfigError(f"{key} {path!r} lacks {' or '.join(group)}, which reward {name} loads")
        check_weight_files(path)  # their headers: a damaged file is named before any reward loads


_WEIGHTS = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)  # fmt: skip
_TOKENIZER = ("tokenizer.json", "vocab.json")
_PROCESSOR = ("preprocessor_config.json", "processor_config.json")  # transformers 5 writes the second

# ImageBind's official file (not a transformers checkpoint) and CLIP's BPE tokenizer, which its text reads.
_IMAGEBIND = LocalCheckpoint(None, (("imagebind_huge.pth",), _TOKENIZER))

# The rewards that load a local checkpoint (their `reward.paths` entry), and what they load from it.
LOCAL_CHECKPOINTS = {
    "clip_video": LocalCheckpoint("clip", (_WEIGHTS, _PROCESSOR, _TOKENIZER)),
    "hpsv3": LocalCheckpoint("qwen2_vl", (("HPSv3.safetensors",), _WEIGHTS, _PROCESSOR, _TOKENIZER)),
    "pickscore": LocalCheckpoint("clip", (_WEIGHTS, _PROCESSOR, _TOKENIZER)),
    "clap": LocalCheckpoint("clap", (_WEIGHTS, _PROCESSOR, _TOKENIZER)),
    "imagebind": _IMAGEBIND,
    "imagebind_text_audio": _IMAGEBIND,
    "imagebind_text_video": _IMAGEBIND,
    # DiNa-LRM's config.json is its training config, not a transformers one.
    "dina_lrm": LocalCheckpoint(
        None,
        (
            ("config.json",),
            ("checkpoint/backbone_lora/adapter_model.safetensors",),
            ("checkpoint/rm_head.pt",),
        ),
    ),
}


def check_reward_paths(weights: dict[str, float], paths: dict[str, str]) -> None:
    """`reward.paths` against the rewards of `reward.weights`, before any reward loads: every reward that
    loads a local checkpoint has a path to a directory holding what it loads, and no path names a reward
    that is not used or loads nothing; else a ConfigError naming the reward path."""
    for name in paths:
        if name not in weights:
            raise ConfigError(f"reward.paths names {name!r}, which reward.weights does not use")
        if name not in LOCAL_CHECKPOINTS:
            raise ConfigError(f"reward.paths names {name!r}, a reward that loads no checkpoint")
    for name in weights:
        if name in LOCAL_CHECKPOINTS:
            if name not in paths:
                model_type = LOCAL_CHECKPOINTS[name].model_type
                kind = f"{model_type} checkpoint" if model_type else "checkpoint"  # None: no transformers one
                raise ConfigError(f"reward {name} needs reward.paths.{name}: a local {kind} directory")
            LOCAL_CHECKPOINTS[name].check(name, paths[name])


class Reward(Protocol):
    # A class attribute: the part of an Output it reads ("image", "video", "audio", "text", "latent"), a
    # tuple of parts for a reward that reads several together (("video", "audio"): it is called with a
    # tuple of their inputs per sample), or None for a reward that reads no output (a noise or constant
    # score) and is called with the Outputs.
    modality: str | tuple[str, ...] | None

    def __call__(self, samples: list, prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """One finite score per sample; higher is better. `samples` holds each sample's `modality`, as
        `reward_inputs` makes it."""
        ...


def get_reward(name: str) -> type[Reward]:
    """The reward class registered under `name` (imports its module now)."""
    if name not in REWARDS:
        raise ConfigError(f"unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}")
    module, cls = REWARDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def check_modalities(names, modalities: frozenset[str], adapter: str) -> None:
    """Every named reward reads modalities that the model's outputs hold, else a ConfigError naming both."""
    for name in names:
        modality = get_reward(name).modality
        read = (modality,) if isinstance(modality, str) else modality or ()
        if not set(read) <= modalities:
            raise ConfigError(
                f"reward {name!r} reads {' and '.join(read)} outputs, but model.adapter {adapter!r} produces "
                f"{', '.join(sorted(modalities))}"
            )


def reward_modules(reward: Reward) -> list[nn.Module]:
    """The modules a reward holds as attributes (its model, head, processor-side networks): what sleeps in
    host memory while the policy trains and wakes for the rollout, like the text encoders and the VAE."""
    return [m for m in vars(reward).values() if isinstance(m, nn.Module)]


def to_pil(image: torch.Tensor) -> Image.Image:
    """An image [3, H, W] in [0, 1] as an 8-bit PIL image (what image rewards and files see)."""
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()  # [H, W, 3]
    return Image.fromarray(array)


def reward_inputs(outputs: list[Output], modality: str | tuple[str, ...] | None) -> list:
    """What a reward of `modality` is called with: PIL images, (video [F, 3, H, W], fps) pairs, (audio
    [C, T], sample rate) pairs, texts or `Latent` records, one per output (None: the outputs themselves; a
    tuple of modalities: a tuple of those inputs per output). An output without that modality is an error."""
    if modality is None:
        return list(outputs)
    if isinstance(modality, tuple):
        return list(zip(*(reward_inputs(outputs, m) for m in modality)))
    for i, out in enumerate(outputs):
        if modality not in out.modalities:
            raise ValueError(f"sample {i} has no {modality} output (it holds {sorted(out.modalities)})")
    if modality == "image":
        return [to_pil(o.image) for o in outputs if o.image is not None]  # every one: checked above
    if modality == "video":
        return [(o.video, o.fps) for o in outputs]
    if modality == "audio":
        return [(o.audio, o.sample_rate) for o in outputs]
    if modality == "latent":
        return [o.latent for o in outputs]
    return [o.text for o in outputs]
