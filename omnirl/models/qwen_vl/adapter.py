"""Qwen2.5-VL and Qwen3-VL (image + text in, text out): an `OmniAdapter`.

The model (`Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration`, chosen by the
checkpoint's model_type), the placeholder expansion and the M-RoPE positions (`get_rope_index`) are
transformers' own. As in `qwen3_omni_thinker/adapter.py`, this file adds LoRA (peft) on the language model's
decoder layers only (the vision blocks have attention projections too), the peft export, and a processor
without the video processor (which needs torchvision; omnirl feeds these models images only). A VL model has
one stage, the language model conditioned on the image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen3VLForConditionalGeneration,
)
from transformers.processing_utils import ProcessorMixin

from omnirl.config import Config
from omnirl.models.base import Request
from omnirl.models.lm import (
    TransformersLMAdapter,
)

FAMILIES = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}
# Request.inputs keys this adapter reads: one PIL image.
INPUT_KEYS = ("image",)


class _ProcessorWithoutVideo(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor from tokenizer and image processor only (the real constructor insists on a video
    processor, which needs torchvision). Qwen2.5-VL and Qwen3-VL expand image placeholders the same way."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(
            self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template
        )
        assert tokenizer is not None  # from_pretrained passes the checkpoint's
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)


@dataclass
class QwenVLSettings:
    """A VL model has no settings of its own: it has one stage, the language model conditioned on the
    image."""

    RANGES: ClassVar[dict] = {}


class QwenVLAdapter(TransformersLMAdapter):
    """The `OmniAdapter` for Qwen2.5-VL and Qwen3-VL checkpoints."""

    kind = "omni"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    Settings = QwenVLSettings

    def __init__(self, cfg: Config, device: torch.device):
        path = cfg.model.path
        config = self.checkpoint_config(path)
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"model.path {path!r} holds a {config.model_type!r} model; the qwen_vl adapter loads "
                f"{', '.join(FAMILIES)}"
            )
        self.read_processor(path, _ProcessorWithoutVideo)
        self.image_token_id = self.processor.image_token_id
        self.placeholder_token_ids = (self.processor.image_token_id, self.processor.video_token_id)
        self.load_model(cfg, device, FAMILIES[config.model_type])

    def fsdp_units(self) -> list[nn.Module]:
        body = self.hf_model.model
        units = [*self.decoder_layers(), body.visual]
        # A tied lm_head shares its weight with the embedding, which stays with the root.
        if self.hf_model.lm_head.weight is not body.get_input_embeddings().weight:
            units.append(self.hf_model.lm_head)
        return units

    def prepare(self, request: Request) -> dict[str, torch.Tensor]:
        unknown = sorted(set(request.inputs) - set(INPUT_KEYS))
        if unknown:
            raise ValueError(
                f"request {request.index}: inputs {unknown} are not supported (known: {INPUT_KEYS})"
            )
        image = request.inputs.get("image")
        content = [{"type": "image"}] if image is not None else []
        content.append({"type": "text", "text": request.prompt})
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        out = self.processor(text=[text], images=[image] if image is not None else None, return_tensors="pt")
        inputs = {"input_ids": out["input_ids"][0]}  # [P]
        if image is not None:
            inputs["pixel_values"] = out["pixel_values"]  # [N, 3 * 2 * patch * patch]
            inputs["image_grid_thw"] = out["image_grid_thw"]  # [1, 3]
        return inputs

    def rope_positions(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        positions, _ = self.hf_model.model.get_rope_index(
            ids,
            (ids == self.image_token_id).int(),  # mm_token_type_ids: 1 at image placeholders
            image_grid_thw=batch.get("image_grid_thw"),
            attention_mask=batch["attention_mask"],
        )
        return positions  # [3, B, L]
