"""Where an update's time goes, without stalling it: device events recorded at the boundaries of its parts
(forward, KL reference forward, backward, optimizer) and read once, after the update's last kernel. On the
CPU the host clock is the device's. Logged as `time/train_<part>_s` (docs/memory.md lists the phases).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class PhaseClock:
    """`mark(part)` ends the running part and starts `part`; `totals()` syncs once and sums each part."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (part, a CUDA event or a host time)

    def _now(self):
        if self.events:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def mark(self, part: str) -> None:
        self.marks.append((part, self._now()))

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
            out[f"time/train_{part}_s"] = out.get(f"time/train_{part}_s", 0.0) + s
        return out
