"""The tiny random-init Qwen-Image, saved as a local checkpoint (see omnirl.models.sd3.tiny)."""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl.models.tokenizers import qwen_image_tokenizer


def _tiny_qwen_image_modules(tokenizer, max_position_embeddings: int, vision: dict) -> dict:
    """The modules the tiny Qwen-Image and Qwen-Image-Edit share, built in this order after seeding 0:
    a Qwen2.5-VL text encoder (text hidden 32 = the transformer's joint_attention_dim; `vision` the
    vision tower's size), the QwenImageTransformer2DModel, a VAE downsampling 2x (one dim_mult step: a
    32x32 image is a 4x16x16 latent, 64 tokens after the 2x2 packing) and the real checkpoint's scheduler
    (dynamic exponential shift, shift_terminal 0.02). Built modules are in train mode and pipelines never
    call eval(): they come back eval()'d (see make_tiny_sd3)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    names = [
        "<|endoftext|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in names}
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=max_position_embeddings,
                # head_dim 8: the three M-RoPE sections (time, height, width) sum to head_dim / 2
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
                bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
            ),
            vision_config=dict(
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=56,
                out_hidden_size=32,  # = the text hidden size
                **vision,
            ),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels x the 2x2 packing
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False],
        # Not 0 / 1, so that a missing (de)normalisation shows up in the tests.
        latents_mean=[0.1, -0.2, 0.0, 0.3],
        latents_std=[1.5, 0.8, 1.0, 1.2],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    return dict(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
    )


def make_tiny_qwen_image(out_dir: str | Path) -> Path:
    """A tiny Qwen-Image, saved as a `QwenImagePipeline` checkpoint under `out_dir`.

    The VAE downsamples 2x (one dim_mult step; the real one 8x): a 32x32 image is a 4x16x16 latent, 64
    image tokens after the 2x2 packing, as in the tiny SD3. The text encoder is a Qwen2.5-VL with text
    hidden 32 (= the transformer's joint_attention_dim) and a 1-block vision tower that text-to-image never
    runs. The scheduler is the real checkpoint's (dynamic exponential shift, shift_terminal 0.02), so the
    tests cover the same sigma schedule.
    """
    from diffusers import QwenImagePipeline

    out_dir = Path(out_dir)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, fullatt_block_indexes=[0])
    pipe = QwenImagePipeline(**_tiny_qwen_image_modules(qwen_image_tokenizer(), 2048, vision))
    pipe.save_pretrained(out_dir)
    return out_dir


TINY = {"qwen_image": make_tiny_qwen_image}
