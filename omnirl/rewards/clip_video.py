"""Video-text alignment by CLIP: the cosine similarity of the prompt's CLIP text embedding and each
frame's image embedding, averaged over the frames.

The weights are a local CLIP checkpoint (`CLIPModel` + `CLIPProcessor` layout, e.g. a saved
openai/clip-vit-large-patch14) named by `reward.paths.clip_video`; nothing is downloaded. The frames go
through the checkpoint's own processor (resize, crop, normalise) as 8-bit images, as a stored video would.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CLIPModel, CLIPProcessor

from omnirl import distributed as D
from omnirl.errors import ConfigError
from omnirl.rewards import to_pil


class ClipVideoAlignment:
    modality = "video"

    def __init__(self, path: str | None = None):
        if path is None:
            raise ConfigError("reward clip_video needs reward.paths.clip_video: a local CLIP checkpoint")
        self.device = torch.device(D.device_type())
        self.model = CLIPModel.from_pretrained(path).eval().requires_grad_(False)
        self.model.to(self.device)  # pyright: ignore[reportArgumentType] (typed as the unbound Module.to)
        self.processor = CLIPProcessor.from_pretrained(path)

    @torch.no_grad()
    def __call__(
        self, videos: list[tuple[torch.Tensor, float]], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        scores = []
        for (video, _), prompt in zip(videos, prompts):
            frames = [to_pil(frame) for frame in video]  # video [F, 3, H, W]
            inputs = self.processor(
                text=[prompt], images=frames, return_tensors="pt", padding=True, truncation=True
            ).to(self.device)
            out = self.model(**inputs)
            image = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)  # [F, P]
            text = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)  # [1, P]
            scores.append(float((image @ text.T).mean()))
        return scores
