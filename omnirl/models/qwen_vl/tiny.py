"""The tiny random-init Qwen2.5-VL and Qwen3-VL, saved as local checkpoints (see omnirl.models.sd3.tiny)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnirl.models.qwen3_omni_thinker.tiny import (
    _qwen_omni_tokenizer,
    _save_qwen_processor_parts,
    _tiny_qwen_text_config,
)


def make_tiny_qwen_vl(out_dir: str | Path, family: str = "qwen2_5_vl", head_dim: int = 16) -> Path:
    """A tiny Qwen2.5-VL (`family="qwen2_5_vl"`, vision patch 14) or Qwen3-VL (`"qwen3_vl"`, patch 16,
    deepstack at layer 0), with the tokenizer, chat template and image processor. A 56x56 (Qwen2.5-VL) or
    64x64 (Qwen3-VL) image is 4x4 patches: 4 image tokens after the 2x2 merge. head_dim 32: the variant
    vLLM's CPU attention runs (text and vision heads of 32)."""
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(out_dir)
    tok = _qwen_omni_tokenizer()
    # Each a single token's id (transformers types the lookup as maybe a list of ids).
    ids: dict[str, Any] = {s: tok.convert_tokens_to_ids(s) for s in tok.all_special_tokens}
    vision: dict[str, Any] = dict(
        depth=2, hidden_size=2 * head_dim, intermediate_size=64, num_heads=2, spatial_merge_size=2
    )
    vision.update(temporal_patch_size=2, out_hidden_size=64)  # = the text hidden size
    mm_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    if family == "qwen2_5_vl":
        patch = 14
        text = _tiny_qwen_text_config(tok, head_dim)
        vision.update(patch_size=patch, window_size=56, fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision, **mm_ids)
        )
    elif family == "qwen3_vl":
        patch = 16
        text = _tiny_qwen_text_config(tok, head_dim, mrope_interleaved=True)
        vision.update(patch_size=patch, num_position_embeddings=64, deepstack_visual_indexes=[0])
        model = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(text_config=text, vision_config=vision, **mm_ids)
        )
    else:
        raise ValueError(f"family must be 'qwen2_5_vl' or 'qwen3_vl', got {family!r}")
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]
    )
    model.eval().save_pretrained(out_dir)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=(2 * patch) ** 2,
        max_pixels=(4 * patch) ** 2,
    )
    _save_qwen_processor_parts(out_dir, tok, image_processor)
    return out_dir


TINY = {
    "qwen_vl_2_5": make_tiny_qwen_vl,
    "qwen_vl_3": lambda out_dir: make_tiny_qwen_vl(out_dir, "qwen3_vl"),
}
