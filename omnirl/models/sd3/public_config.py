"""Stable Diffusion 3.5 Medium's public configs, for a config-only checkpoint with random weights.

Each is passed as keyword arguments to its diffusers / transformers class: an unknown key is a TypeError
(`random_init.checked` makes it one for transformers' configs too), so the names are checked against the
installed libraries whenever a checkpoint is written. `RANDOM` names the checkpoints this family writes
(`omnirl.models.write_random_checkpoint`): each a function of the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnirl.models.random_init import checked, dump
from omnirl.models.tokenizers import clip_tokenizer, t5_tokenizer

# stabilityai/stable-diffusion-3.5-medium.
SD35_TRANSFORMER: dict[str, Any] = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip
SD35_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip
SD35_CLIP_L: dict[str, Any] = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
)  # fmt: skip
SD35_CLIP_G: dict[str, Any] = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, projection_dim=1280, hidden_act="gelu",
)  # fmt: skip
SD35_T5: dict[str, Any] = dict(  # T5-XXL v1.1, encoder only
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)  # fmt: skip
SD35_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def write_random(out: Path) -> None:
    """SD3.5 Medium's config-only checkpoint, with the byte-level CLIP and character-level T5 tokenizers."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, T5Config

    (out / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with torch.device("meta"):
        dump(out, "transformer", dict(SD3Transformer2DModel(**SD35_TRANSFORMER).config))
        dump(out, "vae", dict(AutoencoderKL(**SD35_VAE).config))
    clip = clip_tokenizer()
    # The tiny tokenizer's special ids (CLIP pools at the first EOS token); the embeddings keep the
    # real vocabulary size, so the parameter count is the real one.
    ids = dict(bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id)
    checked(CLIPTextConfig, **SD35_CLIP_L, **ids).save_pretrained(out / "text_encoder")
    checked(CLIPTextConfig, **SD35_CLIP_G, **ids).save_pretrained(out / "text_encoder_2")
    checked(T5Config, **SD35_T5).save_pretrained(out / "text_encoder_3")
    clip.save_pretrained(out / "tokenizer")
    clip_tokenizer().save_pretrained(out / "tokenizer_2")
    t5_tokenizer(model_max_length=512).save_pretrained(out / "tokenizer_3")  # the pipeline uses 256
    dump(out, "scheduler", {})
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD35_SCHEDULER))


RANDOM = {"sd3": write_random}
