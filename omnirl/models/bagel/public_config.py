"""BAGEL-7B-MoT's public config, for a config-only checkpoint with random weights.

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

from omnirl.models.random_init import checked
from omnirl.models.tokenizers import qwen_image_tokenizer

# ByteDance-Seed/BAGEL-7B-MoT's llm_config.json: the Qwen2-7B shape (its generation copy doubles every
# layer's weights: 14 B parameters in all), q/k norms, and its latent position table of side 64 (the
# official app's max_latent_size). The autoencoder is FLUX's (omnirl.models.bagel.port.FLUX_VAE).
BAGEL_7B_MOT_LLM: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip


def write_random(out: Path) -> None:
    """BAGEL-7B-MoT in the official layout without its weights: llm_config.json, an ema.safetensors holding
    only the latent position table (what its config reads; random_init_loader builds the model from the
    config), a random FLUX autoencoder in BFL layout (ae.safetensors, 84 M parameters, bfloat16) and the
    tiny byte-level Qwen2 tokenizer with the BAGEL special tokens (the embeddings keep the real
    vocabulary)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from omnirl.models.bagel.port import FLUX_VAE, MAX_LATENT_SIZE, bfl_vae_state, sincos_2d

    llm = checked(Qwen2Config, **BAGEL_7B_MOT_LLM).to_dict()
    (out / "llm_config.json").write_text(json.dumps({**llm, "qk_norm": True}, indent=2))
    table = sincos_2d(BAGEL_7B_MOT_LLM["hidden_size"], MAX_LATENT_SIZE).to(torch.bfloat16)
    save_file({"latent_pos_embed.pos_embed": table}, out / "ema.safetensors")
    # (diffusers' and transformers' `to` is typed as the unbound `Module.to`, taking the dtype for `self`.)
    vae = AutoencoderKL(**FLUX_VAE).to(torch.bfloat16)  # pyright: ignore[reportArgumentType]
    save_file(bfl_vae_state(vae), out / "ae.safetensors")
    qwen_image_tokenizer().save_pretrained(out)


RANDOM = {"bagel": write_random}
