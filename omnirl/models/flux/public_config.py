"""FLUX.1-dev's public configs (black-forest-labs/FLUX.1-dev: its transformer, VAE and scheduler
config.json files; the text encoders are CLIP ViT-L/14's text tower and T5-XXL v1.1's encoder, as SD3.5's)
and its config-only checkpoint (`write_random`). `RANDOM` names the checkpoints this family writes
(`omnirl.models.write_random_checkpoint`): each a function of the output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

FLUX1_DEV_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip
FLUX1_DEV_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip
FLUX1_DEV_SCHEDULER: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
    "use_dynamic_shifting": True,
}  # fmt: skip


def write_random(out: Path) -> None:
    """A config-only FLUX.1-dev checkpoint at `out` (no weights), with the tiny byte-level tokenizers of
    omnirl.models.tokenizers: a prompt is about a token per character instead of per word, but T5's are padded
    to the pipeline's 512 tokens and all of them enter the transformer, so its cost is the real one."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, T5Config

    from omnirl.models.random_init import checked, dump
    from omnirl.models.sd3.public_config import SD35_CLIP_L, SD35_T5
    from omnirl.models.tokenizers import clip_tokenizer, t5_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5Tokenizer"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }  # fmt: skip
    (out / "model_index.json").write_text(json.dumps(index))
    with torch.device("meta"):  # built on meta only to read the configs the classes complete
        dump(out, "transformer", dict(FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER).config))
        dump(out, "vae", dict(AutoencoderKL(**FLUX1_DEV_VAE).config))
    clip = clip_tokenizer()
    # The tiny tokenizer's special ids (CLIP pools at the first EOS token); the embeddings keep the real
    # vocabulary size, so the parameter count is the real one.
    ids = dict(bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id)
    checked(CLIPTextConfig, **SD35_CLIP_L, **ids).save_pretrained(out / "text_encoder")
    checked(T5Config, **SD35_T5).save_pretrained(out / "text_encoder_2")
    clip.save_pretrained(out / "tokenizer")
    t5_tokenizer(model_max_length=512).save_pretrained(out / "tokenizer_2")
    dump(out, "scheduler", {})
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(FLUX1_DEV_SCHEDULER))


RANDOM = {"flux": write_random}
