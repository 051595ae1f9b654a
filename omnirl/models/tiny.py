"""Tiny random-init versions of the supported model families, saved as local checkpoints.

No machine here can download weights, so every family gets a tiny model built from the REAL diffusers /
transformers classes (2 layers, hidden 16-64) with tokenizers built in memory, saved with
`save_pretrained` and loaded back through the same `from_pretrained` path a real checkpoint takes.
Weights are random but seeded, so a tiny model is the same on every machine and every build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnirl.models.tiny_omni import make_tiny_qwen3_omni, make_tiny_qwen_vl
from omnirl.models.tiny_rewards import make_tiny_clap


def tiny_t5_config(tokenizer) -> dict:
    """The tiny T5 / UMT5 text encoder's config (SD3's third encoder, Wan's only one) for `tokenizer`."""
    return dict(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


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


TINY_SD3_TRANSFORMER: dict[str, Any] = dict(
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
    transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
    # (diffusers annotates the block tuples as one-element tuples: `Tuple[str]`; any length is taken.)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,  # pyright: ignore[reportArgumentType]
        up_block_types=("UpDecoderBlock2D",) * 2,  # pyright: ignore[reportArgumentType]
        # 2 blocks: 2x downsampling (SD3's has 4 blocks, 8x). Cheap to decode on CPU, and 32 px images
        # give 16x16 latents, the size at which the quickstart was measured to learn.
        block_out_channels=(16, 32),  # pyright: ignore[reportArgumentType]
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
    clip_cfg: dict[str, Any] = dict(
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
    text_encoder_3 = T5EncoderModel(T5Config(**tiny_t5_config(t5_tok)))
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


def _qwen_image_tokenizer():
    """A byte-level Qwen2 BPE whose only merges spell the words of Qwen-Image's prompt template, so the
    template prefix is 34 tokens as with the real tokenizer (the pipeline drops exactly 34) and a prompt
    costs about one token per byte."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    words = ["system", "user", "assistant", "Describe"]
    words += ["\u0120" + w for w in "the image by detailing color shape size texture quantity text".split()]
    words += [
        "\u0120" + w for w in "spatial relationships of objects and background".split()
    ]  # \u0120: a space
    merges = []
    for word in words:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                merges.append((word[: i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>"]
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


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
    pipe = QwenImagePipeline(**_tiny_qwen_image_modules(_qwen_image_tokenizer(), 2048, vision))
    pipe.save_pretrained(out_dir)
    return out_dir


def make_tiny_qwen_image_edit(out_dir: str | Path) -> Path:
    """A tiny Qwen-Image-Edit, saved as a `QwenImageEditPipeline` checkpoint under `out_dir`.

    Qwen2.5-VL (text hidden 32 = the transformer's joint_attention_dim, a 2-layer vision tower with the
    real patch 14 / merge 2) over a byte-level Qwen2 tokenizer with no merges (one token per byte, so the
    edit template's system prompt is ~300 tokens: the pipeline drops only its first 64). The VAE
    downsamples 2x (one dim_mult step): a 32x32 image is a 4x16x16 latent, 64 tokens after the 2x2
    packing, and so is a 32x32 condition image. The scheduler is Qwen-Image's (dynamic exponential shift,
    shift_terminal 0.02). processor/ holds the image processor and tokenizer, as in the real checkpoint,
    and model_index.json names the real `Qwen2VLProcessor`.
    """
    import json

    from diffusers import QwenImageEditPipeline
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(out_dir)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += ["<|image_pad|>", "<|video_pad|>"]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1])
    # The processor is saved from its parts: building a Qwen2VLProcessor needs torchvision (its video
    # processor), which this machine lacks.
    modules = _tiny_qwen_image_modules(tokenizer, 1024, vision)
    # (diffusers' pipelines type their modules as required; a None module is taken and left unsaved.)
    pipe = QwenImageEditPipeline(**modules, processor=None)  # pyright: ignore[reportArgumentType]
    pipe.save_pretrained(out_dir)
    # The real checkpoint's processor: min_pixels 56*56 makes a 32x32 condition image 4 vision tokens.
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(
        out_dir / "processor"
    )
    tokenizer.save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def make_tiny_wan(out_dir: str | Path, layout: str = "ti2v") -> Path:
    """A tiny Wan2.2, saved as a `WanPipeline` checkpoint under `out_dir`, in one of the two layouts:
    "ti2v" (TI2V-5B: one transformer, `expand_timesteps`, per-token timesteps) or "a14b" (T2V-A14B: a
    high-noise `transformer` above `boundary_ratio` 0.875 and a low-noise `transformer_2` below it).

    The VAE downsamples like the real one, 8x in space and 4x in time (`dim_mult=[1,1,2,2]`,
    `temperal_downsample=[False,True,True]`), so 9 frames of 32x32 pixels are 3 latent frames of 4x4,
    i.e. 12 tokens after the transformer's 1x2x2 patches. The text encoder is a UMT5 of d_model 32 (the
    transformer's `text_dim`) with a character-level tokenizer of 32 tokens (the adapter's
    max_sequence_length). The scheduler is the flow-matching Euler one with Wan's shift 5.0 (the real
    checkpoints ship UniPC; the adapter samples with the Euler flow step, see omnirl/models/wan.py).
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if layout not in ("ti2v", "a14b"):
        raise ValueError(f"layout must be 'ti2v' or 'a14b', got {layout!r}")
    out_dir = Path(out_dir)
    tokenizer = _t5_tokenizer(model_max_length=32)
    torch.manual_seed(0)

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=32,  # = UMT5 d_model
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval()

    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    )
    text_encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_config(tokenizer)))  # UMT5 takes T5's keys
    experts = {"transformer": transformer()}
    if layout == "a14b":
        experts["transformer_2"] = transformer()
    # Built modules are in train mode (UMT5 dropout!) and pipelines never call eval(): do it here.
    pipe = WanPipeline(
        tokenizer=tokenizer,  # pyright: ignore[reportArgumentType] (typed as the AutoTokenizer factory)
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        boundary_ratio=0.875 if layout == "a14b" else None,
        expand_timesteps=layout == "ti2v",
        **experts,
    )
    pipe.save_pretrained(out_dir)
    return out_dir


