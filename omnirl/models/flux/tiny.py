"""The tiny random-init FLUX.1: the real diffusers / transformers classes, saved as a `FluxPipeline`
checkpoint and loaded back through `from_pretrained` (`scripts/make_tiny_models.py --only flux`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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

    from omnirl.models.sd3.tiny import tiny_clip_config, tiny_t5_config, tiny_vae_config
    from omnirl.models.tokenizers import clip_tokenizer, t5_tokenizer

    out_dir = Path(out_dir)
    clip_tok = clip_tokenizer()
    t5_tok = t5_tokenizer(model_max_length=32)

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
    vae = AutoencoderKL(**tiny_vae_config(scaling_factor=0.3611, shift_factor=0.1159))  # FLUX's real values
    clip_cfg = tiny_clip_config(clip_tok, hidden_size=32)
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


TINY = {"flux": make_tiny_flux}
