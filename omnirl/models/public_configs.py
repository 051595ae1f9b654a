"""The public configs of the full-size models, for `omnirl.models.random_init`'s config-only checkpoints.

Each is passed as keyword arguments to its diffusers / transformers class: an unknown key is a TypeError
(`checked` makes it one for transformers' configs too), so the names are checked against the
installed libraries whenever a checkpoint is written. The scheduler configs are written as the
checkpoints' scheduler_config.json.
"""

from __future__ import annotations

from typing import Any


def checked(cls, **kwargs):
    """`cls(**kwargs)` for a transformers config, refusing a key that the default config lacks (the class
    would keep it as a stray attribute and build the model without it)."""
    unknown = set(kwargs) - set(cls().to_dict())
    if unknown:
        raise TypeError(f"{cls.__name__} takes no {sorted(unknown)}")
    return cls(**kwargs)


# ByteDance-Seed/BAGEL-7B-MoT's llm_config.json: the Qwen2-7B shape (its generation copy doubles every
# layer's weights: 14 B parameters in all), q/k norms, and its latent position table of side 64 (the
# official app's max_latent_size). The autoencoder is FLUX's (omnirl.models.bagel_port.FLUX_VAE).
BAGEL_7B_MOT_LLM: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip

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
QWEN_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip

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
    "wan22_ti2v": dict(transformer=WAN22_TI2V_TRANSFORMER, vae=WAN22_VAE, flow_shift=5.0,
                       boundary_ratio=None, expand_timesteps=True, experts=("transformer",)),
    "wan22_a14b": dict(transformer=WAN22_A14B_TRANSFORMER, vae=WAN21_VAE, flow_shift=3.0,
                       boundary_ratio=0.875, expand_timesteps=False,
                       experts=("transformer", "transformer_2")),
}  # fmt: skip


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
