"""The DDPO compressibility rewards: the size of the image saved as JPEG at quality 95, in kB (1000 bytes).

Compressibility is minus the size (smooth, flat images score higher), incompressibility plus the size.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image


def jpeg_kb(image: Image.Image) -> float:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000


class JpegCompressibility:
    modality = "image"

    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [-jpeg_kb(image) for image in images]


class JpegIncompressibility:
    modality = "image"

    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [jpeg_kb(image) for image in images]
