"""`uniform_noise`: a uniform draw in [0, 1) per sample, spread without signal.

For runs that measure time, memory and actor-vs-rollout consistency on random-init models
(scripts/gpu/): such a model earns no real reward, so every group would have zero spread and be dropped,
leaving no update to measure. A small weight of this reward (e.g. 1e-3) gives every group spread, while
the recipe's own rewards are still computed (their cost is part of the step) and logged. It carries no
signal: a run with it learns nothing.
"""

from __future__ import annotations

import os
import random
from typing import Any

from omnirl.models.base import Output


class UniformNoise:
    """One uniform draw per sample from a generator seeded by the rank (`RANK`, 0 without torchrun), so
    ranks draw different numbers and a rerun draws the same ones."""

    modality = None  # it reads no output: it is called with the Output records, of any model

    def __init__(self):
        self.rng = random.Random(int(os.environ.get("RANK", "0")))

    def __call__(
        self, samples: list[Output], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        return [self.rng.random() for _ in samples]
