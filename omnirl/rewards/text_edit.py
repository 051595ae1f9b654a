"""Text-edit reward: does the edited image show the target text in the edited region, and is the rest of the
source image left as it was?

    score = 0.5 * ocr + 0.5 * preserve, in [0, 1]

`TextEditReward` reads each row's `region` and `target_text` (`edit_target`; a row without them is a
DataError naming it), scores the OCR of the output's region (`ocr_crop`) and the preservation of the rest
(`preserve_score`).

How it works: docs/rewards.md#text_edit
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageOps

from omnirl.data.edit import read_image
from omnirl.errors import DataError
from omnirl.rewards.ocr import OcrReward, normalise, ocr_score

OCR_WEIGHT = 0.5
PRESERVE_WEIGHT = 0.5
MIN_OCR_HEIGHT = 96  # pixels: the region crop is scaled up to this height before OCR


def edit_target(metadata: dict[str, Any]) -> tuple[str, tuple[int, int, int, int], str]:
    """(source image path, region, normalised target text) of an edit row; a DataError names a bad row."""
    where = metadata.get("source", "an edit row")
    for key in ("image", "region", "target_text"):
        if key not in metadata:
            raise DataError(f'{where}: the text_edit reward needs "{key}" (see omnirl.data.edit)')
    target = normalise(metadata["target_text"])
    if not target:
        raise DataError(f'{where}: "target_text" is empty')
    return metadata["image"], tuple(metadata["region"]), target


def ocr_crop(image: Image.Image, region: tuple[int, int, int, int]) -> Image.Image:
    crop = image.crop(region)
    if crop.height < MIN_OCR_HEIGHT:
        scale = MIN_OCR_HEIGHT / crop.height
        crop = crop.resize((max(1, round(crop.width * scale)), MIN_OCR_HEIGHT), Image.Resampling.BICUBIC)
    fill = crop.getpixel((0, 0))  # a pixel is a fill (PIL types the two apart)
    return ImageOps.expand(crop, border=crop.height // 4, fill=fill)  # pyright: ignore[reportArgumentType]


def preserve_score(output: Image.Image, source: Image.Image, region: tuple[int, int, int, int]) -> float:
    """1 - mean |output - source| outside the region; images of one size."""
    out = np.asarray(output, dtype=np.float32) / 255  # [H, W, 3]
    src = np.asarray(source, dtype=np.float32) / 255
    outside = np.ones(src.shape[:2], dtype=bool)
    x0, y0, x1, y1 = region
    outside[y0:y1, x0:x1] = False
    if not outside.any():
        return 1.0
    return float(1 - np.abs(out - src)[outside].mean())


class TextEditReward:
    modality = "image"

    def __init__(self) -> None:
        self.ocr = OcrReward()  # its own engine: the pool never calls one reward from two threads

    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        targets = [edit_target(m) for m in metadata]  # a bad row fails before any OCR time is spent
        scores = []
        for image, (path, region, target) in zip(images, targets):
            source = read_image(path)
            output = image.convert("RGB").resize(source.size, Image.Resampling.BICUBIC)
            ocr = ocr_score(normalise(self.ocr.recognise(ocr_crop(output, region))), target)
            scores.append(OCR_WEIGHT * ocr + PRESERVE_WEIGHT * preserve_score(output, source, region))
        return scores
