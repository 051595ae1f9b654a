"""Checkpoints on torch.distributed.checkpoint (DCP): atomic save, resume, and export of what was trained.

`save` writes `output_dir/checkpoints/step_NNNNNN/` (DCP's weights, optimizer and ops state, every
rank's RNG states, the metrics so far, meta.json) into a `.tmp` directory and `commit`s it by a rename
after its `manifest.json`; `find_resume` and `load` continue a run (checked first by `check_meta`,
`check_tensors` and `omnirl.checkpoint_checks`); `adapter_from_checkpoint`, `load_weights` and
`export_lora` serve the exports.

How it works: docs/checkpoints.md#what-a-checkpoint-holds
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from omnirl import distributed as D
from omnirl.checkpoint_checks import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    SafeReader,
    checkpoint_files,
    file_hash,
    read_meta,
    read_rng_and_history,
    read_state,
    verify,
)
from omnirl.config import Config
from omnirl.config_checks import check_model_path
from omnirl.recipe import config_for

STEP_DIR = re.compile(r"step_(\d{6,})")
# Only trainable parameters are saved: the frozen base of a LoRA comes from model.path on every start.
OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Loading then leaves the frozen base alone (not strict); `check_tensors` has made sure that the
# checkpoint holds exactly the trainable tensors.
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


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
    if cfg.distributed.mode == "async":  # its checkpoints hold samples generated ahead of the update
        ident |= {"distributed.mode": "async", "distributed.max_staleness": cfg.distributed.max_staleness}
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


def due(cfg: Config, steps_done: int) -> bool:
    """Whether checkpoint.every asks for a checkpoint after `steps_done` steps: every `every` steps and
    after the run's last one (never with every 0)."""
    every = cfg.checkpoint.every
    return bool(every) and (steps_done % every == 0 or steps_done == cfg.run.steps)


def save(
    cfg: Config,
    steps_done: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dist,
    extra: dict[str, torch.Tensor] | None = None,
    rank_file: tuple[str, bytes] | None = None,
    when_due: bool = False,
) -> Path | None:
    """Write the checkpoint after `steps_done` steps; every rank calls this (DCP save is collective).
    `extra`: tensors beyond the weights and the optimizer that the run's state holds (`KindOps.state`;
    DTensors sharded like the trained parameters), restored in place by `load`. `rank_file` (NAME, bytes),
    given on every rank or on none: each rank's own state beyond those, written to NAME/rank_RRRRR.pt and
    hashed in the manifest (the asynchronous mode's generated-but-untrained samples). `when_due`: only if
    checkpoint.every asks for one after `steps_done` steps (`due`); returns None when nothing is written."""
    if when_due and not due(cfg, steps_done):
        return None
    root = Path(cfg.run.output_dir) / "checkpoints"
    final = root / f"step_{steps_done:06d}"
    tmp = root / f"{final.name}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing this step
        (tmp / "rng").mkdir(parents=True)
        if rank_file is not None:
            (tmp / rank_file[0]).mkdir()
    D.barrier()
    state = {
        "model": get_model_state_dict(model, options=OPTIONS),
        "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
    }
    if extra:
        state["extra"] = dict(extra)
    # FileSystemWriter fsyncs every file it writes (sync_files defaults to True).
    dcp.save(state, checkpoint_id=tmp / "model_optim", process_group=D.group())
    _write(tmp / "rng" / f"rank_{dist.rank:05d}.pt", lambda f: torch.save(D.rng_state(), f))
    if rank_file is not None:
        name, data = rank_file
        _write(tmp / name / f"rank_{dist.rank:05d}.pt", lambda f: f.write(data))
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
    write_manifest(tmp, dist, [rank_file[0]] if rank_file is not None else [])
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


