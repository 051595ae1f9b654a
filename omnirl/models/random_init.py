"""Full-size models with random weights, for measurements that must run without downloads.

`write_random_checkpoint` writes a config-only checkpoint of the public configs (with the tiny byte-level
tokenizers of omnirl.models.tiny, or `edit_tokenizer` for Qwen-Image-Edit; for the Qwen-Image families the
real Qwen2 BPE when its ranks are given: `qwen_bpe_tokenizer`). With model.weights random,
`omnirl.models.build_adapter` builds the adapter under `random_weights`: every model the adapter loads
through `omnirl.distributed.load_pretrained` is then built by `random_init_loader` from its config, directly
in its dtype on the device (a sharded run's policy on the host), with random weights seeded per model, so
every rank builds the same ones. Any family gets this by loading each of its models through
`load_pretrained`; `BUILD_HOOKS` lets a measuring script see each build.
`write_random_thinker` saves a random-init Qwen3-Omni thinker of a given text-model shape, or only its
config (`weights=False`: then `random_init_loader` builds it in the run itself, with no checkpoint on disk).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from omnirl.config import Config

# ---------------------------------------------------------------------------------------------- models

# ByteDance-Seed/BAGEL-7B-MoT's llm_config.json: the Qwen2-7B shape (its generation copy doubles every
# layer's weights: 14 B parameters in all), q/k norms, and its latent position table of side 64 (the
# official app's max_latent_size). The autoencoder is FLUX's (omnirl.models.bagel_port.FLUX_VAE).
BAGEL_7B_MOT_LLM: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip

# stabilityai/stable-diffusion-3.5-medium, passed as keyword arguments to the classes: an unknown key is a
# TypeError (`checked` makes it one for transformers' configs too), so the names are checked against the
# installed diffusers / transformers.
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

# The Qwen2.5-VL config fields naming the special tokens of a condition image.
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
}  # fmt: skip
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
]  # fmt: skip


def _bpe(piece: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """`piece` split into the tokens of a byte-level BPE with merge `ranks` (lowest rank merged first)."""
    parts = list(piece)
    while len(parts) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def edit_tokenizer():
    """A byte-level Qwen2 BPE that spells every word and mark of Qwen-Image-Edit's prompt template as one
    token, as the real tokenizer does: the template's prefix is then 64 tokens, exactly what the edit
    pipeline drops (`prompt_template_encode_start_idx`), so a prompt's text length is the real one's (the
    condition image's vision tokens plus the instruction at about one token per byte plus a few template
    tokens). The tiny tokenizers would leave ~150 template tokens in every text (tiny.py's edit one has no
    merges at all), past the recipe's largest prompt-length bucket."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    # The installed pipeline's own template (a pipeline of no modules only sets its fields).
    none: dict[str, Any] = dict.fromkeys(
        ["scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer"]
    )
    template = QwenImageEditPipeline(**none).prompt_template_encode
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pre = Qwen2Tokenizer(vocab=dict(vocab), merges=[]).backend_tokenizer.pre_tokenizer
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for chunk in re.split(r"<\|[a-z_]+\|>|\{\}", template):
        for piece, _ in pre.pre_tokenize_str(chunk):
            parts = _bpe(piece, ranks)
            while len(parts) > 1:  # merge what the earlier merges left, left to right
                pair = (parts[0], parts[1])
                ranks[pair] = len(merges)
                merges.append(pair)
                vocab.setdefault(pair[0] + pair[1], len(vocab))
                parts[:2] = [pair[0] + pair[1]]
    vocab.update({s: len(vocab) + i for i, s in enumerate(QWEN_SPECIALS)})
    # transformers annotates `merges` as strings; tokenizers' BPE, which it passes them to, takes pairs.
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=cast(Any, merges), pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return tokenizer


# Qwen2's special tokens from id 151643 on, in order (the real tokenizer_config.json of Qwen2.5-VL): the ids
# the text encoder config names (image_token_id 151655 and so on) are then the tokenizer's own.
QWEN2_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip


