"""Phases of a step and the device memory they use: sleep/wake between rollout and training.

`phase("rollout" | "train", stats, sleeper, sleep=..., wake=...)` brackets one half of an RL step: it
puts to sleep what the phase does not need, wakes what it needs, frees the allocator's cache on exit and
reports the bytes moved, the transition times and the phase's peak memory. `Sleeper` moves a tensor's
storage, in place, to pinned host chunks reused by every later sleep, and back; `Phases` names what each
phase sleeps. Also: free device memory, `peak_bytes` of a call, `cap_device_memory`.

Only this module and `distributed.py` touch `torch.cuda` / `torch.npu`.

How it works: docs/memory.md#sleep-and-wake
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30
CHUNK_BYTES = 1 << 30  # one pinned host chunk: a power of two, so the pinned allocator wastes nothing
# Storages below this size are packed. A host<->device copy has a fixed cost of several microseconds,
# ~3% of a 16 MiB transfer at ~50 GiB/s; packing costs an extra device-side copy at a few TB/s, also
# a few % of the transfer: the two meet near 16 MiB (benchmarks/sleep_wake.py compares thresholds).
PACK_BELOW = 16 << 20
RUN_BYTES = 64 << 20  # the most packed bytes per transfer: the transient device staging buffer
ALIGN = 256  # large storages start aligned in their chunk, for the copy engines; wastes < 256 bytes each


def _accel():
    """The accelerator's torch module (torch.cuda or torch.npu), or None on CPU."""
    if torch.cuda.is_available():
        return torch.cuda
    npu = getattr(torch, "npu", None)  # present only after `import torch_npu`
    if npu is not None and npu.is_available():
        return npu
    return None


def restart_peak() -> None:
    """From here on a phase's peak and reservation (`phase`: `mem/{name}_peak_gib`, `_reserved_gib`) count
    its own work: what ran before inside it (the checkpointing probe of step 0's update, sized for a layout
    the update may not use) is handed back and forgotten. The steady steps, which run no probe, have the
    peaks a sleep decision should read."""
    accel = _accel()
    if accel is None:
        return
    empty_cache()
    accel.reset_peak_memory_stats()


def empty_cache() -> None:
    gc.collect()
    accel = _accel()
    if accel is not None:
        accel.empty_cache()


_graphs_frozen = 0  # dynamo's count of compiled graphs when `freeze_compiled` last froze


def freeze_compiled() -> bool:
    """After code was compiled (dynamo counts graphs it has not frozen yet): collect, then move every
    surviving object into the collector's permanent generation (`gc.freeze`). A compiled step leaves
    dynamo's graphs and guards and inductor's kernels behind, hundreds of thousands of objects that live
    as long as the process, and every full collection (`empty_cache`, four per step) would walk them all
    again: on a compiled SD3.5 step that was most of the time outside its phases. Frozen objects are
    still freed by reference counting; only a reference cycle among them stays until `gc.unfreeze`
    (scripts/train.py unfreezes when the run ends). Returns whether it froze."""
    global _graphs_frozen
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    if graphs == _graphs_frozen:
        return False
    _graphs_frozen = graphs
    gc.collect()
    gc.freeze()
    return True


def synchronize() -> None:
    accel = _accel()
    if accel is not None:
        accel.synchronize()


_cap: dict[str, int] = {}  # the device this process was capped on (`cap_device_memory`) -> bytes


def cap_device_memory(gib: float, device: torch.device) -> None:
    """Let this process allocate at most `gib` GiB on its accelerator, as if it had a smaller one (torch's
    per-process memory fraction: an allocation past it fails as out of memory), and `free_bytes` count
    from that cap. For measuring what fits on 80 GB GPUs on a larger one. No effect on CPU."""
    accel = _accel()
    if accel is None or device.type == "cpu":
        return
    total = accel.get_device_properties(device).total_memory
    if gib * GIB > total:
        raise ValueError(f"a cap of {gib} GiB is more than the device's {total / GIB:.1f} GiB")
    accel.set_per_process_memory_fraction(gib * GIB / total, device)
    _cap[str(device)] = int(gib * GIB)


