"""Qwen3-Omni (MoE): the thinker adapter (image / audio / text in, text out), an `OmniAdapter`.

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/qwen3_omni_thinker/README.md`, "The adapter").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import torch
from torch import nn
from transformers import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from transformers.processing_utils import ProcessorMixin

from omnirl.config import Config
from omnirl.models.base import Request
from omnirl.models.lm import (
    TransformersLMAdapter,
)

# Request.inputs keys this adapter reads: one PIL image and one waveform (1-D float array, 16 kHz).
INPUT_KEYS = ("image", "audio")


class _ProcessorWithoutVideo(Qwen3OmniMoeProcessor):
    """Qwen3OmniMoeProcessor assembled from tokenizer, image processor and audio feature extractor only.

    The real constructor insists on a video processor, which cannot be built without torchvision.
    Dropping `video_processor` from the signature drops it from the processor's attributes; the token
    attributes are set as the parent's constructor sets them.
    """

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(
            self,
            image_processor=image_processor,
            feature_extractor=feature_extractor,
            tokenizer=tokenizer,
            chat_template=chat_template,
        )
        for name in ("image", "audio", "video"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
            setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))


@dataclass
class Qwen3OmniSettings:
    stage: Literal["thinker", "talker", "all"] = "thinker"
    """The stage that is trained and run ('thinker': text out; the talker (speech) and 'all' are not
    implemented yet). Modules the stage does not use are never loaded."""

    RANGES: ClassVar[dict] = {  # checked when the recipe loads (omnirl.config_checks)
        "stage": ((lambda v: v == "thinker"), "'thinker' (the talker (speech) and 'all' are not implemented)")
    }


class Qwen3OmniThinkerAdapter(TransformersLMAdapter):
    """The `OmniAdapter` for Qwen3-Omni MoE checkpoints; trains the thinker (family.stage 'thinker')."""

    kind = "omni"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    Settings = Qwen3OmniSettings

    def __init__(self, cfg: Config, device: torch.device):
        path = cfg.model.path
        config = self.checkpoint_config(path)
        if isinstance(config, Qwen3OmniMoeConfig):
            # The full model: load thinker.* only, renamed to the thinker class's own names.
            # (typed as maybe a dict, the constructor's argument)
            thinker_config, key_mapping = cast(Any, config.thinker_config), {r"^thinker\.": ""}
        elif isinstance(config, Qwen3OmniMoeThinkerConfig):
            thinker_config, key_mapping = config, None
        else:
            raise ValueError(
                f"model.path {path!r} holds a {type(config).__name__}, not a Qwen3-Omni MoE checkpoint"
            )
        self.read_processor(path, _ProcessorWithoutVideo)
        tokenizer = self.tokenizer
        assert thinker_config is not None  # a Qwen3OmniMoeConfig always holds its thinker's
        thinker_config.vision_start_token_id = tokenizer.convert_tokens_to_ids(tokenizer.vision_bos_token)
        self.placeholder_token_ids = (
            tokenizer.image_token_id,
            tokenizer.video_token_id,
            tokenizer.audio_token_id,
        )
        self.thinker = self.load_model(
            cfg,
            device,
            Qwen3OmniMoeThinkerForConditionalGeneration,
            config=thinker_config,
            key_mapping=key_mapping,
        )
        self.path = path

    def fsdp_units(self) -> list[nn.Module]:
        thinker: Any = self.thinker  # the transformers model, read by name
        body = thinker.model
        return [*self.decoder_layers(), body.visual, body.audio_tower, thinker.lm_head]

    def prepare(self, request: Request) -> dict[str, torch.Tensor]:
        unknown = sorted(set(request.inputs) - set(INPUT_KEYS))
        if unknown:
            raise ValueError(
                f"request {request.index}: inputs {unknown} are not supported (known: {INPUT_KEYS})"
            )
        image, audio = request.inputs.get("image"), request.inputs.get("audio")
        content = [{"type": "image"}] if image is not None else []
        content += [{"type": "audio"}] if audio is not None else []
        content.append({"type": "text", "text": request.prompt})
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        out = self.processor(
            text=[text],
            images=[image] if image is not None else None,
            audio=[audio] if audio is not None else None,
            return_tensors="pt",
        )
        inputs = {"input_ids": out["input_ids"][0]}  # [P]
        if image is not None:
            inputs["pixel_values"] = out["pixel_values"]  # [N, 3 * 2 * patch * patch]
            inputs["image_grid_thw"] = out["image_grid_thw"]  # [1, 3]
        if audio is not None:
            inputs["input_features"] = out["input_features"]  # [1, mel, frames]
            inputs["feature_attention_mask"] = out["feature_attention_mask"]  # [1, frames]
        return inputs

    def rope_positions(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch.get("feature_attention_mask")
        thinker: Any = self.thinker  # (transformers types the ids as LongTensor, which no tensor is)
        positions, _ = thinker.get_rope_index(
            batch["input_ids"],
            image_grid_thw=batch.get("image_grid_thw"),
            attention_mask=batch["attention_mask"],
            audio_seqlens=mask.sum(-1) if mask is not None else None,
        )
        return positions  # [3, B, L]

    def export_lora(self, out_dir: str | Path, state_dict: dict | None = None) -> None:
        """Write the thinker's LoRA as a peft adapter: `PeftModel.from_pretrained(thinker, out_dir)` loads it
        onto `Qwen3OmniMoeThinkerForConditionalGeneration` (keys `base_model.model.model.language_model.
        layers.N.self_attn.q_proj.lora_A.weight`; target_modules the full names `model.language_model.
        layers.N.self_attn.q_proj`, ...).

        For the full `Qwen3OmniMoeForConditionalGeneration` the thinker sits under `thinker.`: insert
        `thinker.` after `base_model.model.` in every key (`base_model.model.thinker.model.language_model.
        ...`) and before every target module name. An FSDP run passes the gathered full state dict of
        `self.model`.
        """
        super().export_lora(out_dir, state_dict)