def qwen_bpe_tokenizer(ranks_file: str | Path):
    """The real Qwen2 tokenizer (Qwen2.5-VL's, the one Qwen-Image's pipelines use), built offline from the
    byte-level BPE ranks of Qwen's `qwen.tiktoken` (151,643 tokens; Qwen2 kept Qwen's vocabulary), which the
    `dashscope` wheel ships in `dashscope/resources/`. Prompt lengths then are the real ones: the tiny
    byte-level tokenizers spend a token per byte, several times the real count for English prompts, which
    inflates every text row and misleads the choice of prompt-length buckets.

    The merges are derived from the ranks as transformers' `TikTokenConverter` derives them (every split of
    a token into two tokens, in rank order). Checked against `tiktoken` itself with the Qwen2 pre-tokenizer
    pattern on the benchmark's prompts, the OCR prompt set, digits, punctuation and non-Latin scripts: equal
    ids (benchmarks/RESULTS.md)."""
    import base64

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks: dict[bytes, int] = {}
    for line in Path(ranks_file).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    single = sum(len(t) == 1 for t in ranks)
    if sorted(ranks.values()) != list(range(len(ranks))) or single != 256:
        raise ValueError(
            f"{ranks_file}: not byte-level BPE ranks (need ranks 0..n-1 and all 256 single bytes, got "
            f"{len(ranks)} ranks, {single} single bytes); Qwen's qwen.tiktoken has 151643 ranks"
        )
    byte_char = bytes_to_unicode()  # the byte-level alphabet: byte -> printable character

    def spell(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    merges = []  # (rank of the merged token, left, right)
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = sorted((ranks[l], ranks[r], l, r) for l, r in splits if l in ranks and r in ranks)
        merges += [(rank, l, r) for _, _, l, r in splits]
    merges.sort(key=lambda m: m[0])
    vocab = {spell(t): r for t, r in ranks.items()}
    vocab.update({s: len(ranks) + i for i, s in enumerate(QWEN2_SPECIALS)})
    pairs = [(spell(l), spell(r)) for _, l, r in merges]  # pairs, as tokenizers' BPE takes them (see above)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=cast(Any, pairs), pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_SPECIALS[1:]})
    return tokenizer


def checked(cls, **kwargs):
    """`cls(**kwargs)` for a transformers config, refusing a key that the default config lacks (the class
    would keep it as a stray attribute and build the model without it)."""
    unknown = set(kwargs) - set(cls().to_dict())
    if unknown:
        raise TypeError(f"{cls.__name__} takes no {sorted(unknown)}")
    return cls(**kwargs)


def write_random_checkpoint(model: str, out: Path, qwen_bpe: str | Path | None = None) -> None:
    """A config-only checkpoint of the public configs, with the tiny byte-level tokenizers of tiny.py
    (`edit_tokenizer` for "qwen_image_edit", whose processor/ also holds the real image processor's
    settings: a 512 px condition image is 324 vision tokens, as with the real checkpoint). `qwen_bpe`: the
    path of Qwen's `qwen.tiktoken`, for the real tokenizer of the Qwen-Image families
    (`qwen_bpe_tokenizer`)."""
    from omnirl.models import tiny

    if qwen_bpe and model not in ("qwen_image", "qwen_image_edit"):
        raise ValueError(f"the Qwen BPE tokenizer is for the Qwen-Image families, not {model!r}")

    def dump(sub: str, cfg: dict) -> None:
        (out / sub).mkdir(parents=True, exist_ok=True)
        (out / sub / "config.json").write_text(json.dumps(cfg))

    out.mkdir(parents=True, exist_ok=True)
    if model in ("qwen_image", "qwen_image_edit"):
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        edit = model == "qwen_image_edit"
        pipeline = "QwenImageEditPipeline" if edit else "QwenImagePipeline"
        (out / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        # Qwen-Image-Edit's transformer, VAE and text encoder have Qwen-Image's shapes.
        with torch.device("meta"):  # the defaults are Qwen-Image's; built on meta only to read the config
            dump("transformer", dict(QwenImageTransformer2DModel().config))
            dump("vae", dict(AutoencoderKLQwenImage().config))
        if qwen_bpe:
            tokenizer = qwen_bpe_tokenizer(qwen_bpe)
        else:
            tokenizer = edit_tokenizer() if edit else tiny._qwen_image_tokenizer()
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
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_SCHEDULER))
    elif model == "sd35":
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextConfig, T5Config

        (out / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
        with torch.device("meta"):
            dump("transformer", dict(SD3Transformer2DModel(**SD35_TRANSFORMER).config))
            dump("vae", dict(AutoencoderKL(**SD35_VAE).config))
        clip = tiny._clip_tokenizer()
        # The tiny tokenizer's special ids (CLIP pools at the first EOS token); the embeddings keep the
        # real vocabulary size, so the parameter count is the real one.
        ids = dict(
            bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id
        )
        checked(CLIPTextConfig, **SD35_CLIP_L, **ids).save_pretrained(out / "text_encoder")
        checked(CLIPTextConfig, **SD35_CLIP_G, **ids).save_pretrained(out / "text_encoder_2")
        checked(T5Config, **SD35_T5).save_pretrained(out / "text_encoder_3")
        clip.save_pretrained(out / "tokenizer")
        tiny._clip_tokenizer().save_pretrained(out / "tokenizer_2")
        tiny._t5_tokenizer(model_max_length=512).save_pretrained(out / "tokenizer_3")  # the pipeline uses 256
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD35_SCHEDULER))
    elif model in WAN22:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5Config

        w = WAN22[model]
        index = {"_class_name": "WanPipeline", "boundary_ratio": w["boundary_ratio"],
                 "expand_timesteps": w["expand_timesteps"], "transformer_2": [None, None]}  # fmt: skip
        with torch.device("meta"):
            for name in w["experts"]:
                dump(name, dict(WanTransformer3DModel(**w["transformer"]).config))
                index[name] = ["diffusers", "WanTransformer3DModel"]
            dump("vae", dict(AutoencoderKLWan(**w["vae"]).config))
        (out / "model_index.json").write_text(json.dumps(index))
        # The tiny character-level tokenizer (UMT5's SentencePiece model is not in any wheel): a prompt is
        # about one token per character instead of ~1 per word, but every prompt is zero-padded to the
        # pipeline's 512 tokens and all 512 enter the cross-attention, so the transformer's cost is the
        # real one; only prompts longer than 512 characters are cut shorter than real.
        tokenizer = tiny._t5_tokenizer(model_max_length=512)
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        checked(UMT5Config, **WAN_UMT5, **ids).save_pretrained(out / "text_encoder")
        tokenizer.save_pretrained(out / "tokenizer")
        dump("scheduler", {})
        scheduler = {**WAN_SCHEDULER, "flow_shift": w["flow_shift"]}
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    elif model == "ltx23":
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
        from transformers import Gemma3Config

        from omnirl.models.tiny_ltx2 import gemma_tokenizer

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
            dump("transformer", dict(LTX2VideoTransformer3DModel(**LTX23_TRANSFORMER).config))
            dump("connectors", dict(LTX2TextConnectors(**LTX23_CONNECTORS).config))
            dump("vae", dict(AutoencoderKLLTX2Video(**LTX23_VAE).config))
            dump("audio_vae", dict(AutoencoderKLLTX2Audio(**LTX23_AUDIO_VAE).config))
            dump("vocoder", dict(LTX2VocoderWithBWE(**LTX23_VOCODER).config))
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
        dump("scheduler", {})
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(LTX2_SCHEDULER))
    elif model == "bagel":
        write_random_bagel(out)
    else:
        raise ValueError(f"--random-init has no configs for {model!r}")


