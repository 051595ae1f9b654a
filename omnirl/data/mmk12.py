"""MMK12-format visual math data: one image, a question and an exact answer per row.

A file is parquet (the Hugging Face datasets layout) or JSONL, one row per sample with "image" (bytes, a
path, or {"bytes": ..., "path": ...}), "question", "answer", optional "choices" (listed under the question
as "A. ...", the answer then a letter) and "id"; any other key is kept in the row's metadata. Loading is
strict (a bad row is a DataError naming file and row, or dropped with data.on_bad_row skip) and images
are decoded at load time. Each row becomes a `PromptRow`: the prompt is PROMPT_TEMPLATE filled in, the
image goes to `inputs["image"]`, and the metadata holds "id", "question", "answer", "choices" and
"source" for the reward.

The fields and the rules: docs/mmk12.md#data.
"""

from __future__ import annotations

import io
import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from omnirl.data.prompts import PromptRow
from omnirl.errors import DataError

PROMPT_TEMPLATE = (
    "{question}\n\n"
    "Solve the problem step by step. Then write only the final answer inside <answer></answer> tags, "
    "as \\boxed{{...}}: for example <answer>\\boxed{{12}}</answer>. For a multiple-choice question the "
    "final answer is the letter of the correct option."
)
"""The text of every MMK12 prompt; "{question}" is the row's question with its options (if any) below.
omnirl.rewards.mmk12 grades exactly this format: accuracy, one <answer> tag, a \\boxed{} value in it."""

_RESERVED = ("source",)


def load_mmk12(path: str | Path, skipped: list[str] | None = None) -> list[PromptRow]:
    """Read an MMK12 parquet (.parquet) or JSONL (.jsonl) file into prompt rows with decoded images.

    A malformed row is a DataError naming file and row; when a `skipped` list is passed the row is
    dropped instead and the message appended to the list. A missing or unreadable file, or a file with
    no rows, is always an error."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"MMK12 data file not found: {path}")
    if path.suffix == ".parquet":
        records = _parquet_records(path)
    elif path.suffix == ".jsonl":
        records = _jsonl_records(path)
    else:
        raise DataError(f"{path}: MMK12 data must be a .parquet or .jsonl file")
    rows = []
    for where, record in records:
        try:
            if isinstance(record, DataError):
                raise record
            rows.append(_row(where, record, path.parent, binary_ok=path.suffix == ".parquet"))
        except DataError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _parquet_records(path: Path) -> Iterator[tuple[str, dict | DataError]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install 'omnirl[math]'") from None

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        i = 0
        # Batch by batch: a full MMK12 split holds ~1.4 GB of encoded images.
        for batch in batches:
            for record in batch.to_pylist():
                yield f"{path}:row {i}", record
                i += 1
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict | DataError]]:
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path}:{lineno}"
        try:
            # utf-8-sig on the first line drops the byte-order mark some editors write.
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield where, DataError(f"{where}: not UTF-8 text ({e})")
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            yield where, DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})")


def _row(where: str, record: Any, base: Path, binary_ok: bool) -> PromptRow:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    row = dict(record)
    for key in _RESERVED:
        if key in row:
            raise DataError(f'{where}: the key "{key}" is reserved (omnirl records "file:row" there)')
    for key in ("image", "question", "answer"):
        if row.get(key) is None:
            raise DataError(f'{where}: missing "{key}" (an MMK12 row has image, question and answer)')
    image = _image(where, row.pop("image"), base, binary_ok)
    question, answer = row.pop("question"), row.pop("answer")
    for key, value in (("question", question), ("answer", answer)):
        if not isinstance(value, str) or not value.strip():
            raise DataError(f'{where}: "{key}" must be a non-empty string, got {value!r}')
    choices = row.pop("choices", None)
    if choices is not None:
        if (
            not isinstance(choices, list)
            or not 2 <= len(choices) <= 26
            or not all(isinstance(c, str) and c.strip() for c in choices)
        ):
            raise DataError(
                f'{where}: "choices" must be a list of 2 to 26 non-empty strings, got {choices!r}'
            )
        letters = string.ascii_uppercase[: len(choices)]
        if answer.strip() not in letters:
            raise DataError(
                f"{where}: the answer of a multiple-choice row must be one of the option letters "
                f"{', '.join(letters)}, got {answer!r}"
            )
        question = question.rstrip() + "\n" + "\n".join(f"{l}. {c}" for l, c in zip(letters, choices))
    row_id = row.pop("id", None)
    if row_id is None:
        row_id = where
    elif isinstance(row_id, (str, int)) and not isinstance(row_id, bool):
        row_id = str(row_id)
    else:
        raise DataError(f'{where}: "id" must be a string or an integer, got {row_id!r}')
    metadata = {**row, "id": row_id, "question": question, "answer": answer.strip(), "source": where}
    if choices is not None:
        metadata["choices"] = choices
    return PromptRow(
        prompt=PROMPT_TEMPLATE.format(question=question), metadata=metadata, inputs={"image": image}
    )


def _image(where: str, value: Any, base: Path, binary_ok: bool) -> Image.Image:
    """Decode a row's "image" value to an RGB PIL image."""
    data, path = None, None
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, str)):
        data, path = (value, None) if isinstance(value, bytes) else (None, value)
    if data is not None and not isinstance(data, bytes):
        raise DataError(
            f'{where}: "image" bytes must be binary (parquet)'
            + ("" if binary_ok else '; in JSONL give a path or {"path": ...}')
            + f", got {type(data).__name__}"
        )
    if data is None:
        if not (isinstance(path, str) and path):
            raise DataError(
                f'{where}: "image" must be bytes, a path, or {{"bytes": ..., "path": ...}}, got {value!r:.80}'
            )
        file = base / path
        if not file.is_file():
            raise DataError(f"{where}: image file not found: {file}")
        data = file.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")  # decodes now: a truncated file fails here, naming the row
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{where}: the image cannot be decoded ({e})") from None