def _make_tiny_qwen3_omni_k12(out_dir: str | Path) -> Path:
    """The tiny Qwen3-Omni taught the MMK12 answer format (omnirl.models.tiny_k12), for yaml/mmk12_tiny."""
    from omnirl.models.tiny_k12 import make_tiny_qwen3_omni_k12

    return make_tiny_qwen3_omni_k12(out_dir)


def _make_tiny_ltx2(out_dir: str | Path) -> Path:
    """The tiny LTX-2.3 text to video + audio (omnirl.models.tiny_ltx2)."""
    from omnirl.models.tiny_ltx2 import make_tiny_ltx2

    return make_tiny_ltx2(out_dir)


def _make_tiny_flux(out_dir: str | Path) -> Path:
    """The tiny FLUX.1-dev (omnirl.models.flux.tiny)."""
    from omnirl.models.flux.tiny import make_tiny_flux

    return make_tiny_flux(out_dir)


def _make_tiny_flux2_klein(out_dir: str | Path) -> Path:
    """The tiny FLUX.2-klein (omnirl.models.flux.tiny)."""
    from omnirl.models.flux.tiny import make_tiny_flux2_klein

    return make_tiny_flux2_klein(out_dir)


def make_tiny_pickscore(out_dir: str | Path) -> Path:
    """A tiny random PickScore in the layout `reward.paths.pickscore` names: a `CLIPModel` (2 layers, hidden
    32, 32 px images) with its `CLIPProcessor` (the character-level CLIP tokenizer) in one directory."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    out_dir = Path(out_dir)
    tok = _clip_tokenizer()
    torch.manual_seed(0)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8)  # fmt: skip
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(out_dir)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(out_dir)
    return out_dir


def make_tiny_dina_lrm(out_dir: str | Path, visual=(0, 1), text=(1,), seed: int = 0) -> Path:
    """A tiny random DiNa-LRM for the tiny SD3, in the published layout (`omnirl.rewards.dina_lrm`):
    config.json, checkpoint/backbone_lora/ (a peft adapter over the first block, saved by peft from a
    model of the embedders and that block, as the reference saves it) and checkpoint/rm_head.pt. Every
    weight is random, the LoRA's B and the head's zero-initialised layers included, so that each one
    changes the score."""
    import json

    import peft
    from diffusers import SD3Transformer2DModel
    from torch import nn

    from omnirl.rewards.dina_lrm import Backbone, RewardHead

    out_dir = Path(out_dir)
    n = max(visual + text)
    head_options = dict(use_proj_in=False, width=-1, out_dim=1, num_queries=4, num_attn_heads=8, dropout=0.0)
    config = dict(num_transformer_layers=n, use_lora=True, freeze_backbone=False, use_logistic=False,
                  visual_head_idx=list(visual), text_head_idx=list(text),
                  reward_head=head_options)  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model": config}, indent=4))
    torch.manual_seed(seed)
    backbone = Backbone(SD3Transformer2DModel(**TINY_SD3_TRANSFORMER), n)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    lora = peft.get_peft_model(backbone, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    lora.save_pretrained(str(out_dir / "checkpoint" / "backbone_lora"))
    dim = TINY_SD3_TRANSFORMER["num_attention_heads"] * TINY_SD3_TRANSFORMER["attention_head_dim"]
    head = RewardHead(dim, len(visual), len(text), head_options)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        for m in head.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.fill_(1.0)
    torch.save(head.state_dict(), out_dir / "checkpoint" / "rm_head.pt")
    return out_dir


def make_tiny_bagel(out_dir: str | Path) -> Path:
    """A tiny BAGEL in the official checkpoint layout (omnirl.models.bagel_port): a 2-layer Qwen2-shaped
    mixture-of-transformers (hidden 32, 4 heads of 8, 2 KV heads, q/k norms) whose understanding and
    generation copies are drawn independently (so routing a token to the wrong copy shows), a latent
    position table of side 16, a FLUX-layout autoencoder (FLUX's config but 2 blocks of width 32)
    downsampling 2x (a 32 px image is 16x16 latents, 64 latent tokens), the byte-level Qwen2 tokenizer
    with the BAGEL special tokens, and understanding-only tensors (vision tower, connector, text head)
    that text to image skips."""
    from diffusers import AutoencoderKL
    from transformers import Qwen2Config

    from omnirl.models.bagel_port import FLUX_VAE, BagelConfig, BagelModel, save_official

    out_dir = Path(out_dir)
    tokenizer = _qwen_image_tokenizer()
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


TINY_MODELS = {
    "sd3": make_tiny_sd3,
    "qwen_image": make_tiny_qwen_image,
    "qwen_image_edit": make_tiny_qwen_image_edit,
    "wan22_ti2v": make_tiny_wan,
    "wan22_a14b": lambda out_dir: make_tiny_wan(out_dir, "a14b"),
    "ltx2": _make_tiny_ltx2,
    "qwen3_omni": make_tiny_qwen3_omni,
    "qwen2_5_vl": make_tiny_qwen_vl,
    "qwen3_vl": lambda out_dir: make_tiny_qwen_vl(out_dir, "qwen3_vl"),
    "qwen3_omni_k12": _make_tiny_qwen3_omni_k12,
    "pickscore": make_tiny_pickscore,
    "dina_lrm": make_tiny_dina_lrm,
    "clap": make_tiny_clap,
    "bagel": make_tiny_bagel,
    "flux": _make_tiny_flux,
    "flux2_klein": _make_tiny_flux2_klein,
}