def write_manifest(tmp: Path, dist, rank_dirs: list[str] | None = None) -> None:
    """`tmp`/manifest.json: each file's size and hash, the hashing shared out over the ranks (collective);
    rank 0 writes it, after every other file. `rank_dirs`: folders holding one file per rank
    (`save`'s `rank_file`)."""
    per_rank = [f"{d}/rank_{r:05d}.pt" for d in rank_dirs or [] for r in range(dist.world_size)]
    files = sorted(checkpoint_files(tmp, dist.world_size) + per_rank)
    mine = {
        rel: {"size": (tmp / rel).stat().st_size, "xxh3_128": file_hash(tmp / rel)}
        for rel in files[dist.rank :: dist.world_size]
    }
    entries = {k: v for part in D.all_gather_object(mine) for k, v in part.items()}
    if dist.is_main:
        manifest = {"format": FORMAT, "files": dict(sorted(entries.items()))}
        _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def check_tensors(path: Path, model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> None:
    """The checkpoint's weights are exactly the model's trainable tensors, and (unless `extra` is None: only
    the weights are read) its extra state exactly `extra`'s tensors (an NFT run's old policy), by name and
    global shape; otherwise a CheckpointError before anything is loaded (meta.json matching makes this a
    formality, unless the files under model.path changed or the run keeps other state than the saved one,
    e.g. the old policy's soft update turned off or on)."""
    prefixes = ("model.",) if extra is None else ("model.", "extra.")
    saved = {}
    for k, v in SafeReader(path / "model_optim").read_metadata().state_dict_metadata.items():
        if k.startswith(prefixes):
            assert isinstance(v, TensorStorageMetadata)  # the weights and the extra state are tensors
            saved[k.removeprefix("model.")] = tuple(v.size)
    # (torch types a state dict's values as any state; a model's are tensors)
    wanted = {k: tuple(v.shape) for k, v in get_model_state_dict(model, options=OPTIONS).items()}  # pyright: ignore[reportAttributeAccessIssue]
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
    # A rank beyond the saved world size takes a saved rank's state; no rollout noise comes from these
    # generators (requests have their own), so this only matters to whatever else draws from them.
    rng, history = read_rng_and_history(path, dist.rank % meta["world_size"])
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
    try:
        D.set_rng_state(rng)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}/rng: an RNG state this process cannot take ({e})") from None
    D.print0(f"resumed from {path} at step {meta['step']} (saved on {meta['world_size']} ranks)")
    return meta["step"], history


def load_weights(path: Path, model: nn.Module) -> None:
    """Only the trained weights of a verified checkpoint into `model` (one process, for export); non-finite
    ones are a CheckpointError."""
    check_tensors(path, model)
    state = {"model": get_model_state_dict(model, options=OPTIONS)}
    read_state(path, state)
    set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)


# Export: what `scripts/export.py` writes goes through the adapter a checkpoint was trained on (its
# `export_lora` and `export_merged`); reading and converting LoRA directories is omnirl/export.py's.
LORA_FILE = "pytorch_lora_weights.safetensors"


def adapter_from_checkpoint(path: Path, model_path: str = "") -> tuple[object, Config]:
    """The adapter a checkpoint was trained on, built on the host from meta.json (`model_path` replaces the
    recorded model.path, e.g. on another machine), with the checkpoint's weights loaded; and its config.
    The checkpoint is verified first."""
    verify(path)
    meta = read_meta(path)
    ident = meta["identity"]
    cfg = config_for(ident["model.adapter"])
    fields = {"model.adapter": str, "model.path": str, "model.finetune": str}
    if ident.get("model.finetune") == "lora":
        fields |= {"lora.rank": int, "lora.alpha": (int, float), "lora.target_modules": list}
    for key, tp in fields.items():
        if not isinstance(ident.get(key), tp):
            raise CheckpointError(f"{path}/meta.json: identity[{key!r}] is missing or of the wrong type")
    if not model_path:
        what = f"model.path (recorded in {path}/meta.json; --model-path replaces it)"
        check_model_path(ident["model.path"], what)
    cfg.model.path = model_path or ident["model.path"]
    cfg.model.finetune = ident["model.finetune"]
    cfg.model.dtype = meta["model_dtype"]
    if cfg.model.finetune == "lora":
        cfg.lora.rank, cfg.lora.alpha = ident["lora.rank"], ident["lora.alpha"]
        cfg.lora.target_modules = ident["lora.target_modules"]
    from omnirl.models import get_adapter
    from omnirl.weights import check_weight_files

    check_weight_files(cfg.model.path)  # a damaged file of the base model is named before any loads
    adapter = get_adapter(cfg.model.adapter)(cfg, torch.device("cpu"))
    load_weights(path, adapter.policy)
    return adapter, cfg


def export_lora(cfg: Config, adapter, policy: nn.Module, dist) -> None:
    """Gather the full (unsharded) LoRA of `policy` to rank 0 and write it there in the adapter's format
    (diffusers for diffusion adapters, peft for omni ones) under output_dir/lora. The frozen base is not
    gathered: at 30B parameters it would be ~60 GB of host memory for nothing."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(policy, options=options)
    if dist.is_main:
        adapter.export_lora(f"{cfg.run.output_dir}/lora", state)
