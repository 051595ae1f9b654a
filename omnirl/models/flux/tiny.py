"""The tiny random-init FLUX.1: the real diffusers / transformers classes, saved as a `FluxPipeline`
checkpoint and loaded back through `from_pretrained` (`scripts/make_tiny_models.py --only flux`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

# One double-stream and one single-stream block (LoRA and FP8 rules meet both kinds); 2 heads of 16, the
# rotary axes 4 + 6 + 6 = 16; guidance embeddings as FLUX.1-dev. 4 latent channels, packed 2x2: 16.
TINY_FLUX_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,  # = T5 d_model
    pooled_projection_dim=32,  # = CLIP hidden (FLUX pools CLIPTextModel's pooler output, no projection)
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
# FLUX.1-dev's scheduler_config.json: the shift grows with the image token count.
FLUX_SCHEDULER: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)


def make_tiny_flux(out_dir: str | Path) -> Path:
    """A tiny FLUX.1-dev, saved as a `FluxPipeline` checkpoint under `out_dir`.

    The VAE downsamples 2x (FLUX's 8x), so a 32x32 image is a 4x16x16 latent, 64 image tokens after the
    2x2 packing; the text is T5's 32 tokens (`tokenizer_2.model_max_length`, which lowers the adapter's
    max_sequence_length) and CLIP's pooled embedding.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from omnirl.models.tiny import _clip_tokenizer, _t5_tokenizer, tiny_t5_config

    out_dir = Path(out_dir)
    clip_tok = _clip_tokenizer()
    t5_tok = _t5_tokenizer(model_max_length=32)

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
    # (diffusers annotates the block tuples as one-element tuples: `Tuple[str]`; any length is taken.)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,  # pyright: ignore[reportArgumentType]
        up_block_types=("UpDecoderBlock2D",) * 2,  # pyright: ignore[reportArgumentType]
        block_out_channels=(16, 32),  # pyright: ignore[reportArgumentType]
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        # FLUX's VAE has no quant convs and does latents / scaling_factor + shift_factor (its real values)
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    clip_cfg: dict[str, Any] = dict(
        vocab_size=len(clip_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,  # the pooled output is read at the first EOS token
        pad_token_id=clip_tok.pad_token_id,
    )
    clip = CLIPTextModel(CLIPTextConfig(**clip_cfg))
    t5 = T5EncoderModel(T5Config(**tiny_t5_config(t5_tok)))
    # Built modules are in train mode (T5 dropout!) and pipelines never call eval(): do it here.
    pipe = FluxPipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=vae.eval(),
        text_encoder=clip.eval(),
        tokenizer=clip_tok,
        text_encoder_2=t5.eval(),
        tokenizer_2=t5_tok,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


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
