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
    AutoConfig,
    GenerationConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen3VLForConditionalGeneration,
)
from transformers.processing_utils import ProcessorMixin

from omnirl.config import Config
from omnirl.fsdp import DTYPES, load_pretrained, place_policy
from omnirl.models.base import Request
from omnirl.models.lm import (
    HiddenStatesLM,
    TransformersLMAdapter,
    make_trainable_lm,
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
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path {path!r} is not a loadable transformers checkpoint: {e}") from None
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"model.path {path!r} holds a {config.model_type!r} model; the qwen_vl adapter loads "
                f"{', '.join(FAMILIES)}"
            )
        self.processor = _ProcessorWithoutVideo.from_pretrained(path)
        self.tokenizer = tokenizer = self.processor.tokenizer
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's end-of-turn token
            eos = tokenizer.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        self.pad_token_id = tokenizer.pad_token_id
        self.image_token_id = self.processor.image_token_id
        self.placeholder_token_ids = (self.processor.image_token_id, self.processor.video_token_id)

        # A fully fine-tuned model is trained, hence kept, in float32; a LoRA base stays in model.dtype.
        self.lora = cfg.model.finetune == "lora"
        dtype = DTYPES[cfg.model.dtype] if self.lora else torch.float32
        hf_model = load_pretrained(FAMILIES[config.model_type], path, dtype=dtype)
        self.lora_config = make_trainable_lm(hf_model, cfg, path)
        self.hf_model = hf_model  # the transformers model: config, generation, peft state
        # Onto the device, or left on the host for FSDP2 to place when it shards the frozen base.
        lm = HiddenStatesLM(hf_model.model, hf_model.lm_head)
        self.model = place_policy(lm, cfg.distributed.frozen_base, device)
        self.lm_head = lm.lm_head  # (`self.model` is `lm`)
        self.device = device

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
