"""Tiny random-init versions of the rewards' models, in the layouts their `reward.paths` name.

Like the tiny families (`omnirl.models.sd3.tiny`): the real classes, a few layers of width 16-32, tokenizers
built in memory, seeded weights, saved as a user's checkpoint is laid out and loaded back by the same code.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _roberta_tokenizer():
    """A byte-level RoBERTa BPE with no merges (one token per byte-level character), CLAP's text tokenizer
    class: the five special tokens first, as RoBERTa numbers them."""
    from tokenizers import pre_tokenizers
    from transformers import RobertaTokenizer

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])}
    vocab.update({c: len(vocab) + i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    return RobertaTokenizer(vocab=vocab, merges=[], model_max_length=77)


def make_tiny_clap(out_dir: str | Path) -> Path:
    """A tiny random CLAP in the layout `reward.paths.clap` names (laion/larger_clap_general's): a
    `ClapModel` (HTSAT audio tower of two stages, RoBERTa text tower of 2 layers, width 32) with its
    `ClapProcessor`, whose feature extractor takes 1 s of 16 kHz audio as 16 mel bins (the real one: 10 s at
    48 kHz, 64 bins)."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    out_dir = Path(out_dir)
    tok = _roberta_tokenizer()
    torch.manual_seed(0)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=80, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    audio = dict(spec_size=64, num_mel_bins=16, window_size=8, patch_size=4, patch_stride=(4, 4),
                 depths=[1, 1], num_attention_heads=[2, 2], patch_embeds_hidden_size=16,
                 hidden_size=32)  # fmt: skip
    ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)).save_pretrained(out_dir)
    features = ClapFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=160, max_length_s=1, fft_window_size=400,
        frequency_max=8000, truncation="rand_trunc",
    )  # fmt: skip
    ClapProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(out_dir)
    return out_dir


def tiny_imagebind_arch():
    """The tiny ImageBind's towers: width 16, 2 blocks, 2 heads, a shared space of 8, the vocabulary of the
    tiny CLIP tokenizer (514); the input geometry is the real one's."""
    from omnirl.rewards.imagebind_model import ImageBindArch, Tower

    return ImageBindArch(Tower(16, 2, 2), Tower(16, 2, 2), Tower(16, 2, 2), out_dim=8, vocab_size=514)


def make_tiny_imagebind(out_dir: str | Path) -> Path:
    """A tiny random ImageBind in the layout `reward.paths.imagebind` names: `imagebind_huge.pth` in the
    official key layout (the vision, audio and text towers of `tiny_imagebind_arch`, every tensor random but
    the causal mask; a few tensors named as the official depth, thermal and IMU towers', which the loader
    skips) and a CLIP BPE tokenizer (`omnirl.models.tokenizers.clip_tokenizer`)."""
    import math

    from omnirl.models.tokenizers import clip_tokenizer
    from omnirl.rewards.imagebind import FILE
    from omnirl.rewards.imagebind_model import ImageBind

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    state = ImageBind(tiny_imagebind_arch()).state_dict()
    for name, tensor in state.items():
        if name.endswith("log_logit_scale"):  # the official scales: learned ~1 / 0.07 for text, 20 for audio
            tensor.fill_(math.log(1 / 0.07) if ".text." in name else math.log(20.0))
        elif name.endswith(".mask"):
            continue  # the causal mask is a fixed buffer
        elif "norm" in name or name.startswith("modality_heads") and name.endswith(".0.weight"):
            tensor.copy_(
                1 + 0.1 * torch.randn_like(tensor)
                if name.endswith("weight")
                else 0.1 * torch.randn_like(tensor)
            )
        else:
            tensor.copy_(torch.randn_like(tensor) / math.sqrt(max(tensor[0].numel(), 1)))
    unused = {
        "modality_preprocessors.depth.cls_token": torch.randn(1, 1, 16),
        "modality_trunks.thermal.blocks.0.norm_1.weight": torch.ones(16),
        "modality_heads.imu.3.weight": torch.randn(8, 16),
        "modality_postprocessors.imu.1.log_logit_scale": torch.tensor(math.log(5.0)),
    }
    torch.save({**state, **unused}, out_dir / FILE)
    clip_tokenizer().save_pretrained(out_dir)
    return out_dir


def make_tiny_pickscore(out_dir: str | Path) -> Path:
    """A tiny random PickScore in the layout `reward.paths.pickscore` names: a `CLIPModel` (2 layers, hidden
    32, 32 px images) with its `CLIPProcessor` (the character-level CLIP tokenizer) in one directory."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from omnirl.models.tokenizers import clip_tokenizer

    out_dir = Path(out_dir)
    tok = clip_tokenizer()
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

    from omnirl.models.sd3.tiny import TINY_SD3_TRANSFORMER
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
