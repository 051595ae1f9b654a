"""What loading a checkpoint trusts: nothing in the directory (its layout: omnirl/checkpoint.py).

Every file is checked against the manifest before anything is read (`verify`: a flipped byte or a truncated
shard is an error naming the file), meta.json is checked to hold what loading reads (`read_meta`), the
trained tensors are checked to be finite after reading (`check_finite`), and nothing is unpickled beyond
plain data: DCP's `.metadata` goes through an unpickler that admits only DCP's own metadata classes
(`SafeReader`), its non-tensor items and the RNG states through `torch.load(weights_only=True)`
(`SafePlanner`). The manifest guards against damage, not against tampering: whoever can write the files can
write a matching manifest; what such a checkpoint can still do is set the trained weights and optimizer
state (docs/failures.md).
"""

from __future__ import annotations

import enum
import io
import json
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl.errors import ConfigError
from omnirl.weights import LOAD_ERRORS, load_fault

FORMAT = 2  # 2: manifest.json
MANIFEST = "manifest.json"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed by this run (another model, damaged, unsafe); the message names the
    directory and what differs. A ConfigError: the entry points report it as one line."""


def read_meta(path: Path) -> dict:
    """meta.json of the checkpoint at `path`, checked to hold what loading reads; else a CheckpointError."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{meta_file}: checkpoint format {found!r}, expected {FORMAT}")
    fields = {"step": int, "world_size": int, "run_name": str, "model_dtype": str, "identity": dict}
    for key, tp in fields.items():
        if not isinstance(meta.get(key), tp) or isinstance(meta.get(key), bool):
            raise CheckpointError(f"{meta_file}: {key!r} must be a {tp.__name__}, got {meta.get(key)!r}")
    if meta["step"] < 0 or meta["world_size"] < 1:
        raise CheckpointError(
            f"{meta_file}: step {meta['step']} / world_size {meta['world_size']} out of range"
        )
    return meta


