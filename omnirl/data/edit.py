"""Image-editing data: JSONL rows of a source image, an edit instruction and what the edit should produce.

    {"image": "images/train_00000.png", "prompt": "Make the sign read \\"OPEN\\"", "target_text": "OPEN",
     "region": [48, 160, 464, 320], "target": "targets/train_00000.png"}

"image" (required) is the source image the model edits and "target" (optional) a reference result, both
paths relative to the JSONL file. "target_text" (optional) is the text the edited image should show and
"region" (optional) the pixel box [x0, y0, x1, y1) of the source image that holds it; the `text_edit`
reward needs both. No other key is allowed (a misspelt key would otherwise be silently ignored).

Every row is checked when the file is loaded, its images decoded whole included, so a bad row stops the
run before the first rollout with its file and line. Rows keep the resolved paths in `metadata` (rewards
read the source image from there) and in `PromptRow.inputs` as `Path`s: `open_inputs` reads them when a
step uses the row, so a large data set is never held in memory. `scripts/make_edit_data.py` writes such files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from omnirl.data.prompts import PromptRow, load_prompts
from omnirl.errors import DataError

EDIT_KEYS = ("image", "target", "target_text", "region")


def load_edit_rows(path: str | Path, skipped: list[str] | None = None) -> list[PromptRow]:
    """Read a JSONL edit file (`load_prompts` rules, plus the edit keys above). A bad row is a DataError
    naming file and line; with a `skipped` list (data.on_bad_row: skip) it is dropped and its message
    appended instead."""
    path = Path(path)
    rows = []
    for row in load_prompts(path, skipped):
        try:
            rows.append(_check_row(row, path.parent))
        except DataError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
    if not rows:
        raise DataError(f"{path}: no usable edit rows")
    return rows


def _image_size(where: str, key: str, value: Any, base: Path) -> tuple[Path, tuple[int, int]]:
    """The resolved path of an image key and the image's (width, height); the image is decoded whole to
    check it (its header alone passes a truncated file, which fails only when a step decodes it)."""
    if not isinstance(value, str) or not value:
        raise DataError(
            f'{where}: "{key}" must be a non-empty path (relative to the data file), got {value!r}'
        )
    file = (base / value).resolve()
    if not file.is_file():
        raise DataError(f'{where}: "{key}" image file not found: {file}')
    try:
        with Image.open(file) as image:
            image.load()
            return file, image.size
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f'{where}: "{key}" {file} is not a readable image ({e})') from None


def _check_row(row: PromptRow, base: Path) -> PromptRow:
    meta = row.metadata
    where = meta["source"]
    unknown = sorted(set(meta) - {*EDIT_KEYS, "source"})
    if unknown:
        raise DataError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (an edit row has: prompt, "
            f"{', '.join(EDIT_KEYS)})"
        )
    if "image" not in meta:
        raise DataError(f'{where}: every edit row needs "image", the source image path')
    image, (width, height) = _image_size(where, "image", meta["image"], base)
    meta = {**meta, "image": str(image)}
    if "target" in meta:
        meta["target"] = str(_image_size(where, "target", meta["target"], base)[0])
    if "target_text" in meta and not (isinstance(meta["target_text"], str) and meta["target_text"].strip()):
        raise DataError(f'{where}: "target_text" must be a non-empty string, got {meta["target_text"]!r}')
    if "region" in meta:
        box = meta["region"]
        ints = isinstance(box, list) and len(box) == 4 and all(type(v) is int for v in box)
        if not ints or not (0 <= box[0] < box[2] <= width and 0 <= box[1] < box[3] <= height):
            raise DataError(
                f'{where}: "region" must be [x0, y0, x1, y1] integers with 0 <= x0 < x1 <= {width} and '
                f"0 <= y0 < y1 <= {height} (the source image is {width}x{height}), got {box!r}"
            )
    return PromptRow(prompt=row.prompt, metadata=meta, inputs={**row.inputs, "image": image})


def read_image(path: str | Path) -> Image.Image:
    """An image file decoded as RGB (the file is closed again)."""
    with Image.open(path) as image:
        return image.convert("RGB")


def open_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A data row's `inputs` for its requests: image files named by `Path` are read now, other values
    (already decoded inputs) pass through. Called once per row and step, so a GRPO group shares one image."""
    return {k: read_image(v) if isinstance(v, Path) else v for k, v in inputs.items()}
