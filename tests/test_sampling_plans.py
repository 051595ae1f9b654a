"""The SDE window schedules' plans (which steps of each row train and which take the SDE step), pinned for
fixed seeds and held to the sampler's code before the schedules became one planner each
(`reference_plan`), and the sampler's contract with the adapters (no module-level state, the key of every
field)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

import omnirl.models
from omnirl.config import SamplingConfig
from omnirl.distributed import derive_seed
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import PLANNERS, WindowedSampler, compressed_schedule, sliding_window, window


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
    ("dance", (8, 3, (0, 7)), {"sde_window_schedule": "dance"},
     [[3, 4, 6], [0, 2, 5], [0, 2, 6], [1, 2, 6]], [EVERY] * 4),
    (
        "subset",
        (10, 3, (0, 8)),
        {"sde_window_schedule": "subset"},
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
    s = sampler(12, 3, (2, 5), sde_window_schedule="sliding_compressed", ode_compress_ratio=0.4)
    assert s.trained == s.noisy == [[2, 3, 4]] * 4 and s.num_steps == 7
    want = [1.0, 0.916667, 0.833333, 0.75, 0.666667, 0.583333, 0.362069, 0.0]
    assert [round(float(x), 6) for x in s.host_sigmas] == want


def reference_plan(p: SamplingParams, old: dict, seeds: list[int], shape, sigmas: torch.Tensor, shift: float):
    """The sampler's planning before one planner per schedule, in its old flags (`old`: sde_window_random,
    sde_window_subset, ode_compress_ratio): (trained, noisy, sigmas, each SDE step's noise [R, *shape])."""
    gens = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    for g in gens:
        torch.randn(shape, generator=g)  # the initial latents come first
    k, lo, last = (
        window(p.num_steps, p.sde_window_size, p.sde_window_range) if p.record_logprobs else (0, 0, 0)
    )
    if (old["sde_window_random"] or old["sde_window_subset"]) and k:
        trained = [sorted(lo + int(j) for j in torch.randperm(last + k - lo, generator=g)[:k]) for g in gens]
    else:
        starts = [0] * len(seeds)
        if p.sde_window_size and k:
            starts = [int(torch.randint(lo, last + 1, (1,), generator=g)) for g in gens]
        trained = [list(range(start, start + k)) for start in starts]
    noisy = [list(range(p.num_steps - 1)) if old["sde_window_random"] and t else t for t in trained]
    if old["ode_compress_ratio"] and k:
        sigmas = compressed_schedule(sigmas, trained[0][-1], old["ode_compress_ratio"], shift)
    noise = []
    for i in range(len(sigmas) - 1):
        rows = [b for b, t in enumerate(noisy) if i in t]
        noise.append(torch.stack([torch.randn(shape, generator=gens[b]) for b in rows]) if rows else None)
    return trained, noisy, sigmas, noise


# Each schedule and its old flags; a sliding window is a range of its size (`DiffusionOps.step_params`).
OLD_FLAGS = {
    "contiguous": {},
    "dance": {"sde_window_random": True},
    "subset": {"sde_window_subset": True},
    "sliding": {},
    "sliding_compressed": {"ode_compress_ratio": 0.4},
}
WINDOWS = [(6, 0, (0, 1)), (8, 2, (1, 6)), (8, 3, (0, 7)), (10, 3, (0, 8)), (12, 1, (4, 5)), (25, 4, (0, 4))]


@pytest.mark.parametrize("schedule", list(OLD_FLAGS))
def test_each_planner_draws_what_the_sampler_drew_before(schedule):
    """Every planner, for windows of every size and with and without records, gives the trained steps, SDE
    steps and sigmas of the code before it and leaves each generator where that code did: the step noise
    drawn after the plan is the same, so every sample and log-prob is too."""
    old = {"sde_window_random": False, "sde_window_subset": False, "ode_compress_ratio": 0.0}
    old.update(OLD_FLAGS[schedule])
    for steps, size, span in WINDOWS:
        if schedule.startswith("sliding") and span[1] - span[0] != size:
            continue  # one window for the whole batch
        for record, base in [(True, 0), (True, 7), (True, 123), (False, 7)]:
            p = SamplingParams(
                8, 8, steps, 1.0, 0.7, "sde", size, span, record_logprobs=record,
                sde_window_schedule=schedule, ode_compress_ratio=old["ode_compress_ratio"],
            )  # fmt: skip
            seeds = [derive_seed(base, 3, i) for i in range(4)]
            sigmas = torch.linspace(1, 0, steps + 1)
            requests = [Request("p", i, i, seed, p) for i, seed in enumerate(seeds)]
            s = WindowedSampler(requests, (2,), sigmas, "cpu", shift=3.0)
            trained, noisy, want_sigmas, noise = reference_plan(p, old, seeds, (2,), sigmas, 3.0)
            assert (s.trained, s.noisy) == (trained, noisy), (steps, size, span, record, base)
            assert torch.equal(s.host_sigmas, want_sigmas)
            drawn = [None if job is None else job.result() for job in s.noise]
            assert len(drawn) == len(noise)
            assert all(a is b or torch.equal(a, b) for a, b in zip(drawn, noise))


def test_the_table_holds_one_planner_per_schedule():
    hints = typing.get_type_hints(SamplingConfig)
    assert list(PLANNERS) == list(typing.get_args(hints["sde_window_schedule"]))
    assert (
        SamplingParams(8, 8, 4, 1.0, 0.7, "sde", 2, (0, 3)).sde_window_schedule
        == SamplingConfig.sde_window_schedule
    )


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
