"""LTX-2.3's public configs, for a config-only checkpoint with random weights.

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

from omnirl.models.random_init import dump
from omnirl.models.tokenizers import gemma_tokenizer

# Lightricks/LTX-2.3 (diffusers layout), from diffusers' scripts/convert_ltx2_to_diffusers.py (version
# "2.3"; not in the wheel): the 22B audio-video DiT (48 blocks; video 32 heads of 128, audio 32 of 64;
# gated attention, prompt modulation by sigma, split RoPE), the per-modality text connectors (8 layers
# each), the video VAE (32x spatial, 8x temporal, 128 channels), the audio VAE and the vocoder with its
# bandwidth extension to 48 kHz. The text encoder is Gemma-3 12B (google/gemma-3-12b-it: 48 layers of
# 3840, 16 heads of 256, 8 KV heads, a SigLIP vision tower that text prompts never run), as remembered.
LTX23_TRANSFORMER: dict[str, Any] = dict(
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
    attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
    base_height=2048, base_width=2048, gated_attn=True, cross_attn_mod=True, audio_in_channels=128,
    audio_out_channels=128, audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=32,
    audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_scale_factor=4,
    audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, audio_gated_attn=True,
    audio_cross_attn_mod=True, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840, attention_bias=True,
    attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    use_prompt_embeddings=False, perturbed_attn=True,
)  # fmt: skip
LTX23_CONNECTORS: dict[str, Any] = dict(
    caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=32,
    video_connector_attention_head_dim=128, video_connector_num_layers=8,
    video_connector_num_learnable_registers=128, video_gated_attn=True,
    audio_connector_num_attention_heads=32,
    audio_connector_attention_head_dim=64, audio_connector_num_layers=8,
    audio_connector_num_learnable_registers=128, audio_gated_attn=True, connector_rope_base_seq_len=4096,
    rope_theta=10000.0, rope_double_precision=True, causal_temporal_positioning=False, rope_type="split",
    per_modality_projections=True, video_hidden_dim=4096, audio_hidden_dim=2048, proj_bias=True,
)  # fmt: skip
LTX23_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(256, 512, 1024, 1024),
    down_block_types=("LTX2VideoDownBlock3D",) * 4, decoder_block_out_channels=(256, 512, 512, 1024),
    layers_per_block=(4, 6, 4, 2, 2), decoder_layers_per_block=(4, 6, 4, 2, 2),
    spatio_temporal_scaling=(True,) * 4, decoder_spatio_temporal_scaling=(True,) * 4,
    decoder_inject_noise=(False,) * 5,
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
    upsample_residual=(False,) * 4,
    upsample_factor=(2, 2, 1, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1,
    resnet_norm_eps=1e-6, encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="zeros", spatial_compression_ratio=32, temporal_compression_ratio=8,
)  # fmt: skip
LTX23_AUDIO_VAE: dict[str, Any] = dict(
    base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, attn_resolutions=None,
    in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height", dropout=0.0,
    mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=64,
    double_z=True,
)  # fmt: skip
LTX23_VOCODER: dict[str, Any] = dict(
    in_channels=128, hidden_channels=1536, out_channels=2, upsample_kernel_sizes=[11, 4, 4, 4, 4, 4],
    upsample_factors=[5, 2, 2, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11],
    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], act_fn="snakebeta", leaky_relu_negative_slope=0.1,
    antialias=True, antialias_ratio=2, antialias_kernel_size=12, final_act_fn=None, final_bias=False,
    bwe_in_channels=128, bwe_hidden_channels=512, bwe_out_channels=2,
    bwe_upsample_kernel_sizes=[12, 11, 4, 4, 4],
    bwe_upsample_factors=[6, 5, 2, 2, 2], bwe_resnet_kernel_sizes=[3, 7, 11],
    bwe_resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], bwe_act_fn="snakebeta",
    bwe_leaky_relu_negative_slope=0.1, bwe_antialias=True, bwe_antialias_ratio=2,
    bwe_antialias_kernel_size=12,
    bwe_final_act_fn=None, bwe_final_bias=False, filter_length=512, hop_length=80, window_length=512,
    num_mel_channels=64, input_sampling_rate=16000, output_sampling_rate=48000,
)  # fmt: skip
LTX23_GEMMA3_TEXT: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=1024, max_position_embeddings=131072,
)  # fmt: skip
LTX23_GEMMA3_VISION: dict[str, Any] = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
    patch_size=14,
)  # fmt: skip
LTX2_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 1024, "base_shift": 0.95,
    "max_image_seq_len": 4096, "max_shift": 2.05, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.1, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip


def write_random(out: Path) -> None:
    """LTX-2.3's config-only checkpoint, with the character-level Gemma tokenizer."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
    from transformers import Gemma3Config

    index = {
        "_class_name": "LTX2Pipeline", "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLLTX2Video"],
        "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
        "vocoder": ["ltx2", "LTX2VocoderWithBWE"], "connectors": ["ltx2", "LTX2TextConnectors"],
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }  # fmt: skip
    (out / "model_index.json").write_text(json.dumps(index))
    with torch.device("meta"):
        dump(out, "transformer", dict(LTX2VideoTransformer3DModel(**LTX23_TRANSFORMER).config))
        dump(out, "connectors", dict(LTX2TextConnectors(**LTX23_CONNECTORS).config))
        dump(out, "vae", dict(AutoencoderKLLTX2Video(**LTX23_VAE).config))
        dump(out, "audio_vae", dict(AutoencoderKLLTX2Audio(**LTX23_AUDIO_VAE).config))
        dump(out, "vocoder", dict(LTX2VocoderWithBWE(**LTX23_VOCODER).config))
    # The tiny character-level Gemma tokenizer: every prompt is padded to the pipeline's 1024 tokens and
    # all of them run through Gemma and the connectors, so the cost is the real one.
    tokenizer = gemma_tokenizer()
    tokenizer.model_max_length = 1024
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    te = Gemma3Config(
        text_config={**LTX23_GEMMA3_TEXT, **ids},
        vision_config=LTX23_GEMMA3_VISION,
        mm_tokens_per_image=256,
    )
    te.save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    dump(out, "scheduler", {})
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(LTX2_SCHEDULER))


RANDOM = {"ltx2": write_random}
