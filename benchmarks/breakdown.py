"""Where a rollout's time goes: the host and device time of each labelled phase, from the torch profiler
(`breakdown`), and the kernels that took it (`kernel_table`).

omnirl's denoising loops label their phases (`omnirl.models.flow_sde.phase`: encode, noise, transformer,
sde_step (with noise nested in it), vae_decode, to_host); `label_stock` puts the same labels on a stock
diffusers pipeline's calls, so both break down into the same rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from omnirl.models.flow_sde import phase

PHASES = ("encode", "noise", "transformer", "sde_step", "vae_decode", "to_host")


def profiled(fn: Callable[[], object], device: torch.device) -> tuple[profile, float]:
    """Run `fn` once under the torch profiler (host, and the device's kernels on CUDA): the profile and
    the wall seconds, the device drained before and after."""
    on_device = device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_device else (lambda: None)
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_device else [])]) as prof:
        start = time.perf_counter()
        fn()
        synchronize()
        wall = time.perf_counter() - start
    return prof, wall


def breakdown(fn: Callable[[], object], device: torch.device) -> dict:
    """Run `fn` once under the profiler: {"wall_s", "device_busy_s" (the kernels' and copies' time summed),
    "phases": {label: {"calls", "host_s" (wall time inside the label on the host), "device_s" (the label's
    span on the device's timeline)}}}. Profiling slows the host side a little: read the shares, and take
    the times from unprofiled runs."""
    prof, wall = profiled(fn, device)
    phases: dict[str, dict] = {}
    busy = 0.0
    for e in prof.events():
        if e.name.startswith("omnirl/"):
            row = phases.setdefault(
                e.name.removeprefix("omnirl/"), {"calls": 0, "host_s": 0.0, "device_s": 0.0}
            )
            if e.device_type == DeviceType.CPU:  # the range on the host
                row["calls"] += 1
                row["host_s"] += e.cpu_time_total / 1e6
            else:  # the same range on the device's timeline: from its first kernel's start to its last's end
                row["device_s"] += e.time_range.elapsed_us() / 1e6
        elif e.device_type != DeviceType.CPU:  # a kernel or copy on the device's timeline
            busy += e.device_time_total / 1e6
    return {"wall_s": wall, "device_busy_s": busy, "phases": phases}


def kernel_table(fn: Callable[[], object], device: torch.device, top: int) -> dict:
    """Run `fn` once under the profiler and rank what ran by its summed time: on CUDA the device's kernels
    and copies (those a CUDA graph replays included), elsewhere the aten operators by their own host time.
    {"wall_s", "what", "busy_s" (all of them summed), "top": [{"name", "calls", "s", "share"}], `top`
    rows, largest first}. Profiling slows the host side a little: read the shares, not the wall time."""
    on_device = device.type == "cuda"
    prof, wall = profiled(fn, device)
    rows: dict[str, list] = {}
    for e in prof.events():
        if on_device and e.device_type != DeviceType.CPU:
            t = e.device_time_total
        elif not on_device and e.name.startswith("aten::"):
            t = e.self_cpu_time_total
        else:
            continue
        row = rows.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += t / 1e6
    busy = sum(t for _, t in rows.values())
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_s": wall, "what": "device kernels" if on_device else "aten operators (own host time)",
        "busy_s": busy,
        "top": [
            {"name": n[:200], "calls": c, "s": t, "share": t / busy if busy else 0.0} for n, (c, t) in ranked
        ],
    }  # fmt: skip


@contextlib.contextmanager
def label_stock(pipe):
    """The stock pipeline's calls under omnirl's labels while the context is open: encode_prompt (encode),
    prepare_latents (noise), the transformer's forward (transformer), the scheduler's step (sde_step: the
    ODE step there), the VAE's decode (vae_decode) and the image or video post-processing (to_host)."""
    from diffusers import WanPipeline

    video = isinstance(pipe, WanPipeline)  # a second expert maybe, and videos post-processed
    targets = [
        (pipe, "encode_prompt", "encode"),
        (pipe, "prepare_latents", "noise"),
        (pipe.transformer, "forward", "transformer"),
        (pipe.scheduler, "step", "sde_step"),
        (pipe.vae, "decode", "vae_decode"),
        (pipe.video_processor, "postprocess_video", "to_host")
        if video
        else (pipe.image_processor, "postprocess", "to_host"),
    ]
    if video and pipe.transformer_2 is not None:
        targets.append((pipe.transformer_2, "forward", "transformer"))

    def labelled(fn, name):
        def call(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)

        return call

    for obj, attr, name in targets:
        setattr(obj, attr, labelled(getattr(obj, attr), name))  # an instance attribute over the method
    try:
        yield
    finally:
        for obj, attr, _ in targets:
            delattr(obj, attr)


def print_breakdown(name: str, result: dict) -> None:
    wall = result["wall_s"]
    print(f"\n{name}: {wall:.2f} s wall (profiled), device busy {result['device_busy_s']:.2f} s")
    print(f"{'phase':12s} {'calls':>6s} {'host s':>8s} {'device s':>9s} {'device % of wall':>17s}")
    for label in PHASES:
        if label in result["phases"]:
            r = result["phases"][label]
            share = 100 * r["device_s"] / wall if wall else 0.0
            print(f"{label:12s} {r['calls']:6d} {r['host_s']:8.3f} {r['device_s']:9.3f} {share:16.1f}%")
