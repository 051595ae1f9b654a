"""PickScore (Kirstain et al. 2023), as flow_grpo scores it: a CLIP ViT-H/14 fine-tuned on human
preferences; the score of an image is logit_scale x cosine(image embedding, prompt embedding) / 26.

Local layout (`reward.paths.pickscore`): one directory holding the `yuvalkirstain/PickScore_v1` model
(`CLIPModel`: config.json and weights) and the processor of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`
copied into it (preprocessor_config.json and the tokenizer files), which is the processor PickScore was
trained with; both load with transformers' `from_pretrained`, nothing is downloaded. Images go through the
processor as 8-bit images (resize, centre crop, normalise), prompts are truncated at CLIP's 77 tokens.
The model scores a batch in chunks of `batch_size` images on the accelerator, in float32 (flow_grpo's
precision for it), and sleeps in host memory while the policy trains (`omnirl.rewards.reward_modules`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

from omnirl import distributed as D
from omnirl.errors import ConfigError

# flow_grpo divides PickScore's logit by 26 so that rewards sit near 1 (its logit is ~21-23 for SD3.5)
SCALE = 26.0


class PickScore:
    modality = "image"
    batch_size = 32  # images per forward

    def __init__(self, path: str | None = None):
        if path is None or not (Path(path) / "config.json").is_file():
            raise ConfigError(
                "reward pickscore needs reward.paths.pickscore: a directory holding PickScore_v1 (config.json"
                f", weights) and the laion CLIP-ViT-H-14 processor's files, got {path!r}"
            )
        self.device = torch.device(D.device_type())
        self.processor = CLIPProcessor.from_pretrained(path)
        self.model = CLIPModel.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        self.model.to(self.device)  # pyright: ignore[reportArgumentType] (typed as the unbound Module.to)

    @torch.no_grad()
    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        scores = []
        for s in range(0, len(images), self.batch_size):
            pixels = self.processor(images=images[s : s + self.batch_size], return_tensors="pt")
            text = self.processor(
                text=prompts[s : s + self.batch_size],
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            )
            # [N, P] each; transformers types get_*_features as maybe a tuple (it returns the model output)
            image = self.model.get_image_features(**pixels.to(self.device)).pooler_output  # pyright: ignore[reportAttributeAccessIssue]
            prompt = self.model.get_text_features(**text.to(self.device)).pooler_output  # pyright: ignore[reportAttributeAccessIssue]
            assert image is not None and prompt is not None  # the projected embeddings
            assert image is not None and prompt is not None  # CLIP's projections always pool
            cosine = torch.nn.functional.cosine_similarity(image.float(), prompt.float(), dim=-1)  # [N]
            scores += (self.model.logit_scale.exp() * cosine / SCALE).tolist()
        return scores
