"""CLAP text-audio alignment (Wu et al. 2023), as VeRL-Omni's LTX-2 recipe scores audio: the cosine
similarity of a sample's CLAP audio embedding and its prompt's CLAP text embedding, in [-1, 1].

The weights are a local CLAP checkpoint in transformers' layout (`ClapModel` + `ClapProcessor`, e.g. a
saved laion/larger_clap_general) named by `reward.paths.clap`; nothing is downloaded. Each track is made
mono (the mean of its channels) and resampled to the rate of the checkpoint's feature extractor (48 kHz
for laion's) by scipy's polyphase filter (`omnirl.rewards.audio`, the `audio` extra); the processor then
makes its log-mel features (a track shorter than the feature extractor's window is repeat-padded to it, a
longer one cropped as its `truncation` says) and tokenizes the prompt. The model scores a batch in chunks
of `batch_size` tracks in float32 and sleeps in host memory while the policy trains
(`omnirl.rewards.reward_modules`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import ClapModel, ClapProcessor

from omnirl import distributed as D
from omnirl.errors import ConfigError
from omnirl.rewards.audio import mono, require_scipy, resample


class ClapAlignment:
    modality = "audio"
    batch_size = 16  # tracks per forward

    def __init__(self, path: str | None = None):
        if path is None:
            raise ConfigError("reward clap needs reward.paths.clap: a local CLAP checkpoint directory")
        require_scipy("clap")
        self.device = torch.device(D.device_type())
        self.processor = ClapProcessor.from_pretrained(path)
        self.model = ClapModel.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        self.model.to(self.device)  # pyright: ignore[reportArgumentType] (typed as the unbound Module.to)
        self.rate = int(self.processor.feature_extractor.sampling_rate)

    def features(self, tracks: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """The tracks as the model hears them: mono, at the feature extractor's rate, [T] float32."""
        return [resample(mono(audio), int(rate), self.rate) for audio, rate in tracks]

    @torch.no_grad()
    def __call__(
        self, tracks: list[tuple[torch.Tensor, int]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        scores = []
        for s in range(0, len(tracks), self.batch_size):
            waves = [w.numpy() for w in self.features(tracks[s : s + self.batch_size])]
            audio = self.processor(audio=waves, sampling_rate=self.rate, return_tensors="pt")
            text = self.processor(
                text=prompts[s : s + self.batch_size], padding=True, truncation=True, return_tensors="pt"
            )
            # [N, P] each; transformers types get_*_features as maybe a tuple (it returns the model output)
            sound = self.model.get_audio_features(**audio.to(self.device)).pooler_output  # pyright: ignore[reportAttributeAccessIssue]
            prompt = self.model.get_text_features(**text.to(self.device)).pooler_output  # pyright: ignore[reportAttributeAccessIssue]
            assert sound is not None and prompt is not None  # CLAP's projections always pool
            scores += torch.nn.functional.cosine_similarity(sound.float(), prompt.float(), dim=-1).tolist()
        return scores
