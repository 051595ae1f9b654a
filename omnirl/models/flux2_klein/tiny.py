"""The tiny random-init FLUX.2-klein of the tests and the tiny recipe (`scripts/make_tiny_models.py --only
flux2_klein`), built from the real diffusers / transformers classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

# FLUX.2-klein in miniature: one block of each kind, 2 heads of 16 with four rotary axes (4 x 4 = 16);
# no guidance embedding (klein takes CFG, not an embedded guidance). 4 latent channels patchified 2x2: 16.
# The text input is three of the Qwen3 encoder's hidden states side by side: 3 x 16 = 48.
TINY_FLUX2_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=48,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
# FLUX.2-klein's scheduler_config.json; the pipeline passes its own `mu` (compute_empirical_mu).
FLUX2_SCHEDULER: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)
# Qwen3's chat template, reduced to what the pipeline renders: one user turn and the generation prompt
# with thinking off (an empty think block), so the tokens are those of the real template.
QWEN3_CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def _qwen3_tokenizer(model_max_length: int):
    """A byte-level Qwen2 BPE with no merges (a token per byte) and Qwen3's special tokens and chat
    template: the prompt template costs about 30 tokens, and model_max_length caps the padded length."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], pad_token="<|endoftext|>", model_max_length=model_max_length
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def make_tiny_flux2_klein(out_dir: str | Path) -> Path:
    """A tiny FLUX.2-klein (base: CFG, not step-distilled), saved as a `Flux2KleinPipeline` checkpoint.

    The VAE (`AutoencoderKLFlux2`) downsamples 2x (the real one 8x) into 4 channels, patchified 2x2 into
    16 and normalised by its batch norm's running statistics (set to non-trivial values here, so that the
    normalisation is exercised): a 32x32 image is 16 channels x 8x8, 64 image tokens. The text encoder is
    a Qwen3ForCausalLM of 28 layers (the pipeline reads the hidden states of layers 9, 18 and 27), hidden
    16; the tokenizer pads to 64 tokens (its model_max_length, which lowers the adapter's
    max_sequence_length).
    """
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = _qwen3_tokenizer(model_max_length=64)
    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER)
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        use_quant_conv=True,
        use_post_quant_conv=True,
    )
    assert vae.bn.running_mean is not None and vae.bn.running_var is not None  # track_running_stats
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.3)
        vae.bn.running_var.uniform_(0.5, 2.0)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            pad_token_id=cast(int, tokenizer.pad_token_id),
        )
    )
    # Built modules are in train mode and pipelines never call eval(): do it here.
    pipe = Flux2KleinPipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        is_distilled=False,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


TINY = {"flux2_klein": make_tiny_flux2_klein}
