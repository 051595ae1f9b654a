"""Where an update's time goes, without stalling it: device events recorded at the boundaries of its parts
(forward, KL reference forward, backward, optimizer) and read once, after the update's last kernel. On the
CPU the host clock is the device's. Logged as `time/train_<part>_s` (docs/memory.md lists the phases).
A rollout's clock times the parts its code marks with `part` while `recording` it (the VAE decode:
`time/vae_decode_s`; the memory probes of a rollout's first batches, `alone`: `time/memory_probe_s`).
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Any

import torch


class PhaseClock:
    """`mark(part)` ends the running part and starts `part`; `totals()` syncs once and sums each part."""

    def __init__(self, device: torch.device, prefix: str = "time/train_"):
        self.device, self.prefix = device, prefix
        self.events = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (part, a CUDA event or a host time)
        self.muted = False  # inside `alone`: the marks of the code it times are ignored

    def _now(self):
        if self.events:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self, part: str) -> None:
        if not self.muted:
            self.marks.append((part, self._now()))

    @contextlib.contextmanager
    def alone(self, name: str):
        """Time the block as `name`, whole: what it runs marks no part of its own."""
        self.mark(name)
        self.muted = True
        try:
            yield
        finally:
            self.muted = False
            self.mark("idle")

    def totals(self) -> dict[str, float]:
        """Seconds per part (the span from a part's mark to the next mark), then forgets the marks."""
        marks, self.marks = self.marks, []
        if len(marks) < 2:
            return {}
        if self.events:
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for (part, a), (_, b) in zip(marks, marks[1:]):
            if part == "idle":
                continue
            s = a.elapsed_time(b) / 1e3 if self.events else b - a
            key = f"{self.prefix}{part}_s"
            out[key] = out.get(key, 0.0) + s
        return out


# The clock a rollout is recorded on (`recording`), for the parts deep inside the adapters' code (`part`).
_RECORDING: ContextVar[PhaseClock | None] = ContextVar("omnirl_phase_clock", default=None)


@contextlib.contextmanager
def recording(clock: PhaseClock):
    """Let `part` mark `clock` until the block ends."""
    token = _RECORDING.set(clock)
    try:
        yield clock
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def part(name: str):
    """Time the block as `name` on the clock being recorded, if any (nothing otherwise)."""
    clock = _RECORDING.get()
    if clock is None:
        yield
        return
    clock.mark(name)
    try:
        yield
    finally:
        clock.mark("idle")


@contextlib.contextmanager
def alone(name: str):
    """Time the block as `name` on the clock being recorded, if any, with the parts inside it unmarked (a
    memory probe's rollout holds a VAE decode that is not the step's)."""
    clock = _RECORDING.get()
    with clock.alone(name) if clock is not None else contextlib.nullcontext():
        yield
