"""OCR reward (Flow-GRPO): how well the image shows the text quoted in its prompt.

The target is the text inside "..." or “...” in the prompt (all quoted spans, in order), or the row's
"text" key when it has one. Target and recognised text (all boxes joined) are lower-cased with every
whitespace character removed; the reward is 1 if the target occurs in the recognised text, else
1 - min(levenshtein(recognised, target), len(target)) / len(target), so it lies in [0, 1].

OCR runs through `rapidocr` + `onnxruntime`, whose PP-OCR models ship inside the wheel: it needs no
network.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from PIL import Image
from rapidfuzz.distance import Levenshtein

from omnirl.errors import ConfigError, DataError

_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def normalise(text: str) -> str:
    return "".join(text.split()).lower()


def target_text(prompt: str, metadata: dict[str, Any]) -> str:
    """The normalised text the image should show; a row without one is a DataError naming it."""
    row = metadata.get("source", repr(prompt))
    if "text" in metadata:
        text = metadata["text"]
        if not isinstance(text, str):
            raise DataError(f'{row}: "text" must be a string, got {text!r}')
    else:
        text = " ".join(a + b for a, b in _QUOTED.findall(prompt))
    target = normalise(text)
    if not target:
        raise DataError(
            f'{row}: the OCR reward needs text in "quotes" in the prompt (or a "text" key): {prompt!r}'
        )
    return target


def ocr_score(recognised: str, target: str) -> float:
    """Score of normalised recognised text against a normalised, non-empty target."""
    if target in recognised:
        return 1.0
    return 1.0 - min(Levenshtein.distance(recognised, target), len(target)) / len(target)


class OcrReward:
    modality = "image"

    def __init__(self) -> None:
        if importlib.util.find_spec("rapidocr") is None or importlib.util.find_spec("onnxruntime") is None:
            raise ConfigError(
                "the OCR rewards (ocr, text_edit) need rapidocr and onnxruntime: pip install 'omnirl[ocr]'"
            )
        self._engine = None  # created at the first call: loading the ONNX models takes a while

    def recognise(self, image: Image.Image) -> str:
        if self._engine is None:
            from rapidocr import RapidOCR

            # "error" silences per-call INFO lines and the warning on images without text.
            self._engine = RapidOCR(params={"Global.log_level": "error"})
        out = self._engine(image.convert("RGB"))  # a PIL image is read as RGB (an ndarray would be BGR)
        # txts is None when nothing was detected (the output is typed as any stage's: the last one's has it)
        return " ".join(out.txts or ())  # pyright: ignore[reportAttributeAccessIssue]

    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        # Targets first: a bad row fails before any OCR time is spent.
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        return [ocr_score(normalise(self.recognise(im)), t) for im, t in zip(images, targets)]
