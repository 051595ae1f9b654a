"""The SDE window schedules' plans (which steps of each row train and which take the SDE step), pinned for
fixed seeds, and the sampler's contract with the adapters (no module-level state, the key of every field)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import omnirl.models
from omnirl.distributed import derive_seed
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import WindowedSampler, sliding_window


def sampler(steps: int, size: int, window_range, **params) -> WindowedSampler:
    p = SamplingParams(8, 8, steps, 1.0, 0.7, "sde", size, window_range, **params)
    requests = [Request("p", i, i, derive_seed(7, 3, i), p) for i in range(4)]
    return WindowedSampler(requests, (2,), torch.linspace(1, 0, steps + 1), "cpu", shift=3.0)


# (schedule, sampler arguments, trained steps per row, SDE steps per row): the plans of four requests with
# seeds derive_seed(7, 3, i): a change of how the sampler plans must leave them as they are.
EVERY = [0, 1, 2, 3, 4, 5, 6]
PLANS = [
    ("window", (6, 0, (0, 1)), {}, [[0, 1, 2, 3, 4]] * 4, [[0, 1, 2, 3, 4]] * 4),
    ("window", (8, 2, (1, 6)), {}, [[4, 5], [1, 2], [3, 4], [3, 4]], [[4, 5], [1, 2], [3, 4], [3, 4]]),
    ("dance", (8, 3, (0, 7)), {"sde_window_random": True},
     [[3, 4, 6], [0, 2, 5], [0, 2, 6], [1, 2, 6]], [EVERY] * 4),
    (
        "subset",
        (10, 3, (0, 8)),
        {"sde_window_subset": True},
        [[0, 2, 3], [1, 4, 7], [4, 5, 6], [4, 5, 6]],
        [[0, 2, 3], [1, 4, 7], [4, 5, 6], [4, 5, 6]],
    ),
    ("window", (8, 2, (1, 6)), {"record_logprobs": False}, [[]] * 4, [[]] * 4),
]  # fmt: skip


@pytest.mark.parametrize(("schedule", "args", "params", "trained", "noisy"), PLANS)
def test_each_schedule_draws_the_plans_it_drew_before(schedule, args, params, trained, noisy):
    s = sampler(*args, **params)
    assert (s.trained, s.noisy, s.num_steps) == (trained, noisy, args[0])


def test_sliding_windows_move_shrink_and_wrap_as_before():
    """MixGRPO's schedule: size 2 in [0, 5), moved by 2 every 3 RL steps, shrinking to 1, then back at 0."""
    windows = [sliding_window(k, 2, (0, 5), 3, 2) for k in range(12)]
    assert windows == [(0, 2)] * 3 + [(2, 2)] * 3 + [(4, 1)] * 3 + [(0, 2)] * 3


def test_the_compressed_schedule_follows_the_window_as_before():
    """MixGRPO-Flash: after a window at 2-4 of 12 steps, 3 ODE steps (ratio 0.4) instead of 7."""
    s = sampler(12, 3, (2, 5), ode_compress_ratio=0.4)
    assert s.trained == s.noisy == [[2, 3, 4]] * 4 and s.num_steps == 7
    want = [1.0, 0.916667, 0.833333, 0.75, 0.666667, 0.583333, 0.362069, 0.0]
    assert [round(float(x), 6) for x in s.host_sigmas] == want


def test_the_key_holds_every_field_in_order():
    p = SamplingParams(8, 8, 4, 1.0, 0.7, "sde", 2, (0, 3))
    assert p.key == tuple(getattr(p, f.name) for f in dataclasses.fields(p))
    assert dataclasses.replace(p, decode=False).key != p.key


def test_no_module_level_context_reaches_the_adapters():
    """The per-step precision is the `on_step` argument of an adapter's rollout, not a global."""
    root = Path(omnirl.models.__file__).parent
    users = [
        str(f.relative_to(root)) for f in root.rglob("*.py") if re.search(r"\bContextVar\b", f.read_text())
    ]
    assert users == []
