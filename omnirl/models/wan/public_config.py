"""Wan2.2's public configs (TI2V-5B, T2V-A14B), for config-only checkpoints with random weights.

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
from omnirl.models.tokenizers import t5_tokenizer

# Wan-AI/Wan2.2-TI2V-5B-Diffusers and Wan-AI/Wan2.2-T2V-A14B-Diffusers, from memory of their config.json
# files and of diffusers' scripts/convert_wan_to_diffusers.py (neither is in the wheel, and nothing can be
# downloaded here); the class names are checked by the installed classes. TI2V-5B: dim 3072 (24 heads of
# 128), 30 layers, FFN 14336, 48 latent channels; each A14B expert has Wan2.1-14B's shape (dim 5120, 40
# heads, 40 layers, FFN 13824, 16 channels: WanTransformer3DModel's defaults).
WAN22_TI2V_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
    text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
WAN22_A14B_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# The "Wan2.2 VAE" of TI2V-5B: 16x spatial (a 2x2 pixel patchify in front of an 8x VAE), 4x temporal, 48
# channels, residual down blocks, a wider decoder. The 48 latents_mean / latents_std values are those of
# Wan2.2's wan/modules/vae2_2.py as remembered: they only scale the latents, which changes no shape or
# cost; a mistake there would not show in any measurement.
WAN22_VAE: dict[str, Any] = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    latents_std=[
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
)  # fmt: skip
# A14B's VAE is Wan2.1's: AutoencoderKLWan's defaults (z 16, 8x spatial, 4x temporal).
WAN21_VAE: dict[str, Any] = {}
WAN_UMT5: dict[str, Any] = dict(  # google/umt5-xxl, encoder only (the checkpoints' text_encoder)
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)  # fmt: skip
# The checkpoints ship UniPC with flow sigmas (the adapter samples with the Euler flow step on
# family.flow_shift, so this only completes the checkpoint). flow_shift: 5.0 for TI2V-5B (its 720p
# setting); A14B's diffusers scheduler_config is remembered as 3.0, but not surely (Wan2.2's own
# t2v_A14B config samples with shift 12.0): the recipe's family.flow_shift is what runs either way.
WAN_SCHEDULER = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction", "use_flow_sigmas": True, "solver_order": 2, "predict_x0": True,
    "solver_type": "bh2", "lower_order_final": True, "timestep_spacing": "linspace",
}  # fmt: skip
# model_index.json fields: A14B switches experts at boundary_ratio 0.875 (T2V; I2V-A14B has 0.9); TI2V-5B
# has no transformer_2 and gives the timestep per latent token (expand_timesteps).
WAN22: dict[str, dict[str, Any]] = {
    "wan_ti2v": dict(transformer=WAN22_TI2V_TRANSFORMER, vae=WAN22_VAE, flow_shift=5.0,
                       boundary_ratio=None, expand_timesteps=True, experts=("transformer",)),
    "wan_a14b": dict(transformer=WAN22_A14B_TRANSFORMER, vae=WAN21_VAE, flow_shift=3.0,
                       boundary_ratio=0.875, expand_timesteps=False,
                       experts=("transformer", "transformer_2")),
}  # fmt: skip


def write_random(out: Path, model: str) -> None:
    """Wan2.2's config-only checkpoint of the layout `model` (a key of WAN22), with the character-level
    tokenizer."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config

    w = WAN22[model]
    index = {"_class_name": "WanPipeline", "boundary_ratio": w["boundary_ratio"],
             "expand_timesteps": w["expand_timesteps"], "transformer_2": [None, None]}  # fmt: skip
    with torch.device("meta"):
        for name in w["experts"]:
            dump(out, name, dict(WanTransformer3DModel(**w["transformer"]).config))
            index[name] = ["diffusers", "WanTransformer3DModel"]
        dump(out, "vae", dict(AutoencoderKLWan(**w["vae"]).config))
    (out / "model_index.json").write_text(json.dumps(index))
    # The tiny character-level tokenizer (UMT5's SentencePiece model is not in any wheel): a prompt is
    # about one token per character instead of ~1 per word, but every prompt is zero-padded to the
    # pipeline's 512 tokens and all 512 enter the cross-attention, so the transformer's cost is the
    # real one; only prompts longer than 512 characters are cut shorter than real.
    tokenizer = t5_tokenizer(model_max_length=512)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    checked(UMT5Config, **WAN_UMT5, **ids).save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    dump(out, "scheduler", {})
    scheduler = {**WAN_SCHEDULER, "flow_shift": w["flow_shift"]}
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))


RANDOM = {name: (lambda out, name=name: write_random(out, name)) for name in WAN22}
