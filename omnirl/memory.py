"""Phases of a step and the device memory they use.

`phase("rollout")` / `phase("train")` bracket the two halves of an RL step. Each phase frees the
allocator's cached blocks when it ends and reports the time taken and the peak device memory
allocated during the phase. (Moving what a phase does not need to host memory, sleep/wake, hooks
in here too.) Only this module and `distributed.py` touch `torch.cuda` / `torch.npu`.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch


def _accel():
    """The accelerator's torch module (torch.cuda or torch.npu), or None on CPU."""
    if torch.cuda.is_available():
        return torch.cuda
    npu = getattr(torch, "npu", None)  # present only after `import torch_npu`
    if npu is not None and npu.is_available():
        return npu
    return None


def empty_cache() -> None:
    gc.collect()
    accel = _accel()
    if accel is not None:
        accel.empty_cache()


def synchronize() -> None:
    accel = _accel()
    if accel is not None:
        accel.synchronize()


@contextlib.contextmanager
def phase(name: str, stats: dict[str, float]):
    """Run one phase; on exit write `mem/{name}_peak_gib` and `time/{name}_s` into `stats`."""
    accel = _accel()
    if accel is not None:
        accel.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize()
        stats[f"time/{name}_s"] = time.perf_counter() - start
        if accel is not None:
            stats[f"mem/{name}_peak_gib"] = accel.max_memory_allocated() / 2**30
        empty_cache()