def write_random_bagel(out: Path) -> None:
    """BAGEL-7B-MoT in the official layout without its weights: llm_config.json, an ema.safetensors holding
    only the latent position table (what its config reads; random_init_loader builds the model from the
    config), a random FLUX autoencoder in BFL layout (ae.safetensors, 84 M parameters, bfloat16) and the
    tiny byte-level Qwen2 tokenizer with the BAGEL special tokens (the embeddings keep the real
    vocabulary)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from omnirl.models import tiny
    from omnirl.models.bagel_port import FLUX_VAE, MAX_LATENT_SIZE, bfl_vae_state, sincos_2d

    llm = checked(Qwen2Config, **BAGEL_7B_MOT_LLM).to_dict()
    (out / "llm_config.json").write_text(json.dumps({**llm, "qk_norm": True}, indent=2))
    table = sincos_2d(BAGEL_7B_MOT_LLM["hidden_size"], MAX_LATENT_SIZE).to(torch.bfloat16)
    save_file({"latent_pos_embed.pos_embed": table}, out / "ema.safetensors")
    # (diffusers' and transformers' `to` is typed as the unbound `Module.to`, taking the dtype for `self`.)
    vae = AutoencoderKL(**FLUX_VAE).to(torch.bfloat16)  # pyright: ignore[reportArgumentType]
    save_file(bfl_vae_state(vae), out / "ae.safetensors")
    tiny._qwen_image_tokenizer().save_pretrained(out)


# The checkpoint subfolders that hold the diffusion adapters' policies (Wan2.2 A14B: both experts); a
# model at a checkpoint's root (no subfolder: the omni adapters' one transformers model) is a policy too.
POLICY_SUBFOLDERS = ("transformer", "transformer_2")
# A config-only thinker's build settings (write_random_thinker(weights=False)), read by random_init_loader.
RANDOM_INIT_FILE = "random_init.json"
# The random weights: torch is seeded with this plus a hash of the model's class and subfolder before each
# build, so that every rank builds the same weights, whatever it drew before, and two experts of one class
# (Wan2.2 A14B) differ.
BUILD_SEED = 1234
# Called after each build of `random_weights` as hook(cls, subfolder, model, seconds): what a measuring
# script records of the builds (scripts/gpu/phase_memory.py).
BUILD_HOOKS: list[Callable] = []


@contextlib.contextmanager
def random_weights(cfg: Config, device: torch.device):
    """While in effect, every model loaded through `omnirl.distributed.load_pretrained` is built by
    `random_init_loader` on `device`, seeded per model (`BUILD_SEED`); a run whose frozen base FSDP2 shards
    or offloads builds its policy on the host (not when `device` is meta: nothing is allocated there)."""
    from omnirl import distributed as D
    from omnirl.memory import synchronize

    on_host = cfg.distributed.frozen_base != "replicate" and device.type != "meta"
    load = random_init_loader(device, policy_on_host=on_host)

    def build(cls, path, subfolder=None, **kwargs):
        torch.manual_seed(BUILD_SEED + zlib.crc32(f"{cls.__name__}/{subfolder}".encode()))
        begin = time.perf_counter()
        model = load(cls, path, subfolder=subfolder, **kwargs)
        if BUILD_HOOKS:
            synchronize()
            for hook in BUILD_HOOKS:
                hook(cls, subfolder, model, time.perf_counter() - begin)
        return model

    with D.building_with(build):
        yield


def random_init_loader(device: torch.device, policy_on_host: bool = False):
    """What `load_pretrained` builds with under `random_weights`: each model from its config, random
    weights, on the device, with the dtypes `from_pretrained(torch_dtype=...)` leaves (`_as_loaded`). With
    `policy_on_host` the policies (`POLICY_SUBFOLDERS`, or a model at the checkpoint's root) are built on
    the host, where `from_pretrained` leaves them, for a run whose frozen base FSDP2 shards
    (distributed.frozen_base shard / offload): the adapter leaves its policy there and `fully_shard` moves
    it to the device one unit at a time (docs/memory.md). A `config` the adapter passes is used as given; a
    `RANDOM_INIT_FILE` beside the config scales the output embedding by its `head_scale` (as
    `write_random_thinker` does)."""
    from diffusers import ModelMixin

    def load(cls, path, subfolder=None, torch_dtype=None, dtype=None, config=None, **_):
        dtype = torch_dtype or dtype or torch.float32
        policy = subfolder in POLICY_SUBFOLDERS or subfolder is None
        where = torch.device("cpu") if policy_on_host and policy else device
        # Made in `dtype` (the default dtype while the modules are made, as both libraries' from_pretrained
        # do), not in float32 and cast after: Qwen-Image's 20 B-parameter transformer would pass through
        # 76 GiB of float32 on the device, more than an 80 GB device holds.
        # A host build's random draws on the accelerator (`_draws_on`): the host's generator is serial.
        drawn = _draws_on(device) if where.type == "cpu" and device.type not in ("cpu", "meta") else None
        with torch.device(where), _default_dtype(dtype), drawn or contextlib.nullcontext():
            model_cls: Any = cls  # a diffusers or transformers class: its config API is reached by name
            if issubclass(cls, ModelMixin):
                model = model_cls.from_config(model_cls.load_config(path, subfolder=subfolder))
            else:  # the config the adapter passes (it may have set fields), else the checkpoint's
                config = config or model_cls.config_class.from_pretrained(path, subfolder=subfolder)
                model = model_cls._from_config(config, dtype=dtype)
        _as_loaded(model, dtype)
        settings = Path(path, subfolder or "", RANDOM_INIT_FILE)
        if settings.is_file():
            head_scale = json.loads(settings.read_text()).get("head_scale", 1.0)
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(head_scale)
        return model.eval()

    return load


@contextlib.contextmanager
def _draws_on(device: torch.device, generator: torch.Generator | None = None, min_numel: int = 1 << 16):
    """While models are built in host memory: a large host tensor's `uniform_` / `normal_` (what every
    torch.nn.init function ends in: the modules' own `reset_parameters` and transformers' `_init_weights`)
    is drawn on `device` (from `generator`, else the device's default one) and copied back. The host's
    generator is serial, so a 20 B-parameter transformer takes minutes to build on the host
    (benchmarks/RESULTS.md); a device draws at its memory speed and the copy back is one pass over the
    host memory the build allocates anyway.
    Same distributions, the device's random stream; a call that brings its own generator, and small
    tensors, draw in place."""
    originals = {name: getattr(torch.Tensor, name) for name in ("uniform_", "normal_")}
    defined = {name: torch.Tensor.__dict__[name] for name in originals if name in torch.Tensor.__dict__}

    def drawing(original):
        def draw(self, *args, **kwargs):
            own = kwargs.pop("generator", None)
            if own is not None or self.device.type != "cpu" or self.numel() < min_numel:
                return original(self, *args, generator=own, **kwargs)
            with torch.no_grad():
                values = torch.empty(self.shape, dtype=self.dtype, device=device)
                self.copy_(original(values, *args, generator=generator, **kwargs))
            return self

        return draw

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, drawing(original))
        yield
    finally:
        for name in originals:
            if name in defined:
                setattr(torch.Tensor, name, defined[name])
            else:
                delattr(torch.Tensor, name)  # back to TensorBase's own method


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _as_loaded(model, dtype: torch.dtype) -> None:
    """Give a model built under the default dtype `dtype` the dtypes its library's `from_pretrained` would
    leave. diffusers casts every checkpoint tensor (parameters and persistent buffers, whatever dtype the
    module made them in: SD3's float32 `pos_embed`) to `dtype`, except those under `_keep_in_fp32_modules`
    (a module name among the key's dotted parts: Wan's time embedder, norms and modulation), which stay
    float32; transformers keeps each tensor's dtype as built (the float32 rotary `inv_freq`) except the
    modules of its dtype plan (`_keep_in_fp32_modules` under float16, `_keep_in_fp32_modules_strict` under
    bfloat16 too: float32). Non-persistent buffers stay as built in both."""
    from diffusers import ModelMixin

    if isinstance(model, ModelMixin):
        keep = set(model._keep_in_fp32_modules or ())

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return torch.float32 if keep & set(key.split(".")) else dtype
    else:
        plan = model._get_dtype_plan(dtype)  # glob -> dtype; transformers searches each key for the globs
        patterns = [(re.compile(glob.replace("*", ".*")), d) for glob, d in plan.items()]

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return next((d for pattern, d in patterns if pattern.search(key)), t.dtype)

    for key, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point() and t.dtype != (want := target(key, t)):
            t.data = t.data.to(want)


def write_random_thinker(
    out_dir: Path, device: torch.device, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
    head_dim: int, moe_intermediate: int, experts: int, experts_per_tok: int, dtype: str, head_scale: float,
    weights: bool = True,
) -> Path:  # fmt: skip
    """A random-init Qwen3-Omni thinker of the given text-model shape (vision / audio towers tiny: the
    prompts are text), saved as OUT_DIR/random_thinker with the tiny model's tokenizer and processor files
    in the layout of the released checkpoint (Qwen/Qwen3-Omni-30B-A3B-Instruct): a
    `Qwen3OmniMoeForConditionalGeneration` config (the tiny talker and code2wav beside this thinker) and the
    thinker's weights under `thinker.`, so that the Qwen3-Omni adapter loads it as `model.path` and vLLM
    serves it with its own Qwen3-Omni thinker class, as it serves the real model (a thinker-only config is
    not one of vLLM's architectures: it falls back to its generic transformers backend). With the keys vLLM
    reads that transformers does not save (`tiny_omni.add_vllm_config_keys`). Embedding rows beyond the
    tokenizer's vocabulary are never in a prompt but can be sampled, as with the real model. `head_scale`
    multiplies the random lm_head (a random model's output is near uniform: this sharpens it).

    `weights=False` writes the config and those files only, with `RANDOM_INIT_FILE` holding `head_scale`:
    a run whose adapter loads through `random_init_loader` then builds the thinker itself (in its dtype,
    where the frozen-base placement puts it), so the full-size thinker (61 GB in bf16) is never written,
    read back, nor built in float32."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from omnirl.distributed import DTYPES
    from omnirl.models.tiny import make_tiny_qwen3_omni
    from omnirl.models.tiny_omni import add_vllm_config_keys

    tiny = make_tiny_qwen3_omni(out_dir / "tiny")
    full = json.loads((tiny / "config.json").read_text())
    tiny_cfg = full["thinker_config"]
    text = dict(
        tiny_cfg["text_config"],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=moe_intermediate,
        num_experts=experts,
        num_experts_per_tok=experts_per_tok,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], mrope_interleaved=True
        ),
        max_position_embeddings=65536,
    )
    vision = dict(tiny_cfg["vision_config"], out_hidden_size=hidden)
    audio = dict(tiny_cfg["audio_config"], output_dim=hidden)
    ids = {k: v for k, v in tiny_cfg.items() if k.endswith("token_id")}
    config = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, **ids)
    config.dtype = DTYPES[dtype]
    path = out_dir / "random_thinker"
    path.mkdir(parents=True, exist_ok=True)
    full["thinker_config"] = config.to_dict()
    full_config = Qwen3OmniMoeConfig.from_dict({k: v for k, v in full.items() if k != "transformers_version"})
    full_config.dtype = DTYPES[dtype]
    full_config.save_pretrained(path)
    add_vllm_config_keys(path)
    _copy_processor_files(tiny, path)
    if not weights:
        (path / RANDOM_INIT_FILE).write_text(json.dumps({"head_scale": head_scale}) + "\n")
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
        model = model.to(DTYPES[dtype])  # pyright: ignore[reportArgumentType] (`to`: see write_random_bagel)
    if head_scale != 1.0:
        model.lm_head.weight.data *= head_scale
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        model.save_pretrained(tmp)  # the thinker's checkpoint names, then under `thinker.`
        del model
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors = {f"thinker.{k}": v for k, v in load_file(shard).items()}
            save_file(tensors, path / shard.name, metadata={"format": "pt"})
        index = Path(tmp, "model.safetensors.index.json")
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"] = {f"thinker.{k}": v for k, v in data["weight_map"].items()}
            (path / index.name).write_text(json.dumps(data, indent=2) + "\n")
    return path


def _copy_processor_files(tiny: Path, path: Path) -> None:
    """The tiny thinker's tokenizer, processor and generation files, into a random thinker's folder. The
    processor's class is named in its config, as the released checkpoint's preprocessor_config.json does: a
    thinker-only config's model_type (qwen3_omni_moe_thinker) maps to no processor in AutoProcessor, which
    then returns the bare tokenizer (vLLM refuses that for a multimodal model)."""
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    for name in names:
        (path / name).write_bytes((tiny / name).read_bytes())
    processor = json.loads((tiny / "preprocessor_config.json").read_text())
    processor["processor_class"] = "Qwen3OmniMoeProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
