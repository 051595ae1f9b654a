"""Qwen-Image's public configs (Qwen/Qwen-Image), for a config-only checkpoint with random weights.

Each is passed as keyword arguments to its diffusers / transformers class: an unknown key is a TypeError
(`random_init.checked` makes it one for transformers' configs too), so the names are checked against the
installed libraries whenever a checkpoint is written. `RANDOM` names the checkpoints this family writes
(`omnirl.models.write_random_checkpoint`): each a function of the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnirl.models.random_init import dump
from omnirl.models.tokenizers import edit_tokenizer, qwen_bpe_tokenizer, qwen_image_tokenizer

QWEN_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip

# The Qwen2.5-VL config fields naming the special tokens of a condition image.
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
}  # fmt: skip


def write_random(out: Path, qwen_bpe: str | Path | None = None, edit: bool = False) -> None:
    """Qwen-Image's (`edit`: Qwen-Image-Edit's) config-only checkpoint, with the byte-level tokenizer
    (`edit_tokenizer` for Qwen-Image-Edit, whose processor/ also holds the real image processor's settings:
    a 512 px condition image is 324 vision tokens, as with the real checkpoint). `qwen_bpe`: the path of
    Qwen's `qwen.tiktoken`, for the real tokenizer (`qwen_bpe_tokenizer`)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pipeline = "QwenImageEditPipeline" if edit else "QwenImagePipeline"
    (out / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    # Qwen-Image-Edit's transformer, VAE and text encoder have Qwen-Image's shapes.
    with torch.device("meta"):  # the defaults are Qwen-Image's; built on meta only to read the config
        dump(out, "transformer", dict(QwenImageTransformer2DModel().config))
        dump(out, "vae", dict(AutoencoderKLQwenImage().config))
    if qwen_bpe:
        tokenizer = qwen_bpe_tokenizer(qwen_bpe)
    else:
        tokenizer = edit_tokenizer() if edit else qwen_image_tokenizer()
    # The edit text encoder finds the condition image's tokens by these ids: the tokenizer's own.
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in VISION_TOKENS.items()} if edit else {}
    te = Qwen2_5_VLConfig(  # Qwen2.5-VL-7B-Instruct
        text_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
        ),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        **{"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, **ids},
    )  # fmt: skip
    te.save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    if edit:  # the pipeline tokenizes with its processor's tokenizer; Qwen-Image-Edit's image processor
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16384).save_pretrained(
            out / "processor"
        )
        tokenizer.save_pretrained(out / "processor")
    dump(out, "scheduler", {})
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_SCHEDULER))


RANDOM = {"qwen_image": write_random}
