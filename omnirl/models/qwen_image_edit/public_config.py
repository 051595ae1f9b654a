"""Qwen-Image-Edit's public configs: Qwen-Image's shapes (omnirl.models.qwen_image.public_config), with the
edit pipeline's tokenizer template and image processor."""

from __future__ import annotations

from pathlib import Path

from omnirl.models.qwen_image.public_config import write_random as write_qwen_image


def write_random(out: Path, qwen_bpe: str | Path | None = None) -> None:
    """Qwen-Image-Edit's config-only checkpoint (`write_qwen_image` with `edit`)."""
    write_qwen_image(out, qwen_bpe, edit=True)


RANDOM = {"qwen_image_edit": write_random}
