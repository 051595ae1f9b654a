"""FLUX.2-klein's full-size public configs: none yet, so `model.weights random` has no FLUX.2-klein
checkpoint to write (`RANDOM` names the config-only checkpoints a family writes)."""

from __future__ import annotations

from collections.abc import Callable

RANDOM: dict[str, Callable] = {}