def file_hash(path: Path) -> str:
    """xxh3-128 of a file, read in 16 MiB chunks (a resume hashes every file once)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(ckpt: Path, world_size: int) -> list[str]:
    """Every file of the checkpoint at `ckpt`, relative to it, without listing directories (on a shared
    filesystem another node's new files may not be listed yet, but they open): the DCP files named by its
    metadata, each rank's RNG file, meta.json and metrics.jsonl."""
    metadata = SafeReader(ckpt / "model_optim").read_metadata()
    shards = {f"model_optim/{info.relative_path}" for info in metadata.storage_data.values()}
    rng = [f"rng/rank_{r:05d}.pt" for r in range(world_size)]
    return sorted({"model_optim/.metadata", *shards, *rng, "meta.json", "metrics.jsonl"})


def verify(path: Path) -> None:
    """Every file of the checkpoint at `path` has the size and hash its manifest records, and the manifest
    lists every file DCP's metadata names; else a CheckpointError naming the files. Every rank of a run
    calls it, each hashing its share of the files (collective when there is a process group)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})")
    try:
        files = json.loads(manifest_file.read_text())["files"]
        sizes = {rel: (int(e["size"]), str(e["xxh3_128"])) for rel, e in files.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_file}: not a manifest omnirl wrote ({e!r})") from None
    rank, world = D.rank_and_world()
    problems = []
    for rel in sorted(sizes)[rank::world]:
        size, digest = sizes[rel]
        f = path / rel
        if ".." in Path(rel).parts or not f.is_file():
            problems.append(f"{rel}: missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel}: {f.stat().st_size} bytes, the manifest says {size}")
        elif file_hash(f) != digest:
            problems.append(f"{rel}: its content changed after it was written (hash mismatch)")
    problems = [p for part in D.all_gather_object(problems) for p in part]
    if not problems and "model_optim/.metadata" in sizes:
        meta = read_meta(path)
        unlisted = sorted(set(checkpoint_files(path, meta["world_size"])) - sizes.keys())
        problems = [f"{rel}: not in the manifest" for rel in unlisted]
    elif not problems:
        problems = ["model_optim/.metadata: not in the manifest"]
    if problems:
        raise CheckpointError(
            f"{path} is damaged, so nothing was loaded ({len(problems)} files): " + "; ".join(problems[:5])
        )


# What DCP's `.metadata` pickle may name: its metadata classes and the torch / pathlib values they hold.
# Anything else (os.system, builtins.eval, ...) fails to load instead of running.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a torch.layout by its name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


def _enum_member(cls, name: str):
    """`getattr` as the metadata pickle may call it: some Python versions (3.11.0-3.11.4) pickle an enum
    member as getattr(its class, its name); only members of the metadata's own enums resolve."""
    if not (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__qualname__) in METADATA_CLASSES
        and isinstance(name, str)
        and name in cls.__members__
    ):
        raise pickle.UnpicklingError(
            f"getattr({cls!r}, {name!r}) is not an enum member of checkpoint metadata"
        )
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class of checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, its `.metadata` read with `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: not checkpoint metadata, so nothing was loaded ({e})") from None
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's read, a shard that cannot be parsed (replaced bytes under a rewritten manifest: the manifest
        guards against damage, not tampering) a CheckpointError naming its files instead of a traceback."""
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:  # any failure to parse these untrusted bytes means they are not a shard
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            reason = load_fault(e) if isinstance(e, pickle.UnpicklingError) else _first_line(e)
            raise CheckpointError(
                f"{Path(self.path) / files[0] if len(files) == 1 else Path(self.path)}: not a checkpoint "
                f"shard omnirl wrote, so nothing was loaded ({reason})"
            ) from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items (the optimizer's param groups: numbers, strings,
    tuples) read with `torch.load(weights_only=True)` instead of unrestricted unpickling."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except LOAD_ERRORS as e:
            raise CheckpointError(
                f"{read_item.dest_index.fqn}: not plain data, so it was not loaded ({load_fault(e)})"
            ) from None
        value = io.BytesIO()  # what the default planner reads, now known to be plain data
        torch.save(obj, value)
        value.seek(0)
        super().load_bytes(read_item, value)


def read_state(path: Path, state: dict) -> None:
    """`dcp.load` of the checkpoint at `path` into `state` through `SafeReader` and `SafePlanner`, then
    `check_finite`. DCP wraps what a rank raised in a CheckpointException (a BaseException): our own
    CheckpointError comes out as itself."""
    try:
        dcp.load(
            state,
            storage_reader=SafeReader(path / "model_optim"),
            planner=SafePlanner(),
            process_group=D.group(),
        )
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise
    check_finite(path, state)


def read_rng_and_history(path: Path, rank: int) -> tuple[dict, list[dict]]:
    """The RNG states of saved rank `rank` (`torch.load(weights_only=True)`) and the metrics rows of the
    checkpoint at `path`, each checked to be what omnirl writes; else a CheckpointError naming the file, on
    every rank (collective when there is a process group)."""
    problems, rng, history = [], {}, []
    rng_file = path / "rng" / f"rank_{rank:05d}.pt"
    try:
        rng = torch.load(rng_file, weights_only=True)
    except Exception as e:  # any failure to parse these untrusted bytes means they are not an RNG file
        problems.append(f"{rng_file}: not an RNG state file omnirl wrote ({load_fault(e)})")
    else:
        if not (isinstance(rng, dict) and {"python", "numpy", "torch"} <= rng.keys()):
            problems.append(
                f"{rng_file}: not an RNG state file omnirl wrote (no python / numpy / torch states)"
            )
    metrics = path / "metrics.jsonl"
    try:
        for i, line in enumerate(metrics.read_text().splitlines(), 1):
            if line:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"line {i} is a {type(row).__name__}, not a metrics row")
                history.append(row)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        problems.append(f"{metrics}: not metrics rows omnirl wrote ({_first_line(e)})")
    problems = [p for part in D.all_gather_object(problems) for p in part]
    if problems:
        raise CheckpointError(f"{path} is damaged, so nothing was loaded: " + "; ".join(problems[:3]))
    return rng, history


def check_finite(path: Path, state: dict) -> None:
    """Every floating-point tensor of a loaded `state` (weights, optimizer moments; nested dicts) is finite,
    on every rank; else a CheckpointError naming them (collective when there is a process group)."""
    bad = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not bool(torch.isfinite(local).all()):
                bad.append(prefix)

    walk("", state)
    bad = sorted({name for part in D.all_gather_object(bad) for name in part})
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} trained tensors hold NaN or infinity, e.g. {', '.join(bad[:3])}; a policy "
            "with them makes NaN samples, so they are not used (take an earlier checkpoint)"
        )
