"""The tiny random-init Wan2.2 in its two layouts, saved as local checkpoints (see omnirl.models.sd3.tiny)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl.models.sd3.tiny import tiny_t5_config
from omnirl.models.tokenizers import t5_tokenizer


def make_tiny_wan(out_dir: str | Path, layout: str = "ti2v") -> Path:
    """A tiny Wan2.2, saved as a `WanPipeline` checkpoint under `out_dir`, in one of the two layouts:
    "ti2v" (TI2V-5B: one transformer, `expand_timesteps`, per-token timesteps) or "a14b" (T2V-A14B: a
    high-noise `transformer` above `boundary_ratio` 0.875 and a low-noise `transformer_2` below it).

    The VAE downsamples like the real one, 8x in space and 4x in time (`dim_mult=[1,1,2,2]`,
    `temperal_downsample=[False,True,True]`), so 9 frames of 32x32 pixels are 3 latent frames of 4x4,
    i.e. 12 tokens after the transformer's 1x2x2 patches. The text encoder is a UMT5 of d_model 32 (the
    transformer's `text_dim`) with a character-level tokenizer of 32 tokens (the adapter's
    max_sequence_length). The scheduler is the flow-matching Euler one with Wan's shift 5.0 (the real
    checkpoints ship UniPC; the adapter samples with the Euler flow step, see omnirl/models/wan/adapter.py).
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if layout not in ("ti2v", "a14b"):
        raise ValueError(f"layout must be 'ti2v' or 'a14b', got {layout!r}")
    out_dir = Path(out_dir)
    tokenizer = t5_tokenizer(model_max_length=32)
    torch.manual_seed(0)

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=32,  # = UMT5 d_model
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval()

    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    )
    text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(tokenizer)))  # UMT5 takes T5's keys
    experts = {"transformer": transformer()}
    if layout == "a14b":
        experts["transformer_2"] = transformer()
    # Built modules are in train mode (UMT5 dropout!) and pipelines never call eval(): do it here.
    pipe = WanPipeline(
        tokenizer=tokenizer,  # pyright: ignore[reportArgumentType] (typed as the AutoTokenizer factory)
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        boundary_ratio=0.875 if layout == "a14b" else None,
        expand_timesteps=layout == "ti2v",
        **experts,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


TINY = {"wan_ti2v": make_tiny_wan, "wan_a14b": lambda out_dir: make_tiny_wan(out_dir, "a14b")}