def device_bytes(device: torch.device) -> int:
    """The accelerator memory this process may use: the device's, or the cap of `cap_device_memory`; 0 on
    CPU."""
    accel = _accel()
    if accel is None or device.type == "cpu":
        return 0
    cap = _cap.get(str(device))
    return cap if cap is not None else accel.get_device_properties(device).total_memory


def free_bytes(device: torch.device) -> int:
    """The memory a phase could still allocate on `device`: the accelerator's free memory plus the blocks
    torch's allocator caches but no tensor uses (at most the cap less what is allocated, under
    `cap_device_memory`); on CPU, where the device is the host, the host's available memory
    (MemAvailable)."""
    accel = _accel()
    if accel is not None and device.type != "cpu":
        free, _ = accel.mem_get_info(device)
        allocated = accel.memory_allocated(device)
        free += accel.memory_reserved(device) - allocated
        cap = _cap.get(str(device))
        return free if cap is None else min(free, cap - allocated)
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return (
        int(fields["MemAvailable"].split()[0]) * 1024
        if "MemAvailable" in fields
        else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    )


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of CPU tensor storages created while it is active and still alive (CPU has no
    allocator statistics): every op's outputs are counted when they appear and uncounted when their
    storage is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            # A tensor subclass (FSDP2's DTensor) has no storage of its own: its local tensor is counted.
            if type(t) is not torch.Tensor or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n == 0 or key in self.live:  # a view or an in-place result: already counted
                continue
            self.live[key] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The most memory `fn()` holds at once on `device` beyond what was allocated when it started: the
    allocator's peak on an accelerator (which resets the peak statistic a `phase` reports: call it before
    the phase's own work), the live tensor storages on CPU."""
    accel = _accel()
    if accel is not None and device.type != "cpu":
        synchronize()
        start = accel.memory_allocated(device)
        accel.reset_peak_memory_stats(device)
        fn()
        synchronize()
        return accel.max_memory_allocated(device) - start
    with _LiveBytes() as tracker:
        fn()
    return tracker.peak


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of an optimizer's state (AdamW: exp_avg, exp_avg_sq, step); none before the first step."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _device_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """The bytes of the distinct storages of `tensors` (a DTensor's local shard) on `device`'s type."""
    storages: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type == device.type:
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def module_tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The parameters and buffers of `modules` (tied ones once)."""
    return [t for m in modules for t in [*m.parameters(), *m.buffers()]]


@dataclass
class _Run:
    """Whole storages (indices into `_Plan.storages`), packed tight at `offset` of one chunk."""

    chunk: int
    offset: int
    members: list[int] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Piece:
    """Bytes [start, start + nbytes) of a large storage, at `offset` of one chunk."""

    chunk: int
    offset: int
    index: int
    start: int
    nbytes: int


@dataclass
class _Plan:
    """Where a group's storages go in the host chunks. Kept and reused while the group's storages stay the
    same objects (step after step), so a transition costs no per-tensor Python work beyond a resize."""

    storages: list[torch.UntypedStorage]
    sizes: list[int]
    views: list[torch.Tensor]  # uint8 over each whole storage: valid again whenever it is resized back
    chunks: int  # how many chunks the layout spans
    runs: list[_Run]
    pieces: list[_Piece]


def _layout(sizes: list[int], chunk_bytes: int) -> tuple[int, list[_Run], list[_Piece]]:
    """Place storages of `sizes` bytes in chunks, in order: (chunks used, packed runs, pieces).

    A small storage never straddles chunks and joins the current run; a large one starts aligned and
    spills over as many chunks as it needs."""
    small = min(PACK_BELOW, chunk_bytes)
    runs: list[_Run] = []
    pieces: list[_Piece] = []
    chunk, offset, run = 0, 0, None
    for i, n in enumerate(sizes):
        if n < small:
            if offset + n > chunk_bytes:
                chunk, offset, run = chunk + 1, 0, None
            if run is None or run.nbytes + n > RUN_BYTES:
                run = _Run(chunk, offset)
                runs.append(run)
            run.members.append(i)
            run.nbytes += n
            offset += n
            continue
        run = None
        offset = -(-offset // ALIGN) * ALIGN
        start = 0
        while start < n:
            if offset >= chunk_bytes:
                chunk, offset = chunk + 1, 0
            k = min(n - start, chunk_bytes - offset)
            pieces.append(_Piece(chunk, offset, i, start, k))
            start, offset = start + k, offset + k
    used = chunk + 1 if sizes else 0
    return used, runs, pieces


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Sleeper:
    """Puts named groups of tensors to sleep in reusable host chunks and wakes them bit-exact.

    `chunks` are allocated (pinned when there is an accelerator) the first time they are needed and kept;
    a group that wakes hands its chunks back for the next sleep to reuse. `reserve` allocates them ahead,
    in a background thread, so that the first sleep does not wait while gigabytes are page-locked.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.pin = self.device.type != "cpu"
        self.chunks: list[torch.Tensor] = []  # [chunk_bytes] uint8 each, on the host
        self._free: list[int] = []  # indices of chunks no group holds
        self._plans: dict[str, _Plan] = {}
        self._asleep: dict[str, tuple[_Plan, list[int]]] = {}  # name -> (plan, indices of its chunks)
        self._reserving: threading.Thread | None = None
        self._reserved: list[torch.Tensor] = []  # chunks the reserving thread made, not yet in `chunks`
        self.reserve_s: float | None = None  # how long the last reservation took, until `take_reserve_s`

    def reserve(self, nbytes: int) -> int:
        """Start allocating, in a background thread, the chunks that `nbytes` asleep at once will need beyond
        those already held; returns how many it allocates. Pinning a fresh buffer takes about a second a
        few GiB (the page-locking of every page), which a run's first sleeps otherwise wait for; allocated
        while the first rollout runs, it costs the step nothing. The next sleep takes the chunks (waiting
        for the thread if it has not finished); a sleep that needs more allocates the rest as before."""
        self._collect()
        n = -(-nbytes // self.chunk_bytes) - len(self.chunks)
        if n <= 0:
            return 0
        accel, device = _accel(), self.device

        def allocate() -> None:
            start = time.perf_counter()
            if accel is not None and device.index is not None:
                accel.set_device(device)  # this thread's current device: the one the copies run on
            for _ in range(n):
                self._reserved.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin))
            self.reserve_s = time.perf_counter() - start

        self._reserving = threading.Thread(target=allocate, name="omnirl-host-chunks", daemon=True)
        self._reserving.start()
        return n

    def _collect(self) -> None:
        """Wait for a reservation under way and add its chunks to the free ones."""
        if self._reserving is None:
            return
        self._reserving.join()
        self._reserving = None
        self._free += range(len(self.chunks), len(self.chunks) + len(self._reserved))
        self.chunks += self._reserved
        self._reserved = []

    def take_reserve_s(self) -> float | None:
        """The seconds the last finished reservation's thread took (beside the phases), once."""
        took, self.reserve_s = (self.reserve_s, None) if self._reserving is None else (None, self.reserve_s)
        return took

    def is_asleep(self, name: str) -> bool:
        return name in self._asleep

    def release(self) -> int:
        """Hand the host chunks back, while nothing is asleep (a reservation under way is waited for); a
        later sleep allocates afresh. Returns the bytes freed (0 while a group sleeps)."""
        self._collect()
        if self._asleep:
            return 0
        freed = self.host_bytes
        self.chunks, self._free = [], []
        return freed

    @property
    def host_bytes(self) -> int:
        return len(self.chunks) * self.chunk_bytes

    def _take_chunks(self, n: int) -> list[int]:
        if len(self._free) < n:  # a sleep of nothing (step 0's rollout) leaves the reservation running
            self._collect()
        self._free.sort()  # lowest first: the same chunks serve the same group step after step
        while len(self._free) < n:
            self._free.append(len(self.chunks))
            self.chunks.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin))
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def _plan(self, name: str, tensors: Iterable[torch.Tensor]) -> _Plan:
        storages: dict[int, torch.UntypedStorage] = {}
        users: dict[int, list[torch.Tensor]] = {}  # the tensors on each storage
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if local.device.type != self.device.type or storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            storages.setdefault(key, storage)
            users.setdefault(key, []).append(t)
        plan = self._plans.get(name)
        if plan is not None and len(plan.storages) == len(storages):
            same = zip(plan.storages, plan.sizes, storages.values())
            if all(a is b and b.nbytes() == n for a, n, b in same):
                return plan
        kept = []
        for key, storage in storages.items():
            if not storage.resizable():
                # A CPU tensor mmap'd from a safetensors file cannot be resized: its users move, once, to
                # a copy that can (sharing it as they shared the original).
                assert not any(isinstance(t, DTensor) for t in users[key]), "a DTensor on an mmap'd storage"
                fresh = torch.UntypedStorage(storage.nbytes(), device=storage.device)
                fresh.copy_(storage)
                for t in users[key]:
                    t.set_(fresh, t.storage_offset(), t.size(), t.stride())
                storage = fresh
            kept.append(storage)
        sizes = [s.nbytes() for s in kept]
        used, runs, pieces = _layout(sizes, self.chunk_bytes)
        plan = _Plan(kept, sizes, [_bytes(s) for s in kept], used, runs, pieces)
        self._plans[name] = plan
        return plan

    @torch.no_grad()
    def sleep(self, name: str, tensors: Iterable[torch.Tensor]) -> int:
        """Move the storage of `tensors` to the host and free it on the device; returns the bytes moved.

        A DTensor sleeps by its local shard. Tensors on another device (AdamW's `step` counters on the
        host), storages already freed (FSDP2's resharded parameters) and repeats are skipped. A group
        that is already asleep stays as it is, so a phase can say what must be asleep in it."""
        if name in self._asleep:
            return 0
        plan = self._plan(name, tensors)
        chunk_ids = self._take_chunks(plan.chunks)
        for run in plan.runs:
            dst = self.chunks[chunk_ids[run.chunk]][run.offset : run.offset + run.nbytes]
            if len(run.members) == 1:
                dst.copy_(plan.views[run.members[0]], non_blocking=True)
                continue
            staging = torch.empty(run.nbytes, dtype=torch.uint8, device=self.device)
            torch.cat([plan.views[i] for i in run.members], out=staging)
            dst.copy_(staging, non_blocking=True)
        for p in plan.pieces:
            dst = self.chunks[chunk_ids[p.chunk]][p.offset : p.offset + p.nbytes]
            dst.copy_(plan.views[p.index][p.start : p.start + p.nbytes], non_blocking=True)
        # Freeing right after the asynchronous copies is safe: the device allocator hands the blocks out
        # again only to work queued behind the copies on the same stream.
        for storage in plan.storages:
            storage.resize_(0)
        synchronize()
        self._asleep[name] = (plan, chunk_ids)
        return sum(plan.sizes)

    @torch.no_grad()
    def wake(self, name: str) -> int:
        """Give the storages of a sleeping group their bytes back; returns the bytes moved (0 if awake)."""
        if name not in self._asleep:
            return 0
        plan, chunk_ids = self._asleep.pop(name)
        for storage, n in zip(plan.storages, plan.sizes):
            storage.resize_(n)
        for run in plan.runs:
            src = self.chunks[chunk_ids[run.chunk]][run.offset : run.offset + run.nbytes]
            if len(run.members) == 1:
                plan.views[run.members[0]].copy_(src, non_blocking=True)
                continue
            staging = torch.empty(run.nbytes, dtype=torch.uint8, device=self.device)
            staging.copy_(src, non_blocking=True)
            torch.split_with_sizes_copy(
                staging, [plan.sizes[i] for i in run.members], out=[plan.views[i] for i in run.members]
            )
        for p in plan.pieces:
            src = self.chunks[chunk_ids[p.chunk]][p.offset : p.offset + p.nbytes]
            plan.views[p.index][p.start : p.start + p.nbytes].copy_(src, non_blocking=True)
        synchronize()  # the host chunks may be reused only once the copies have landed
        self._free += chunk_ids
        return sum(plan.sizes)


