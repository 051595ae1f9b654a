"""Rollout time of DanceGRPO's and MixGRPO-Flash's sampling against the modes they replace, through omnirl's
DiffusionEngine on full-size models (`--random-init`: the public configs, omnirl/models/random_init.py).

- `wan_ti2v` (the `wan22_ti2v_dancegrpo` recipe's rollout: 704x1280, 9 frames, 10 steps, True-CFG 5.0):
  `window`, the recipe's mode before (VeRL-Omni's: dance_sde at noise 1.2 in a window of 2 in [0, 5), the
  ODE elsewhere), against `dancegrpo`, the recipe's (DanceGRPO's: the SDE on every step but the last, a
  random 5 of steps 0-8 trained).
- `sd3` (the `sd35_mixgrpo_flash_ocr` recipe's rollout: 512 px, 25 steps, CFG 4.5, DPM-Solver++ 2M after
  the window): for windows of 4 at the given starts, `full`, the ODE on the whole schedule (before), against
  `compressed`, MixGRPO-Flash's compressed schedule (`sampling.sde_window_schedule sliding_compressed`,
  `ode_compress_ratio` 0.4); and over a whole period of the recipe's windows, the mean number of denoising
  forwards of each.

Each cell: the engine's memory probes for its batch first (untimed), then `--repeats` timed generations of
the same requests (median reported). Prints a table and writes JSON (`--out`).

    python -m benchmarks.algo_rollouts --model wan_ti2v sd3 --random-init --out algo_rollouts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
from pathlib import Path

import diffusers
import torch
import transformers

from benchmarks.measure import make_requests, peak_gib, reset_peak, timed_repeats
from omnirl.config import RolloutConfig
from omnirl.models import build_adapter, write_random_checkpoint
from omnirl.models.flow_sde import compressed_schedule, sliding_window
from omnirl.ops.diffusion import sampling_params
from omnirl.recipe import load_config
from omnirl.rollout.diffusion import DiffusionEngine

# --model (write_random_checkpoint's name for the models) -> its recipe
MODELS = {
    "wan_ti2v": "wan22_ti2v_dancegrpo",
    "sd3": "sd35_mixgrpo_flash_ocr",
}
PROMPTS = [
    'a neon sign that reads "OPEN" on a rainy street at night',
    "a lighthouse on a cliff at sunset, waves below",
    'a chalkboard menu that reads "Coffee 3$" in a cafe',
    "two dogs running through fresh snow in a forest",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--path", help="a local checkpoint (one --model; else --random-init)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--videos", type=int, default=4, help="wan_ti2v: videos per cell (one batch)")
    p.add_argument("--images", type=int, default=16, help="sd3: images per cell (one batch)")
    p.add_argument("--starts", type=int, nargs="+", default=[0, 10], help="sd3: window starts timed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="algo_rollouts.json")
    p.add_argument("--set", default="", help='recipe overrides, e.g. "--sampling.height 32" (a CPU check)')
    return p.parse_args()


def build(model: str, a: argparse.Namespace, device: torch.device):
    path, random = a.path, []
    if a.random_init:
        path = tempfile.mkdtemp() + "/ckpt"
        write_random_checkpoint(model, Path(path))
        random = ["--model.weights", "random"]
    cfg = load_config(MODELS[model], ["--model.path", path, *random, *a.set.split()])
    return cfg, build_adapter(cfg, device)


def cell(engine: DiffusionEngine, params, n: int, repeats: int) -> dict:
    """The engine's probes, then `repeats` timed generations of n requests of `params` in one batch."""
    requests = make_requests([PROMPTS[i % len(PROMPTS)] for i in range(n)], params, "")
    engine.check_memory(requests)
    reset_peak()
    median, runs, trajs = timed_repeats(lambda: engine.generate(requests), repeats)
    return {
        "seconds": median,
        "runs": runs,
        "per_sample_s": median / n,
        "denoising_steps": len(trajs[0].sigmas) - 1,
        "trained_steps": trajs[0].step_indices.tolist(),
        "peak_gib": peak_gib(),
    }


def wan_cells(cfg, adapter, a) -> list[dict]:
    dance = sampling_params(cfg)
    window = dataclasses.replace(
        dance, noise_level=1.2, sde_window_size=2, sde_window_range=(0, 5), sde_window_schedule="contiguous"
    )
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=a.videos))
    engine.generate(make_requests(PROMPTS[:1], window, ""))  # kernels warmed, untimed
    rows = []
    for name, params in (("window", window), ("dancegrpo", dance)):
        rows.append({"model": "wan_ti2v", "mode": name, **cell(engine, params, a.videos, a.repeats)})
    return rows


def sd35_cells(cfg, adapter, a) -> list[dict]:
    s = cfg.sampling
    flash = sampling_params(cfg)
    full = dataclasses.replace(flash, sde_window_schedule="sliding", ode_compress_ratio=0.0)
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=a.images))
    engine.generate(make_requests(PROMPTS[:1], full, ""))  # kernels warmed, untimed
    rows = []
    for start in a.starts:
        for name, base in (("full", full), ("compressed", flash)):
            params = dataclasses.replace(base, sde_window_range=(start, start + s.sde_window_size))
            rows.append(
                {
                    "model": "sd3",
                    "mode": name,
                    "window_start": start,
                    **cell(engine, params, a.images, a.repeats),
                }
            )
    return rows


def period_forwards(cfg, adapter) -> dict:
    """Over one period of the recipe's sliding windows: the mean denoising steps (forwards) a rollout
    takes on the full and on the compressed schedule (counted, not timed)."""
    s = cfg.sampling
    sigmas = adapter.sigmas(s.num_steps)
    span, size = tuple(s.sde_window_range), s.sde_window_size
    positions = (span[1] - span[0] + s.sde_window_stride - 1) // s.sde_window_stride
    windows = [sliding_window(p, size, span, 1, s.sde_window_stride) for p in range(positions)]
    shift = adapter.scheduler.config.shift
    steps = [
        len(compressed_schedule(sigmas, st + w - 1, s.ode_compress_ratio, shift)) - 1 for st, w in windows
    ]
    return {"windows": len(windows), "full": s.num_steps, "compressed_mean": sum(steps) / len(steps)}


def main() -> None:
    a = parse_args()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"args": vars(a), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    out["torch"], out["diffusers"] = torch.__version__, diffusers.__version__
    rows: list[dict] = []
    for model in a.model:
        cfg, adapter = build(model, a, device)
        with torch.no_grad():
            if model == "wan_ti2v":
                rows += wan_cells(cfg, adapter, a)
            else:
                rows += sd35_cells(cfg, adapter, a)
                out["sd35_period"] = period_forwards(cfg, adapter)
        out["rows"] = rows
        Path(a.out).write_text(json.dumps(out, indent=2))  # what is measured so far survives a later failure
        del adapter
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    print(
        f"{'model':11s} {'mode':11s} {'window':>6s} {'steps':>5s} {'s (median)':>10s} {'s/sample':>8s}  runs"
    )
    for r in rows:
        start = r.get("window_start", "")
        runs = ", ".join(f"{x:.2f}" for x in r["runs"])
        print(
            f"{r['model']:11s} {r['mode']:11s} {start!s:>6s} {r['denoising_steps']:5d} {r['seconds']:10.2f} "
            f"{r['per_sample_s']:8.3f}  {runs}"
        )
    if "sd35_period" in out:
        p = out["sd35_period"]
        print(f"sd3 over a period of {p['windows']} windows: {p['full']} forwards full, "
              f"{p['compressed_mean']:.2f} compressed (mean)")  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
