"""Prompt and sample datasets, by row schema (data.format): each loader reads a file into `PromptRow`s."""

from __future__ import annotations

import os
from collections.abc import Callable

from omnirl import distributed as D
from omnirl.config import Config
from omnirl.data.edit import load_edit_rows
from omnirl.data.mmk12 import load_mmk12
from omnirl.data.prompts import PromptRow, load_prompts
from omnirl.errors import DataError

LOADERS = {"prompts": load_prompts, "edit": load_edit_rows, "mmk12": load_mmk12}


def load_data(cfg: Config) -> tuple[list[PromptRow], list[PromptRow], list[str] | None]:
    """(training rows, validation rows, the malformed rows skipped: None unless data.on_bad_row is skip).
    A skipped row is warned about once, with its file and line."""
    skipped: list[str] | None = [] if cfg.data.on_bad_row == "skip" else None
    load = LOADERS[cfg.data.format]

    def read(key: str, path: str) -> list[PromptRow]:
        try:
            return load(path, skipped)
        except DataError as e:
            if os.path.isfile(path):  # a row or the file's content: the message names the file and line
                raise
            raise DataError(f"{key}: {e}") from None  # a missing file: named with the field that set it

    rows = read("data.train_path", cfg.data.train_path)
    val_rows = read("data.val_path", cfg.data.val_path) if cfg.validation.every and cfg.data.val_path else []
    if skipped:
        D.print0(f"warning: skipped {len(skipped)} malformed data rows (data.on_bad_row: skip):")
        D.print0("\n".join(f"  {e}" for e in skipped))
    return rows, val_rows, skipped


def check_prompts(
    rows: list[PromptRow], problem: Callable[[PromptRow], str | None], skipped: list[str] | None
) -> list[PromptRow]:
    """The rows whose prompt the loaded model can run: `problem(row)` (`KindOps.prompt_problem`) says why
    one cannot (too long for the model), and such a row is a DataError naming its file and row, or, with
    a `skipped` list (data.on_bad_row: skip), dropped with a warning and appended there."""
    kept, dropped = [], []
    for row in rows:
        why = problem(row)
        if why is None:
            kept.append(row)
            continue
        message = f"{row.metadata.get('source', 'a data row')}: {why}"
        if skipped is None:
            raise DataError(message)
        dropped.append(message)
    if dropped and skipped is not None:  # rows are dropped only with a `skipped` list
        skipped.extend(dropped)
        D.print0(f"warning: skipped {len(dropped)} data rows the model cannot run (data.on_bad_row: skip):")
        D.print0("\n".join(f"  {e}" for e in dropped))
        if not kept:
            raise DataError(f"no data row is left: the model can run none of the {len(rows)} rows")
    return kept
