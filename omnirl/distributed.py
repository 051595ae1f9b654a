"""Devices, the process group and the DeviceMesh, seeds and RNG states, the small collectives that are
no-ops without a process group; the run's hold on its output directory, and ranks that end with their
launcher. FSDP2 on the models and rank-0 loading live in `fsdp.py`.

Only this module and `memory.py` touch `torch.cuda` / `torch.npu`; everything else asks for the device.
One process per accelerator, started by torchrun (or run as a single process without it).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import fcntl
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from omnirl.errors import ConfigError


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # None when running as a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type() -> str:
    """'cuda' on NVIDIA, 'npu' on Ascend (torch_npu), else 'cpu'."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401  (registers the npu device)
    except ImportError:
        return "cpu"
    return "npu" if torch.get_device_module("npu").is_available() else "cpu"


def check_fp8_matmul(device: torch.device) -> None:
    """rollout.precision fp8 needs FP8 matrix multiplies: NVIDIA compute capability 8.9 or newer (Ada,
    Hopper, Blackwell), else a ConfigError naming the device. The CPU emulates them (the tests run there)."""
    if device.type == "cpu":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    raise ConfigError(
        f"rollout.precision fp8: the device {device} ({name}) has no FP8 matrix multiplies (NVIDIA compute "
        f"capability 8.9 or newer needed); use rollout.precision bf16"
    )


# Small host-side collectives (counts, metrics) run on gloo; tensors on the accelerator on nccl / hccl.
BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl", "cpu": "gloo"}


def local_device() -> torch.device:
    """This rank's device: its accelerator (LOCAL_RANK's under torchrun, else the first), or the CPU."""
    kind = device_type()
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", 0))) if kind != "cpu" else torch.device(kind)


def init_distributed(timeout_s: int = 600, group: bool = False) -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA, hccl on Ascend) and build a 1-D mesh.

    Without torchrun the process runs alone with no process group, unless `group`: FSDP2 (a sharded or
    offloaded frozen base, distributed.frozen_base) needs one and a mesh even on one device, so then a
    process group of one rank is made on an in-process store."""
    kind = device_type()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    elif kind == "npu":
        torch.get_device_module("npu").set_device(local_rank)
    device = local_device()
    if "RANK" not in os.environ:
        if not group:
            return DistInfo(0, 1, 0, device, None)
        if not dist.is_initialized():
            dist.init_process_group(
                BACKENDS[kind],
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if kind != "cpu" else None,
            )
        return DistInfo(0, 1, 0, device, init_device_mesh(kind, (1,), mesh_dim_names=("dp",)))
    exit_with_parent()
    if not dist.is_initialized():
        dist.init_process_group(
            BACKENDS[kind],
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if kind != "cpu" else None,
        )
    mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    return DistInfo(rank, world, local_rank, device, mesh)


def exit_with_parent() -> None:
    """End this rank with SIGKILL when its parent (torchrun) dies, however it dies (Linux's parent-death
    signal). torchrun stops its workers when it is told to stop (SIGTERM, SIGINT) or a worker fails, but
    a SIGKILL of torchrun itself would leave them training and writing checkpoints into a directory that
    the next run of the same command then shares. A parent that died before this call has already
    handed this process to another (init or a subreaper): then exit at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:
        os._exit(1)


LOCK_FILE = ".lock"
# output_dir (real path) -> (the open lock file on rank 0, None elsewhere; the directories its lock created,
# deepest first)
_locks: dict[str, tuple[int | None, list[str]]] = {}


def lock_output_dir(output_dir: str) -> None:
    """Hold `output_dir`/.lock (an exclusive flock, taken by rank 0) until `unlock_output_dir` or the end of
    the process (the kernel releases it however the process ends, SIGKILL included), so that a second run
    on the same directory fails at once with a ConfigError naming the holder instead of writing over this
    run's files. Called first thing in a run, before any model loads: of two runs started together on a
    new directory, the second is refused before it loads anything. A directory that cannot be created or
    written (under a file, on a read-only file system) is a ConfigError too. Collective."""
    key = os.path.realpath(output_dir)
    if key in _locks:
        return
    rank, world = rank_and_world()
    status: list = [None, False]  # [error, locked]
    if rank == 0:
        status = _take_lock(output_dir, key)
    if world > 1:
        dist.broadcast_object_list(status, src=0)
    if status[0]:
        raise ConfigError(status[0])
    if status[1] and rank != 0:
        _locks[key] = (None, [])


