"""The allowed values of a config field: (predicate, what is allowed) pairs, as `config_checks.RANGES` and a
family's `Settings.RANGES` name them. Beside the config on the ground floor, so that a family's settings
declare their ranges without importing the checks that read them."""

from __future__ import annotations

import math


def at_least(n: int) -> tuple:
    return (lambda v: v >= n), f"an integer >= {n}"


POSITIVE = (lambda v: math.isfinite(v) and v > 0), "a finite number > 0"
NON_NEGATIVE = (lambda v: math.isfinite(v) and v >= 0), "a finite number >= 0"
FRACTION = (lambda v: math.isfinite(v) and 0 < v <= 1), "a number in (0, 1]"
