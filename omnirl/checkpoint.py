"""Checkpoints on torch.distributed.checkpoint (DCP): atomic save, resume, and export of what was trained.

`output_dir/checkpoints/step_000010/` holds the state after 10 steps (the run continues at step 10):

  model_optim/        DCP: the trainable weights (for a LoRA only the adapter's tensors), the optimizer
                      state and the ops object's own state (`KindOps.state`: DiffusionNFT's soft-updated
                      old policy), each rank writing its own shards; DCP reshards on load, so a run may
                      resume on another number of ranks
  rng/rank_00000.pt   each rank's python / numpy / torch (and accelerator) RNG states
  metrics.jsonl       the metrics rows of the steps before 10: a resumed run rewrites output_dir's file to
                      them, so it reads as if the run had never stopped
  meta.json           what must match to resume (adapter, model path, finetune mode, LoRA shape), the step,
                      the world size
  manifest.json       written last: the size and xxh3-128 hash of every other file

Nothing else is state: the prompts of a step come from (seed, step), request seeds from (seed, step,
index), the update's shuffle from (seed, step, -1), and the reward pool keeps nothing between steps.
There is no LR schedule (the learning rate is constant).

A checkpoint is written into `step_000010.tmp`, every file fsynced, then renamed by rank 0 after a
barrier (and the rename made durable), so a directory without `.tmp` is always complete: a kill during
a write leaves a `.tmp` that resume ignores and the next save removes.

Loading trusts nothing in the directory. Every file is checked against the manifest before anything is
read (`verify`: a flipped byte or a truncated shard is an error naming the file), the trained tensors are
checked to be finite after reading, and nothing is unpickled beyond plain data: DCP's `.metadata` goes
through an unpickler that admits only DCP's own metadata classes (`SafeReader`), its non-tensor items and
the RNG states through `torch.load(weights_only=True)` (`SafePlanner`). The manifest guards against damage,
not against tampering: whoever can write the files can write a matching manifest; what such a checkpoint
can still do is set the trained weights and optimizer state (see the README).
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl.config import Config, ConfigError, config_for

STEP_DIR = re.compile(r"step_(\d{6,})")
FORMAT = 2  # 2: manifest.json
MANIFEST = "manifest.json"
# Only trainable parameters are saved: the frozen base of a LoRA comes from model.path on every start.
OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Loading then leaves the frozen base alone (not strict); `check_tensors` has made sure that the
# checkpoint holds exactly the trainable tensors.
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed by this run (another model, damaged, unsafe); the message names the
    directory and what differs. A ConfigError: the entry points report it as one line."""


def identity(cfg: Config) -> dict:
    """The config values a checkpoint must agree on to be loaded: what decides which tensors exist and
    what they mean. Anything else (lr, steps, rewards, sampling) may change between launches."""
    path = cfg.model.path
    ident = {
        "model.adapter": cfg.model.adapter,
        # The same local model named by a relative or an absolute path is the same model.
        "model.path": os.path.realpath(path) if os.path.exists(path) else path,
        "model.finetune": cfg.model.finetune,
    }
    if cfg.model.finetune == "lora":
        ident |= {
            "lora.rank": cfg.lora.rank,
            "lora.alpha": cfg.lora.alpha,
            "lora.target_modules": sorted(cfg.lora.target_modules),
        }
    return ident


