"""The tiny random-init LTX-2.3 (text to video + audio), saved as an `LTX2Pipeline` checkpoint.

Every component is the real class in LTX-2.3's layout, shrunk: the transformer with LTX-2.3's gated
attention, cross-attention modulation (so its `sigma` / `audio_sigma` inputs matter) and split RoPE, no
caption projection (the connectors project per modality); the text connectors with per-modality
projections; a Gemma-3 text encoder (`Gemma3ForConditionalGeneration`, the real one's class) of hidden 16
with a character-level Gemma tokenizer built in memory; the video VAE with the real 32x spatial and 8x
temporal compression; the audio VAE (4x in time and in mel bins) and the HiFi-GAN vocoder.

Sizes: 9 frames of 64x64 pixels are 2 latent frames of 2x2 (8 video tokens of 8 channels); at 24 fps they
last 0.375 s, i.e. round(0.375 x 16000 / 160 / 4) = 9 audio latent frames of 2 channels x 4 mel bins
(9 audio tokens of 8 features). The vocoder makes 16 kHz stereo from 16 mel bins; its biases are zero, so
the track's level follows the latents (the tiny recipe's `audio_loudness` reward can move it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnirl.models.tokenizers import gemma_tokenizer

TINY_LTX2_TRANSFORMER: dict[str, Any] = dict(
    in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
    cross_attention_dim=16, audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2,
    audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
    gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
    use_prompt_embeddings=False, perturbed_attn=True, rope_type="split", rope_double_precision=True,
)  # fmt: skip
MAX_SEQUENCE_LENGTH = 16


def make_tiny_ltx2(out_dir: str | Path) -> Path:
    """Write the tiny LTX-2.3 checkpoint to `out_dir` (the module docstring) and return its path."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer = gemma_tokenizer(MAX_SEQUENCE_LENGTH)
    torch.manual_seed(0)
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=64,
                sliding_window=16,
            ),
            # The vision tower is never run for text prompts; the class needs one.
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
        )  # fmt: skip
    )
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3,  # Gemma's hidden size; its layers + the embeddings
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=4, video_gated_attn=True,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=4, audio_gated_attn=True,
        connector_rope_base_seq_len=32, rope_type="split", per_modality_projections=True,
        video_hidden_dim=16, audio_hidden_dim=8, proj_bias=True,
    )  # fmt: skip
    transformer = LTX2VideoTransformer3DModel(**TINY_LTX2_TRANSFORMER)
    vae = AutoencoderKLLTX2Video(  # LTX-2.3's block layout (32x spatial, 8x temporal), 8-32 channels
        latent_channels=8, block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(8, 16, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True,) * 4, decoder_spatio_temporal_scaling=(True,) * 4,
        decoder_inject_noise=(False,) * 5,
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
        upsample_residual=(False,) * 4, upsample_factor=(2, 2, 1, 2), decoder_spatial_padding_mode="zeros",
        spatial_compression_ratio=32, temporal_compression_ratio=8,
    )  # fmt: skip
    # Latent statistics that are not 0 / 1, so that a missing (de)normalisation shows.
    vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, 8))
    vae.latents_std.copy_(torch.linspace(0.8, 1.2, 8))
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=8, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, in_channels=2, resolution=16,
        latent_channels=2, mel_bins=16,
    )  # fmt: skip
    audio_vae.latents_mean.copy_(torch.linspace(-0.1, 0.1, 8))  # [latent channels x latent mel bins]
    audio_vae.latents_std.copy_(torch.linspace(0.9, 1.1, 8))
    vocoder = LTX2Vocoder(
        in_channels=2 * 16, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[20, 8, 8],
        upsample_factors=[10, 4, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]],
        output_sampling_rate=16000,
    )  # fmt: skip
    # No biases in the vocoder: random ones add a constant offset to the waveform that swamps what the mel
    # spectrogram makes (a track at -79 dBFS, 0.06 dB apart between samples), so the audio's level could
    # not follow the latents; without them it does (about -65 dBFS, 1 dB apart).
    with torch.no_grad():
        for name, p in vocoder.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-2's: exponential dynamic shift, terminal 0.1
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1, time_shift_type="exponential",
    )  # fmt: skip
    # Built modules are in train mode and pipelines never call eval(): do it here.
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae.eval(),
        audio_vae=audio_vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        connectors=connectors.eval(),
        transformer=transformer.eval(),
        vocoder=vocoder.eval(),
    )
    pipe.save_pretrained(out_dir)
    return out_dir


TINY = {"ltx2": make_tiny_ltx2}
