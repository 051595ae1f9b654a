"""Every weight file omnirl opens goes through here: a damaged one (truncated, random bytes, another format)
is one `WeightFileError` naming the file and what is wrong with it, instead of a library's traceback that
names neither; torch's own refusal text, which advises `weights_only=False` (running whatever the file
holds), is never repeated.

- safetensors files (`safe_open`, `load_safetensors`): the header is read and checked against the file's
  size first (`check_weight_file`), which costs a few kilobytes whatever the file's size, so a directory
  is checked whole before anything loads (`check_weight_files`: a model or reward directory, before
  `from_pretrained` reads it).
- PyTorch files (`torch_load`): `torch.load(weights_only=True)`, whose errors are turned into one line; a
  zip archive (what `torch.save` writes) that is cut short is found by the directory check already.

The safetensors library checks the same header when it opens a file, but says only `MetadataIncomplete
Buffer` or `HeaderTooLarge`, and `from_pretrained` does not say which file."""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors import safe_open as _safe_open
from safetensors.torch import load_file

from omnirl.errors import ConfigError

SAFETENSORS = (".safetensors",)
TORCH_FILES = (".bin", ".pt", ".pth", ".ckpt")
HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on a header's size


class WeightFileError(ConfigError):
    """A weight file that cannot be read as what it is named: the message names the file and the fault."""


def check_weight_file(path: str | Path) -> None:
    """A WeightFileError naming `path` unless its bytes are whole as far as can be told without reading its
    tensors: a safetensors file's header parses and its tensors end where the file ends; a PyTorch zip
    archive has its central directory (the end of the file). Other files pass."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if path.suffix in SAFETENSORS:
            _check_safetensors(path, f, head, size)
        elif path.suffix in TORCH_FILES and head.startswith(b"PK") and not zipfile.is_zipfile(f):
            raise WeightFileError(
                f"{path}: truncated or damaged: a zip archive (torch.save's format) without its end "
                f"({size} bytes)"
            )


def _check_safetensors(path: Path, f: Any, head: bytes, size: int) -> None:
    if len(head) < 8:
        raise WeightFileError(
            f"{path}: not a safetensors file: {size} bytes, less than its 8-byte header length"
        )
    n = int.from_bytes(head, "little")
    if n > min(size - 8, HEADER_LIMIT):
        raise WeightFileError(
            f"{path}: not a safetensors file, or truncated: its first 8 bytes give a header of {n} bytes, "
            f"the file holds {size}"
        )
    try:
        header = json.loads(f.read(n))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise WeightFileError(
            f"{path}: not a safetensors file: its header is not safetensors' JSON"
        ) from None
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        what = "truncated" if expected > size else "damaged"
        raise WeightFileError(
            f"{path}: {what}: its header describes {expected} bytes of tensors and header, the file holds "
            f"{size}"
        )


def check_weight_files(directory: str | Path) -> None:
    """`check_weight_file` on every weight file under `directory` (recursively; hidden folders, such as a
    hub cache's, skipped). A path that is not a local directory (a hub id) is left to its loader."""
    root = Path(directory)
    if not root.is_dir():
        return
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.endswith(SAFETENSORS + TORCH_FILES):
                check_weight_file(Path(folder, name))


@contextmanager
def safe_open(path: str | Path) -> Iterator[Any]:
    """safetensors' `safe_open(path, "pt")`, the file checked first; a read that fails names the file."""
    check_weight_file(path)
    try:
        with _safe_open(str(path), "pt") as f:
            yield f
    except SafetensorError as e:
        raise WeightFileError(f"{path}: {e}") from None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path` (on the host), the file checked first."""
    check_weight_file(path)
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise WeightFileError(f"{path}: {e}") from None


def torch_load(path: str | Path, **kwargs: Any) -> Any:
    """`torch.load(path, map_location="cpu", weights_only=True, **kwargs)`: tensors and plain containers
    only, nothing in the file runs. A file that is not one is a WeightFileError naming it and the fault
    (`load_fault`)."""
    check_weight_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except LOAD_ERRORS as e:
        raise WeightFileError(f"{path}: {load_fault(e)}") from None


# What torch.load(weights_only=True) raises for bytes that are not a weight file.
LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile)


def load_fault(e: BaseException) -> str:
    """What is wrong with bytes that `torch.load(weights_only=True)` refused with `e`, in one line, without
    torch's text advising `weights_only=False` ("Re-running `torch.load` with `weights_only` set to `False`
    will likely succeed, but it can result in arbitrary code execution") or an allowlist. What torch names
    as refused (the global, an operand that does not parse) is kept."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if isinstance(e, pickle.UnpicklingError):
        if any(line.startswith("Unsupported operand") for line in lines):
            return "not a PyTorch weight file: its bytes do not parse as one"
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        detail = f" (the global {found.group(1)})" if found else ""
        return (
            f"refused: it holds objects other than tensors and plain containers{detail}, which loading "
            "would run; omnirl reads weight files only"
        )
    if lines and lines[0].startswith("mmap can only be used"):  # a file read in place must be a zip archive
        return "not a PyTorch weight file: not the zip archive torch.save writes"
    return f"not a PyTorch weight file, or truncated ({lines[0] if lines else type(e).__name__})"
