"""The tiny random-init Stable Diffusion 3.5, saved as a local checkpoint.

No machine here can download weights, so every family gets a tiny model built from the REAL diffusers /
transformers classes (2 layers, hidden 16-64) with tokenizers built in memory, saved with
`save_pretrained` and loaded back through the same `from_pretrained` path a real checkpoint takes.
Weights are random but seeded, so a tiny model is the same on every machine and every build. Each family's
`tiny.py` names its checkpoints in `TINY` (name -> builder of `out_dir`): the family's name, or
`<family>_<layout>` for another layout of the same family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnirl.models.tokenizers import clip_tokenizer, t5_tokenizer


def tiny_t5_config(tokenizer) -> dict:
    """The tiny T5 / UMT5 text encoder's config (SD3's third encoder, Wan's only one) for `tokenizer`."""
    return dict(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_vae_config(scaling_factor: float, shift_factor: float) -> dict[str, Any]:
    """The tiny `AutoencoderKL` of SD3 and FLUX, which share its layout: no quant convs, latents /
    scaling_factor + shift_factor (the family's real values). 2 blocks: 2x downsampling (the real ones have 4
    blocks, 8x). Cheap to decode on CPU, and 32 px images give 16x16 latents, the size at which the
    quickstart was measured to learn."""
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_clip_config(tokenizer, hidden_size: int, **extra: Any) -> dict[str, Any]:
    """The tiny CLIP text tower's config (SD3's two encoders, FLUX's pooled one) for `tokenizer`: 2 layers of
    `hidden_size`, the tokenizer's special ids (the pooled output is read at the first EOS token)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


TINY_SD3_TRANSFORMER: dict[str, Any] = dict(
    sample_size=16,  # the pipeline's default size: 16 latents * 8 = 128 pixels
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,  # = T5 d_model
    caption_projection_dim=64,
    pooled_projection_dim=64,  # = 2 x CLIP projection_dim
    pos_embed_max_size=64,  # up to 64x64 patches = 1024 pixels
    qk_norm="rms_norm",
    dual_attention_layers=(0,),
)


def make_tiny_sd3(out_dir: str | Path) -> Path:
    """A tiny Stable Diffusion 3.5 (medium layout: MMDiT-X with a dual-attention block and RMS qk-norm),
    saved as a `StableDiffusion3Pipeline` checkpoint under `out_dir`.

    Sizes are chosen for a CPU RL run: the VAE downsamples 8x like the real one (4 blocks), so a
    128x128 image is a 4x16x16 latent, i.e. 64 image tokens after the 2x2 patch embedding; the text
    sequence is CLIP 77 + T5 32 tokens (`tokenizer_3.model_max_length`, which the SD3 adapter uses as
    max_sequence_length). CLIP hidden 16 + 16 = 32 is zero-padded to the T5 width 32 as in the real
    model (768 + 1280 -> 4096); the pooled embedding is the two 32-wide CLIP projections.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    out_dir = Path(out_dir)
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(model_max_length=32)

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
    vae = AutoencoderKL(**tiny_vae_config(scaling_factor=1.5305, shift_factor=0.0609))  # SD3's real values
    clip_cfg = tiny_clip_config(clip_tok, hidden_size=16, projection_dim=32)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_3 = T5EncoderModel(T5Config(**tiny_t5_config(t5_tok)))
    # Built modules are in train mode (T5 dropout!) and pipelines never call eval(): do it here.
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3.eval(),
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


TINY = {"sd3": make_tiny_sd3}
