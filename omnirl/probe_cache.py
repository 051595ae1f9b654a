"""Step 0's memory probes, kept for the next run of the same shapes: the rollout's per-request cost of each
batch kind (`omnirl.rollout.diffusion.DiffusionEngine`) and the peaks `model.gradient_checkpointing: auto`
measured (`omnirl.autotune.probe_checkpointing`). A later run whose key matches reads them instead of
running the probes; the decisions themselves are made again from what is free now.

The key of a run is everything its probes' bytes depend on: the device (its name and size), the versions of
torch, CUDA and the model libraries, the rank and the number of ranks, the configs of the model's
components (their files' contents, not their path), and every config section that shapes a forward (the
run's name, steps, data, rewards, logging, validation, checkpoints, export and health checks left out).
Each rank keeps one file, `<dir>/<key>.json`, beside the compile cache (`run.compile_cache`); a file that
cannot be read is measured again and rewritten. Delete the folder to measure everything again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from omnirl import distributed as D

# Config sections that shape no forward of the probes.
UNKEYED = ("run", "data", "reward", "log", "validation", "export", "checkpoint", "health")
SUBDIR = "omnirl-memory-probes"

_active: ProbeCache | None = None


class ProbeCache:
    """The probes of one run key in one file; `get` and `put` by (kind, item)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path.is_file():
            try:
                entries = json.loads(path.read_text())
                if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
                    raise ValueError("not a mapping of kinds")
                self.entries = entries
            except (OSError, ValueError) as e:
                warnings.warn(f"{path}: unreadable memory probes ({e}); measuring again", stacklevel=2)

    def get(self, kind: str, item: str) -> Any:
        return self.entries.get(kind, {}).get(item)

    def put(self, kind: str, item: str, value: Any) -> None:
        self.entries.setdefault(kind, {})[item] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # whole or not at all
        except OSError as e:
            warnings.warn(f"{self.path}: memory probes not kept ({e})", stacklevel=2)


def use(cache: ProbeCache | None) -> None:
    """Make `cache` the one the probes read and write (None: every probe measures, nothing is kept)."""
    global _active
    _active = cache


def get(kind: str, item: str, everyone: bool = False) -> Any:
    """The kept value, or None; `everyone` (a collective: where the probe is one, every rank must probe or
    none): None unless every rank has it."""
    kept = None if _active is None else _active.get(kind, item)
    if everyone:
        have = D.all_reduce(torch.tensor([float(kept is not None)]), op=torch.distributed.ReduceOp.MIN)
        kept = kept if have.item() == 1 else None
    return kept


def put(kind: str, item: str, value: Any) -> None:
    if _active is not None:
        _active.put(kind, item, value)


def model_configs(path: str) -> dict[str, str]:
    """The contents of a local checkpoint's config files (model_index.json, each component's config.json,
    a BAGEL-style top-level config) by relative path; a hub id is taken as it is."""
    root = Path(path)
    if not root.is_dir():
        return {"path": path}
    files = sorted([*root.glob("*.json"), *root.glob("*/config.json")])
    keep = [f for f in files if "tokenizer" not in f.name and not f.name.endswith(".index.json")]
    return {str(f.relative_to(root)): f.read_text() for f in keep}


def run_key(cfg, device: torch.device, rank: int, world: int) -> str:
    """The hash of what a run's probes depend on (the module docstring)."""
    import diffusers
    import peft
    import transformers

    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in UNKEYED}
    sections = {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        for k, v in sections.items()
    }
    sections["model"] = {k: v for k, v in sections["model"].items() if k != "path"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = {"name": props.name, "bytes": props.total_memory, "cuda": torch.version.cuda}
    else:
        where = {"type": device.type}
    what = {
        "config": sections,
        "model_configs": model_configs(cfg.model.path),
        "device": where,
        "versions": [torch.__version__, diffusers.__version__, transformers.__version__, peft.__version__],
        "rank": [rank, world],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def for_run(cfg, device: torch.device, rank: int, world: int, cache_dir: Path) -> ProbeCache:
    return ProbeCache(cache_dir / SUBDIR / f"{run_key(cfg, device, rank, world)}.json")


def shapes(rows: list) -> str:
    """The shapes and dtypes of the tensors `rows` carry (a row's fields, its trajectory's fields and their
    dicts), in order: the part of a probe's key that its inputs give."""

    def walk(value: Any, out: list) -> None:
        if isinstance(value, torch.Tensor):
            out.append(f"{tuple(value.shape)}:{value.dtype}")
        elif isinstance(value, dict):
            for k in sorted(value):
                out.append(str(k))
                walk(value[k], out)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, out)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                if f.name != "request":
                    walk(getattr(value, f.name), out)

    out: list[str] = []
    for row in rows:
        out.append(type(row).__name__)
        walk(row, out)
    return hashlib.sha256("|".join(out).encode()).hexdigest()[:32]
