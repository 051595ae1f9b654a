"""The tiny random-init Qwen-Image-Edit, saved as a local checkpoint (see omnirl.models.sd3.tiny)."""

from __future__ import annotations

from pathlib import Path

from omnirl.models.qwen_image.tiny import _tiny_qwen_image_modules


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


TINY = {"qwen_image_edit": make_tiny_qwen_image_edit}
