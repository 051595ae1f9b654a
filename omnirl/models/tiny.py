"""Tiny random-init versions of the supported model families, saved as local checkpoints.

No machine here can download weights, so every family gets a tiny model built from the REAL diffusers /
transformers classes (2 layers, hidden 16-64) with tokenizers built in memory, saved with
`save_pretrained` and loaded back through the same `from_pretrained` path a real checkpoint takes.
Weights are random but seeded, so a tiny model is the same on every machine and every build.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _clip_tokenizer():
    """A byte-level CLIP BPE with no merges: one token per character, the last one of a word with `</w>`."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(alphabet)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer(model_max_length: int):
    """A character-level Unigram T5 tokenizer (printable ASCII) built from a (piece, score) list."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(i), -5.0) for i in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


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
    clip_tok = _clip_tokenizer()
    t5_tok = _t5_tokenizer(model_max_length=32)

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
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
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        # 2 blocks: 2x downsampling (SD3's has 4 blocks, 8x). Cheap to decode on CPU, and 32 px images
        # give 16x16 latents, the size at which the quickstart was measured to learn.
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        # SD3's VAE has no quant convs and does latents / scaling_factor + shift_factor (its real values)
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    clip_cfg = dict(
        vocab_size=len(clip_tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,  # the pooled output is read at the first EOS token
        pad_token_id=clip_tok.pad_token_id,
    )
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
        )
    )
    # Built modules are in train mode (T5 dropout!) and pipelines never call eval(): do it here.
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tok,
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=text_encoder_3.eval(),
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


TINY_MODELS = {"sd3": make_tiny_sd3}
