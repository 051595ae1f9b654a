"""The tiny random-init BAGEL, in the official checkpoint layout (see omnirl.models.sd3.tiny)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl.models.tokenizers import qwen_image_tokenizer


def make_tiny_bagel(out_dir: str | Path) -> Path:
    """A tiny BAGEL in the official checkpoint layout (omnirl.models.bagel.port): a 2-layer Qwen2-shaped
    mixture-of-transformers (hidden 32, 4 heads of 8, 2 KV heads, q/k norms) whose understanding and
    generation copies are drawn independently (so routing a token to the wrong copy shows), a latent
    position table of side 16, a FLUX-layout autoencoder (FLUX's config but 2 blocks of width 32)
    downsampling 2x (a 32 px image is 16x16 latents, 64 latent tokens), the byte-level Qwen2 tokenizer
    with the BAGEL special tokens, and understanding-only tensors (vision tower, connector, text head)
    that text to image skips."""
    from diffusers import AutoencoderKL
    from transformers import Qwen2Config

    from omnirl.models.bagel.port import FLUX_VAE, BagelConfig, BagelModel, save_official

    out_dir = Path(out_dir)
    tokenizer = qwen_image_tokenizer()
    llm = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_theta=1e6, rope_type="default"), max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BagelModel(BagelConfig(llm=llm, max_latent_size=16))
    with torch.no_grad():  # norms away from 1, so a norm applied to the wrong tokens changes the output
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    vae = AutoencoderKL(
        **{**FLUX_VAE, "down_block_types": ("DownEncoderBlock2D",) * 2,
           "up_block_types": ("UpDecoderBlock2D",) * 2, "block_out_channels": (32, 32), "layers_per_block": 1,
           "sample_size": 32}
    )  # fmt: skip
    skipped = {
        "vit_model.vision_model.embeddings.patch_embedding.weight": torch.randn(8, 3, 14, 14),
        "connector.fc1.weight": torch.randn(32, 8),
        "vit_pos_embed.pos_embed": torch.randn(16, 32),
        "language_model.lm_head.weight": torch.randn(len(tokenizer), 32),
    }
    save_official(model, vae.eval(), out_dir, torch.float32, skipped)
    tokenizer.save_pretrained(out_dir)
    return out_dir


TINY = {"bagel": make_tiny_bagel}