@contextlib.contextmanager
def phase(
    name: str,
    stats: dict[str, float],
    sleeper: Sleeper | None = None,
    sleep: Mapping[str, Iterable[torch.Tensor]] | None = None,
    wake: Iterable[str] = (),
    engine=None,
    engine_awake: bool = True,
):
    """Run one phase with the groups in `sleep` asleep and those named in `wake` awake, and a rollout
    engine with weights of its own (`engine`: vLLM's, with `sleep()` / `wake()`; None for the native
    engines, which share the actor's module) awake or asleep as `engine_awake` says.

    Sleeping comes first, so what wakes can reuse the memory it frees. Writes into `stats`:
    `mem/{name}_sleep_gib`, `time/{name}_sleep_s`, `mem/{name}_wake_gib`, `time/{name}_wake_s` and
    `mem/host_gib` (the host chunks) when a sleeper is given, and `time/{name}_engine_sleep_s` or
    `time/{name}_engine_wake_s` when an engine is; always `time/{name}_s` (the phase's work)
    and, on an accelerator, `mem/{name}_peak_gib` (peak allocated from after the sleep to the end) and
    `mem/{name}_reserved_gib` (the allocator's peak reservation over the same span: the peak with the
    fragmentation the phase caused).
    An engine asleep through the phase reports `asleep_bytes`: memory it released to the driver behind
    torch's back (vLLM's sleep unmaps the blocks of its memory pool, which torch's allocator still counts
    as allocated), subtracted from the peak and logged as `mem/{name}_engine_asleep_gib`.
    """
    accel = _accel()
    if sleeper is not None and engine is not None and not engine_awake:
        start = time.perf_counter()
        engine.sleep()
        stats[f"time/{name}_engine_sleep_s"] = time.perf_counter() - start
    if sleeper is not None:
        start = time.perf_counter()
        moved = sum(sleeper.sleep(group, tensors) for group, tensors in (sleep or {}).items())
        stats[f"time/{name}_sleep_s"] = time.perf_counter() - start
        stats[f"mem/{name}_sleep_gib"] = moved / GIB
        if (took := sleeper.take_reserve_s()) is not None:  # the host chunks pinned ahead, in a thread
            stats["time/host_pin_s"] = took
        empty_cache()
    if accel is not None:
        accel.reset_peak_memory_stats()
    if sleeper is not None:
        start = time.perf_counter()
        moved = sum(sleeper.wake(group) for group in wake)
        stats[f"time/{name}_wake_s"] = time.perf_counter() - start
        stats[f"mem/{name}_wake_gib"] = moved / GIB
        stats["mem/host_gib"] = sleeper.host_bytes / GIB
    if sleeper is not None and engine is not None and engine_awake:
        start = time.perf_counter()
        engine.wake()
        stats[f"time/{name}_engine_wake_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize()
        stats[f"time/{name}_s"] = time.perf_counter() - start
        if accel is not None:
            asleep = getattr(engine, "asleep_bytes", 0) if engine is not None and not engine_awake else 0
            stats[f"mem/{name}_peak_gib"] = (accel.max_memory_allocated() - asleep) / GIB
            stats[f"mem/{name}_reserved_gib"] = (accel.max_memory_reserved() - asleep) / GIB
            if engine is not None:
                stats[f"mem/{name}_engine_asleep_gib"] = asleep / GIB
        empty_cache()


class Phases:
    """What each phase of a training step puts to sleep and wakes (`phase`, docs/memory.md), named once:

    - rollout: the gradients are dropped (they are dead after a step: every update starts from
      `zero_grad(set_to_none=True)`), what only training uses sleeps (group "optimizer": the optimizer's
      state; "reference": the reference copy of a full fine-tune with KL), what only the rollout uses wakes
      ("offload": the kind's rollout-only modules, text encoders and VAE, and the reward models), and so
      does a rollout engine with weights of its own (`ops.sleepable`: vLLM's);
    - train: the reverse, the engine asleep;
    - validate and guard (samples outside the step): "offload" and the engine wake, the optimizer's state
      stays as it is (awake: a checkpoint saved after validation reads it).

    With `sleeper` None (memory.sleep false) nothing moves: the phases are timed and their peaks measured.
    Groups named in `awake` (memory.sleep auto, `omnirl.autotune.AutoSleep`) stay on the device.
    `ops` is the kind's ops object (`omnirl.ops.KindOps`), `rewards` the reward pool."""

    def __init__(self, sleeper: Sleeper | None, optimizer: torch.optim.Optimizer, ops, rewards):
        self.sleeper, self.optimizer, self.ops, self.rewards = sleeper, optimizer, ops, rewards
        self.engine = ops.sleepable
        self.train_only: dict[str, list[torch.Tensor]] = {}
        self.awake: set[str] = set()  # groups kept on the device through every phase (memory.sleep auto)
        self.after_train: Callable[[dict[str, float]], None] | None = None
        if sleeper is not None:
            sleeper.reserve(self.host_bytes())

    def group_bytes(self) -> dict[str, int]:
        """The device bytes of each group that sleeps: "offload" through the update, "optimizer" (AdamW's
        two tensors per trained parameter, counted before they exist) and "reference" through the rollout."""
        device = self.sleeper.device if self.sleeper is not None else torch.device("cpu")
        trained = [p for g in self.optimizer.param_groups for p in g["params"]]
        reference = [self.ops.ref_model] if self.ops.ref_model is not None else []
        offload = module_tensors(self.ops.offload_modules() + self.rewards.modules())
        return {
            "offload": _device_bytes(offload, device),
            "optimizer": 2 * _device_bytes(trained, device),
            "reference": _device_bytes(module_tensors(reference), device),
        }

    def host_bytes(self) -> int:
        """The host bytes the sleeps of a step hold at once, counted before the first step: the rollout-only
        modules, asleep through the update, and the optimizer state and a reference copy, asleep through
        the rollout (both for a moment, as a rollout puts the one to sleep before it wakes the other).
        AdamW's state is two tensors the size of each trained parameter (its scalar steps stay on the
        host); a device's local shard counts, as that is what sleeps. Each group rounds up to whole
        chunks, as each group's layout starts a chunk of its own."""
        chunk = self.sleeper.chunk_bytes if self.sleeper is not None else CHUNK_BYTES
        return sum(-(-n // chunk) * chunk for n in self.group_bytes().values())

    @contextlib.contextmanager
    def rollout(self):
        """The rollout phase; yields the step's stats, into which it writes its measurements."""
        stats: dict[str, float] = {}
        freeze_compiled()  # what the last step compiled, out of the collections every phase switch runs
        self.optimizer.zero_grad(set_to_none=True)
        reference = [self.ops.ref_model] if self.ops.ref_model is not None else []
        self.train_only = {
            "optimizer": optimizer_state(self.optimizer),
            "reference": module_tensors(reference),
        }
        sleep = {k: v for k, v in self.train_only.items() if k not in self.awake}
        with phase("rollout", stats, self.sleeper, sleep=sleep, wake=["offload"], engine=self.engine):
            yield stats
        self._release_unused(stats)

    def _release_unused(self, stats: dict[str, float]) -> None:
        """Once every group that has bytes stays on the device (memory.sleep auto) and the last one asleep
        has woken, the pinned host chunks serve no sleep again: hand them back (`mem/host_gib` 0)."""
        if self.sleeper is None or not self.awake:
            return
        if {n for n, b in self.group_bytes().items() if b} <= self.awake and self.sleeper.release():
            stats["mem/host_gib"] = self.sleeper.host_bytes / GIB

    @contextlib.contextmanager
    def train(self, stats: dict[str, float]):
        """The update's phase, after a rollout phase; writes its measurements into `stats`, then calls
        `after_train` with them (memory.sleep auto's decision)."""
        rollout_only = {}
        if "offload" not in self.awake:
            rollout_only["offload"] = module_tensors(self.ops.offload_modules() + self.rewards.modules())
        wake = list(self.train_only)
        with phase("train", stats, self.sleeper, rollout_only, wake, self.engine, engine_awake=False):
            yield
        if self.after_train is not None:
            self.after_train(stats)

    def validate(self, logs: dict[str, float]):
        """Validation's phase; writes its measurements into `logs`."""
        return phase("validate", logs, self.sleeper, wake=["offload"], engine=self.engine)

    def guard(self, logs: dict[str, float]) -> Callable[[], contextlib.AbstractContextManager]:
        """The phase of the health guard's samples, opened when called (`Health.after_step`)."""
        return functools.partial(phase, "guard", logs, self.sleeper, wake=["offload"], engine=self.engine)
