"""Prompt datasets: JSONL rows ({"prompt": ..., any other keys}) and the prompts of each RL step.

Which rows an RL step uses depends only on (seed, step, prompts_per_step), never on the number of
ranks: the trainer cuts the step's global list into one contiguous slice per rank, so a run resumed on
another number of GPUs sees the same prompts in the same steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnirl.distributed import derive_seed
from omnirl.errors import DataError


@dataclass
class PromptRow:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other key of the row, plus "source": "file.jsonl:LINE"."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """Multimodal inputs of the prompt for `Request.inputs`, e.g. {"image": PIL.Image} (omnirl.data.mmk12)."""


def load_prompts(path: str | Path, skipped: list[str] | None = None) -> list[PromptRow]:
    """Read a JSONL prompt file: one JSON object per line with a non-empty string "prompt"; blank lines
    are skipped. Any other key is kept in `metadata` (e.g. "text", the OCR target).

    A malformed row is a DataError naming file and line; when a `skipped` list is passed
    (data.on_bad_row: skip), the row is dropped instead and that message appended to the list."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    rows = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            row = _parse_row(path, lineno, raw)
        except DataError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
            continue
        if row is not None:
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return rows


def _parse_row(path: Path, lineno: int, raw: bytes) -> PromptRow | None:
    """One line of a prompt file (None for a blank line); a DataError naming file and line if malformed."""
    where = f"{path}:{lineno}"
    try:
        # utf-8-sig on the first line drops the byte-order mark some editors write.
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e})") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = row.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f'{where}: every row needs a non-empty string "prompt", got {prompt!r}')
    if "source" in row:
        raise DataError(f'{where}: the key "source" is reserved (omnirl records "file:line" there)')
    return PromptRow(prompt=prompt, metadata={**row, "source": where})


def step_prompt_indices(num_rows: int, step: int, prompts_per_step: int, seed: int) -> list[int]:
    """Global row indices of RL step `step`: positions [step * n, (step + 1) * n) of an endless stream
    that walks a fresh shuffle of all rows each epoch, so every row is used once per epoch and a step
    may span the end of one epoch and the start of the next."""
    if num_rows < 1 or prompts_per_step < 1 or step < 0:
        raise ValueError(
            f"need num_rows >= 1, prompts_per_step >= 1, step >= 0; "
            f"got num_rows={num_rows}, prompts_per_step={prompts_per_step}, step={step}"
        )
    perms: dict[int, list[int]] = {}
    out = []
    for pos in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, offset = divmod(pos, num_rows)
        if epoch not in perms:
            gen = torch.Generator().manual_seed(derive_seed(seed, epoch, 0))
            perms[epoch] = torch.randperm(num_rows, generator=gen).tolist()
        out.append(perms[epoch][offset])
    return out