def _take_lock(output_dir: str, key: str) -> list:
    """[error or None, locked] for rank 0; on success `_locks[key]` holds the lock."""
    made = [p for p in [key, *map(str, Path(key).parents)] if not os.path.lexists(p)]  # deepest first
    lock = os.path.join(key, LOCK_FILE)
    try:
        os.makedirs(key, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip()
                os.close(fd)
                return [
                    f"run.output_dir {output_dir!r} is in use by another run "
                    f"({holder or 'a process that has not named itself yet'}): wait for it to end, stop it, "
                    "or choose another run.output_dir",
                    False,
                ]
            # A run that ended removed the file between our open and flock: lock the file there now.
            if os.path.exists(lock) and os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode())
    except OSError as e:
        _remove_empty(made)
        return [
            f"run.output_dir {output_dir!r} cannot be written: {e.strerror or e} ({e.filename or key})",
            False,
        ]
    _locks[key] = (fd, made)
    return [None, True]


def unlock_output_dir(output_dir: str) -> None:
    """Release what `lock_output_dir` took (a no-op where nothing is held): the lock file goes, and so do
    the directories the lock created when the run left them empty (a run refused before writing)."""
    fd, made = _locks.pop(os.path.realpath(output_dir), (None, []))
    if fd is None:
        return
    lock = os.path.join(os.path.realpath(output_dir), LOCK_FILE)
    with contextlib.suppress(OSError):
        if os.stat(lock).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock)  # still holding it: no other run can have taken this file
    os.close(fd)
    _remove_empty(made)


def _remove_empty(dirs: list[str]) -> None:
    """rmdir each of `dirs` (deepest first) until one is not empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int | None = 0) -> None:
    """Leave the process without interpreter finalization, once everything is written and closed: gloo's
    worker threads can still hold work objects with Python references after destroy_process_group, and
    tearing them down during finalization aborts the process now and then ("terminate called without an
    active exception", seen on CPU runs here), which would turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # None: `@record` turns a SystemExit(0) (--help) into a return of None


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def derive_seed(base_seed: int, step: int, index: int) -> int:
    """A request's seed from (base seed, step, global request index), never from the rank, so a run
    resumed on another number of ranks draws the same samples (a fixed 63-bit mix, no Python hash())."""
    x = (base_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (
        2**64 - 1
    )
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & (2**63 - 1)


def seed_everything(seed: int) -> None:
    """The same seed on every rank: LoRA init and anything else drawn from the global RNG must agree.
    Rollout noise never comes from here (per-request generators do that)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's global RNG states (python, numpy, torch, the accelerator's) as plain values and
    tensors, so a checkpoint can store them and `torch.load(weights_only=True)` read them back."""
    # numpy's legacy form, a tuple (typed together with the dict form)
    name, key, pos, has_gauss, gauss = cast(tuple, np.random.get_state())
    state = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    kind = device_type()
    if kind != "cpu":
        state[kind] = torch.get_device_module(kind).get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (an accelerator state only where this process has one)."""
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    kind = device_type()
    if kind != "cpu" and kind in state:
        torch.get_device_module(kind).set_rng_state(state[kind])


# The group that the collectives below (and checkpoints) run on: None is every rank of the job. The
# asynchronous mode (omnirl.async_mode) runs its training ranks and its rollout ranks each in a group of
# their own, so the code they share with the colocated loop reduces over the right ranks.
_group: dist.ProcessGroup | None = None


@contextlib.contextmanager
def within(group: dist.ProcessGroup | None):
    """Run the collectives of this module (and checkpoints) on `group` instead of every rank."""
    global _group
    previous, _group = _group, group
    try:
        yield
    finally:
        _group = previous


def group() -> dist.ProcessGroup | None:
    """The group the collectives run on (`within`); None: every rank."""
    return _group


def barrier() -> None:
    """Wait for every rank of the group; a no-op without a process group."""
    if dist.is_initialized() and dist.get_world_size(_group) > 1:
        dist.barrier(group=_group)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the group, (0, 1) without a process group."""
    if dist.is_initialized():
        return dist.get_rank(_group), dist.get_world_size(_group)
    return 0, 1


def all_gather_object(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] without a process group."""
    if not dist.is_initialized() or dist.get_world_size(_group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(_group)
    dist.all_gather_object(out, obj, group=_group)
    return out


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) that is a no-op without a process group."""
    if dist.is_initialized() and dist.get_world_size(_group) > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=_group)
    return t