def identity_hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` (`step_NNNNNN`, never `*.tmp`), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint this run continues from (checkpoint.resume), or None for a fresh start; checked
    against the config (and the checkpoint section itself) before any model is built.

    Checkpoints of this output_dir newer than the one resumed (or any, for a fresh start) are an error:
    this run would write over them and a later `auto` could pick up the abandoned branch.

    The checkpoint returned has passed `verify` (every file as its manifest says); every rank calls this
    (the verification is shared out over the ranks)."""
    root = Path(cfg.run.output_dir) / "checkpoints"
    existing = step_dirs(root)
    resume = cfg.checkpoint.resume
    if resume == "auto":
        path = existing[-1][1] if existing else None
    elif resume:
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise CheckpointError(f"checkpoint.resume {resume!r}: not a checkpoint directory (no meta.json)")
    else:
        path = None
    if path is not None:
        verify(path)
    step = check_meta(path, cfg)["step"] if path is not None else 0
    newer = [p.name for s, p in existing if s > step and (path is None or p.resolve() != path.resolve())]
    if newer and cfg.checkpoint.every:
        start = f"resuming {path}" if path is not None else "starting fresh (checkpoint.resume '')"
        raise CheckpointError(
            f"{root} holds checkpoints after step {step} ({', '.join(newer)}) and this run, {start}, would "
            f"overwrite them: move them away, resume the newest (--checkpoint.resume auto), or choose "
            f"another run.output_dir"
        )
    return path


def check_meta(path: Path, cfg: Config) -> dict:
    """meta.json of the checkpoint at `path`, or a CheckpointError naming every field that differs."""
    meta = read_meta(path)
    mine = identity(cfg)
    theirs = meta["identity"]
    diffs = [
        f"{k}: checkpoint {theirs.get(k)!r}, this run {mine.get(k)!r}"
        for k in sorted(mine.keys() | theirs.keys())
        if theirs.get(k) != mine.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"{path} was written by run {meta['run_name']!r} for another model or recipe, so nothing was "
            f"loaded: {'; '.join(diffs)}"
        )
    return meta


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


def save(
    cfg: Config,
    steps_done: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dist,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the checkpoint after `steps_done` steps; every rank calls this (DCP save is collective).
    `extra`: tensors beyond the weights and the optimizer that the run's state holds (`KindOps.state`;
    DTensors sharded like the trained parameters), restored in place by `load`."""
    root = Path(cfg.run.output_dir) / "checkpoints"
    final = root / f"step_{steps_done:06d}"
    tmp = root / f"{final.name}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
        (tmp / "rng").mkdir(parents=True)
    D.barrier()
    state = {
        "model": get_model_state_dict(model, options=OPTIONS),
        "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
    }
    if extra:
        state["extra"] = dict(extra)
    # FileSystemWriter fsyncs every file it writes (sync_files defaults to True).
    dcp.save(state, checkpoint_id=tmp / "model_optim")
    _write(tmp / "rng" / f"rank_{dist.rank:05d}.pt", lambda f: torch.save(D.rng_state(), f))
    if dist.is_main:
        metrics = Path(cfg.run.output_dir) / "metrics.jsonl"
        rows = metrics.read_bytes() if metrics.is_file() else b""
        _write(tmp / "metrics.jsonl", lambda f: f.write(rows))
        ident = identity(cfg)
        meta = {
            "format": FORMAT,
            "step": steps_done,
            "world_size": dist.world_size,
            "run_name": cfg.run.name,
            "model_dtype": cfg.model.dtype,  # what export builds the model in
            "identity": ident,
            "identity_hash": identity_hash(ident),
        }
        _write(tmp / "meta.json", lambda f: f.write(json.dumps(meta, indent=2).encode()))
    D.barrier()  # every rank's files are written and fsynced
    write_manifest(tmp, dist)
    if dist.is_main:
        commit(tmp, final, cfg.checkpoint.keep)
    D.barrier()  # no rank goes on before the checkpoint exists
    return final


def commit(tmp: Path, final: Path, keep: int) -> None:
    """Make the finished `tmp` durable, rename it to `final`, then prune: the newest `keep` checkpoints
    stay, `.tmp` leftovers of killed writes go."""
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        _fsync_dir(d)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    for _, old in step_dirs(final.parent)[:-keep]:
        shutil.rmtree(old)
    for leftover in final.parent.glob("step_*.tmp"):
        shutil.rmtree(leftover)


def _write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_hash(path: Path) -> str:
    """xxh3-128 of a file, read in 16 MiB chunks (several GB/s: a resume hashes every file once)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt: Path, world_size: int) -> list[str]:
    """Every file of the checkpoint at `ckpt`, relative to it, without listing directories (on a shared
    filesystem another node's new files may not be listed yet, but they open): the DCP files named by its
    metadata, each rank's RNG file, meta.json and metrics.jsonl."""
    metadata = SafeReader(ckpt / "model_optim").read_metadata()
    shards = {f"model_optim/{info.relative_path}" for info in metadata.storage_data.values()}
    rng = [f"rng/rank_{r:05d}.pt" for r in range(world_size)]
    return sorted({"model_optim/.metadata", *shards, *rng, "meta.json", "metrics.jsonl"})


def write_manifest(tmp: Path, dist) -> None:
    """`tmp`/manifest.json: each file's size and hash, the hashing shared out over the ranks (collective);
    rank 0 writes it, after every other file."""
    files = _files(tmp, dist.world_size)
    mine = {
        rel: {"size": (tmp / rel).stat().st_size, "xxh3_128": file_hash(tmp / rel)}
        for rel in files[dist.rank :: dist.world_size]
    }
    entries = {k: v for part in D.all_gather_object(mine) for k, v in part.items()}
    if dist.is_main:
        manifest = {"format": FORMAT, "files": dict(sorted(entries.items()))}
        _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


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
        unlisted = sorted(set(_files(path, meta["world_size"])) - sizes.keys())
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


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items (the optimizer's param groups: numbers, strings,
    tuples) read with `torch.load(weights_only=True)` instead of unrestricted unpickling."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message is a paragraph; the line naming the refused global is the one that matters.
            reason = next((line for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
            raise CheckpointError(
                f"{read_item.dest_index.fqn}: not plain data, so it was not loaded ({reason})"
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
        dcp.load(state, storage_reader=SafeReader(path / "model_optim"), planner=SafePlanner())
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise
    check_finite(path, state)


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


def check_tensors(path: Path, model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> None:
    """The checkpoint's weights are exactly the model's trainable tensors, and (unless `extra` is None: only
    the weights are read) its extra state exactly `extra`'s tensors (an NFT run's old policy), by name and
    global shape; otherwise a CheckpointError before anything is loaded (meta.json matching makes this a
    formality, unless the files under model.path changed or the run keeps other state than the saved one,
    e.g. the old policy's soft update turned off or on)."""
    prefixes = ("model.",) if extra is None else ("model.", "extra.")
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in SafeReader(path / "model_optim").read_metadata().state_dict_metadata.items()
        if k.startswith(prefixes)
    }
    wanted = {k: tuple(v.shape) for k, v in get_model_state_dict(model, options=OPTIONS).items()}
    wanted.update({f"extra.{k}": tuple(v.shape) for k, v in (extra or {}).items()})
    problems = [f"missing {k}" for k in sorted(wanted.keys() - saved.keys())]
    problems += [f"unexpected {k}" for k in sorted(saved.keys() - wanted.keys())]
    problems += [
        f"{k}: checkpoint {saved[k]}, model {wanted[k]}"
        for k in sorted(saved.keys() & wanted.keys())
        if saved[k] != wanted[k]
    ]
    if problems:
        raise CheckpointError(
            f"{path}: its tensors do not fit this model, so nothing was loaded ({len(problems)} problems): "
            + "; ".join(problems[:5])
        )


def load(
    path: Path,
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dist,
    extra: dict[str, torch.Tensor] | None = None,
) -> tuple[int, list[dict]]:
    """Restore weights, optimizer state, `extra` (in place: the tensors `save` was given, as the ops
    object holds them) and this rank's RNG from `path` (verified by `find_resume`); every rank calls this.
    Non-finite weights or moments are a CheckpointError.

    Returns (the step to continue at, the metrics rows of the steps before it)."""
    meta = check_meta(path, cfg)
    check_tensors(path, model, extra or {})
    # The recipe's optimizer settings win over the checkpoint's (a resumed run may lower the lr).
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = {
        "model": get_model_state_dict(model, options=OPTIONS),
        "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
    }
    if extra:
        state["extra"] = dict(extra)  # DCP loads into these very tensors
    read_state(path, state)
    set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=LOAD_OPTIONS)
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)
    # A rank beyond the saved world size takes a saved rank's state; no rollout noise comes from these
    # generators (requests have their own), so this only matters to whatever else draws from them.
    rank = dist.rank % meta["world_size"]
    D.set_rng_state(torch.load(path / "rng" / f"rank_{rank:05d}.pt", weights_only=True))
    history = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line]
    D.print0(f"resumed from {path} at step {meta['step']} (saved on {meta['world_size']} ranks)")
    return meta["step"], history


def load_weights(path: Path, model: nn.Module) -> None:
    """Only the trained weights of a verified checkpoint into `model` (one process, for export); non-finite
    ones are a CheckpointError."""
    check_tensors(path, model)
    state = {"model": get_model_state_dict(model, options=OPTIONS)}
    read_state(path, state)
    set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)


# Export: what `scripts/export.py` writes. The diffusers LoRA format is the hub: a checkpoint becomes one
# through the adapter's own `export_lora`, and the peft and merged formats are made from that file.
LORA_FILE = "pytorch_lora_weights.safetensors"


def adapter_from_checkpoint(path: Path, model_path: str = "") -> tuple[object, Config]:
    """The adapter a checkpoint was trained on, built on the host from meta.json (`model_path` replaces the
    recorded model.path, e.g. on another machine), with the checkpoint's weights loaded; and its config.
    The checkpoint is verified first."""
    verify(path)
    meta = read_meta(path)
    ident = meta["identity"]
    cfg = config_for(ident["model.adapter"])
    cfg.model.path = model_path or ident["model.path"]
    cfg.model.finetune = ident["model.finetune"]
    cfg.model.dtype = meta["model_dtype"]
    if cfg.model.finetune == "lora":
        cfg.lora.rank, cfg.lora.alpha = ident["lora.rank"], ident["lora.alpha"]
        cfg.lora.target_modules = ident["lora.target_modules"]
    from omnirl.models import get_adapter

    adapter = get_adapter(cfg.model.adapter)(cfg, torch.device("cpu"))
    load_weights(path, adapter.policy)
    return adapter, cfg


def lora_to_peft(lora_dir: Path, out_dir: Path, model_path: str = "") -> None:
    """A diffusers-format LoRA of the transformer -> the peft format (`adapter_config.json` +
    `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(<the base transformer>, out_dir)`
    loads. The LoRA's config comes from the metadata the diffusers file carries."""
    import peft
    from safetensors import safe_open
    from safetensors.torch import save_file

    from omnirl.models.peft_lora import sorted_sets

    file = Path(lora_dir) / LORA_FILE
    with safe_open(file, "pt") as f:
        metadata = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    others = [k for k in tensors if not k.startswith("transformer.")]
    if others or not metadata:
        raise ValueError(
            f"{file}: not a transformer LoRA with its config in the metadata, as omnirl exports it "
            f"(keys outside the transformer: {others[:3]}; metadata present: {bool(metadata)})"
        )
    config = peft.LoraConfig.from_peft_type(
        **{k.removeprefix("transformer."): v for k, v in metadata.items() if k.startswith("transformer.")}
    )
    config.base_model_name_or_path = model_path or None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # PeftModel's own key layout: the wrapped model sits at base_model.model.
    save_file(
        {"base_model.model." + k.removeprefix("transformer."): v for k, v in tensors.items()},
        out_dir / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    sorted_sets(config).save_pretrained(out_dir)


def save_merged(
    model_path: str, out_dir: Path, dtype: torch.dtype, lora_dir: Path | None = None, policy=None
) -> None:
    """The whole diffusers pipeline of `model_path` in safetensors, with the LoRA of `lora_dir` fused into
    the transformer's weights (diffusers' `fuse_lora`, in float32) or with a fully fine-tuned `policy` in
    place of the pipeline's transformer."""
    from diffusers import DiffusionPipeline

    extra = {"transformer": policy} if policy is not None else {}
    pipe = DiffusionPipeline.from_pretrained(model_path, torch_dtype=torch.float32, **extra)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    pipe.to(dtype).save_pretrained(out_dir, safe_serialization=True)


def export_lora(cfg: Config, adapter, policy: nn.Module, dist) -> None:
    """Gather the full (unsharded) LoRA of `policy` to rank 0 and write it there in the adapter's format
    (diffusers for diffusion adapters, peft for omni ones) under output_dir/lora. The frozen base is not
    gathered: at 30B parameters it would be ~60 GB of host memory for nothing."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(policy, options=options)
    if dist.is_main:
        adapter.export_lora(f"{cfg.run.output_dir}/lora", state)
