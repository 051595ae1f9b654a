"""The tiny random-init Qwen3-Omni, saved as a local checkpoint, and what the tiny Qwen2.5-VL and Qwen3-VL
share with it (omnirl.models.qwen_vl.tiny).

As every family's tiny model (omnirl.models.sd3.tiny): the real transformers classes, tokenizers and
processors built in memory, saved with `save_pretrained` and loaded back through `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# ChatML with Qwen's image and audio placeholders, as the real Qwen2.5-VL / Qwen3-VL / Qwen3-Omni templates
# write them; the processor expands each placeholder to the number of vision / audio tokens.
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_omni_tokenizer():
    """A byte-level Qwen2 tokenizer (no merges: one token per byte) with the special tokens of Qwen3-Omni,
    their processor attributes (`tokenizer.image_token`, `audio_bos_token`, ...) and a chat template."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    named = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "audio_token": "<|audio_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=named
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def _save_qwen_processor_parts(out_dir: Path, tokenizer, image_processor, feature_extractor=None) -> None:
    """Tokenizer (with chat template), image processor and (Omni) audio feature extractor, the way the real
    checkpoints keep them: both processors in one preprocessor_config.json. The assembled transformers
    processor is not saved: it needs a video processor, hence torchvision, which this machine lacks."""
    import json

    tokenizer.save_pretrained(out_dir)
    config = image_processor.to_dict()
    if feature_extractor is not None:
        config.update(feature_extractor.to_dict())
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _tiny_qwen_text_config(tokenizer, head_dim: int = 16, **extra) -> dict:
    """Text-decoder kwargs shared by the tiny Qwen VL / Omni models: hidden 64, 2 layers, GQA 4/2 heads of
    16, interleaved M-RoPE sections (2, 3, 3) summing to head_dim / 2. head_dim 32 (the smallest head size
    vLLM's CPU attention runs): 2 heads of 32 and 1 KV head, sections (4, 6, 6)."""
    heads, kv_heads, sections = (4, 2, [2, 3, 3]) if head_dim == 16 else (2, 1, [4, 6, 6])
    assert head_dim in (16, 32), head_dim
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=sections, **extra),
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_qwen3_omni(out_dir: str | Path, head_dim: int = 16) -> Path:
    """A tiny Qwen3-Omni (MoE thinker + talker + code2wav), saved like Qwen/Qwen3-Omni-30B-A3B-Instruct:
    one `Qwen3OmniMoeForConditionalGeneration` checkpoint with thinker.* / talker.* / code2wav.* weights,
    the tokenizer with its chat template, and one preprocessor_config.json for the image processor and the
    Whisper feature extractor.

    Thinker: text hidden 64, 2 MoE layers of 4 experts (top 2); vision patch 16 (a 64x64 image is 4x4
    patches, 4 image tokens after the 2x2 merge), deepstack at layer 0; audio 16 mel bins with n_window 50,
    for which transformers hard-codes 13 audio tokens per 100 frames (1 s of 16 kHz audio). The talker and
    code2wav are tiny too (~90 k parameters): they exist so that loading can show they are dropped.

    head_dim 32 is the variant vLLM can run (its CPU attention has no head size below 32): every head of
    the text model, the vision and the audio encoder is 32 wide (the encoders' hidden size 64), and
    config.json gets the keys vLLM reads that transformers does not save (`add_vllm_config_keys`).
    """
    from transformers import (
        GenerationConfig,
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(out_dir)
    tok = _qwen_omni_tokenizer()
    # Each a single token's id (transformers types the lookup as maybe a list of ids).
    ids: dict[str, Any] = {s: tok.convert_tokens_to_ids(s) for s in tok.all_special_tokens}
    mm_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        audio_token_id=ids["<|audio_pad|>"],
        audio_start_token_id=ids["<|audio_start|>"],
    )
    text = _tiny_qwen_text_config(tok, head_dim, mrope_interleaved=True)
    wide = head_dim // 16  # the encoders' width factor: heads of head_dim
    thinker = dict(
        text_config=dict(text, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        vision_config=dict(
            depth=2,
            hidden_size=32 * wide,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,  # = the text hidden size
            num_position_embeddings=64,  # a square
            deepstack_visual_indexes=[0],
        ),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32 * wide,
            output_dim=64,  # = the text hidden size
            downsample_hidden_size=16,
            n_window=50,
            n_window_infer=100,
            max_source_positions=200,
            conv_chunksize=50,
        ),
        user_token_id=ids["<|im_start|>"],
        **mm_ids,
    )
    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=head_dim
    )
    talker = dict(
        text_config=dict(
            small,
            vocab_size=64,
            num_key_value_heads=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=2,
            num_experts_per_tok=1,
            rope_parameters=text["rope_parameters"],
        ),
        code_predictor_config=dict(small, vocab_size=64, num_key_value_heads=1, num_code_groups=4),
        num_code_groups=4,
        thinker_hidden_size=64,
        accept_hidden_layer=1,
        spatial_merge_size=2,
        codec_pad_id=58,
        codec_bos_id=59,
        codec_eos_token_id=60,
        codec_nothink_id=61,
        codec_think_bos_id=62,
        codec_think_eos_id=63,
        vision_start_token_id=ids["<|vision_start|>"],
        **mm_ids,
    )
    code2wav = dict(
        small,
        codebook_size=64,
        num_key_value_heads=2,
        num_quantizers=4,
        upsample_rates=(2, 2),
        upsampling_ratios=(2,),
        decoder_dim=32,
        sliding_window=8,
    )
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(
        Qwen3OmniMoeConfig(
            thinker_config=thinker,
            talker_config=talker,
            code2wav_config=code2wav,
            enable_audio_output=True,
            im_start_token_id=ids["<|im_start|>"],
            im_end_token_id=ids["<|im_end|>"],
        )
    ).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]
    )
    model.save_pretrained(out_dir)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    feature_extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160)
    _save_qwen_processor_parts(out_dir, tok, image_processor, feature_extractor)
    if head_dim != 16:
        add_vllm_config_keys(out_dir)
    return out_dir


def add_vllm_config_keys(out_dir: Path) -> None:
    """Write into a Qwen3-Omni config.json the keys vLLM (0.32) reads that transformers (5.24) does not
    save; real checkpoints have them. Without them vLLM fails on a missing `image_size` (its grid of
    position embeddings), then on `tie_word_embeddings` of the text config."""
    import json

    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    thinker = cfg["thinker_config"]
    v = thinker["vision_config"]
    v["image_size"] = int(v["num_position_embeddings"] ** 0.5) * v["patch_size"]
    v["apply_vit_abs_pos_embed"] = True
    thinker["text_config"]["tie_word_embeddings"] = False
    thinker["audio_end_token_id"] = _qwen_omni_tokenizer().convert_tokens_to_ids("<|audio_end|>")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


TINY = {"qwen3_omni_thinker": make_tiny_qwen3_omni}
