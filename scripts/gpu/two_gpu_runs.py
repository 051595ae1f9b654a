"""Helpers of scripts/gpu/two_gpu_runs.sh: the random-init thinker checkpoint, and the tables and JSON of
what its two runs measured (benchmarks/README.md).

    python -m scripts.gpu.two_gpu_runs checkpoint --out DIR [--tiny | --full] [--device cpu] [--config-only]
    python -m scripts.gpu.two_gpu_runs mmk12 RUN_DIR/metrics.jsonl --json OUT.json
    python -m scripts.gpu.two_gpu_runs packing rollout_packing.json --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# The shape of the omni throughput benchmark's thinker
# (omnirl.models.qwen3_omni_thinker.public_config.write_random_thinker):
# lm_head x4 so that the actor-rollout probability Pearson has peaked distributions to compare.
THINKER = dict(
    vocab=151936, hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128, moe_intermediate=768,
    experts=32, experts_per_tok=8, dtype="bfloat16", head_scale=4.0,
)  # fmt: skip
# The text model of Qwen3-Omni-30B-A3B's thinker at full size (48 layers, 128 experts: docs/mmk12.md,
# "Memory plan"), for the 80 GB-capped runs of distributed.frozen_base offload; its vision and audio towers
# stay write_random_thinker's tiny ones (the MMK12 images then cost ~1.2 B parameters less than the
# real ones).
FULL_THINKER = dict(THINKER, vocab=152064, layers=48, experts=128)
# A CPU-sized one of the same code path, for a rehearsal. head_dim stays 128: write_random_thinker's
# M-RoPE sections (24, 20, 20) cover 64 = 128 / 2 pairs.
TINY_THINKER = dict(
    THINKER, vocab=512, hidden=128, layers=2, heads=2, kv_heads=1, moe_intermediate=64, experts=4,
    experts_per_tok=2, dtype="float32",
)  # fmt: skip


def checkpoint(a) -> None:
    import torch

    from omnirl.distributed import device_type
    from omnirl.models.qwen3_omni_thinker.public_config import write_random_thinker

    shape = TINY_THINKER if a.tiny else FULL_THINKER if a.full else THINKER
    device = torch.device(a.device or device_type())
    path = write_random_thinker(Path(a.out), device, **shape, weights=not a.config_only)
    if a.config_only:
        print(f"{path}: random-init thinker {shape}, config only (run it with train_entry --random-init)")
    else:
        print(f"{path}: random-init thinker {shape} built on {device}")


def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if digits >= 0 else f"{value:.2e}"


SLEEP_WAKE = ("time/rollout_sleep_s", "time/rollout_wake_s", "time/train_sleep_s", "time/train_wake_s")


def per_rank(row: dict, key: str) -> list[float]:
    """KEY/rank0, KEY/rank1, ... of a metrics row (omnirl.step.per_rank), in rank order."""
    values, r = [], 0
    while f"{key}/rank{r}" in row:
        values.append(row[f"{key}/rank{r}"])
        r += 1
    return values


def mmk12(a) -> None:
    """Per step: time split, peak memory per GPU, actor-vs-rollout consistency."""
    from omnirl.metrics import read_metrics

    out = []
    for m in read_metrics(a.metrics):
        step_s, rollout_s, train_s = m.get("time/step_s"), m.get("time/rollout_s"), m.get("time/train_s")
        sleep_wake = [m[k] for k in SLEEP_WAKE if k in m]
        row = {
            "step": m["step"],
            "step_s": step_s,
            # The rollout phase is the generation (each response scored as it finishes) and the wait for
            # the scores still running when it ends; the update is the train phase (old log-prob
            # recompute, forward/backward, optimizer steps); sleep/wake moves the optimizer state between
            # phases; the rest is requests, advantages, the metric gathers and logging.
            "generation_s": m.get("time/generate_s"),
            "generation_s_per_rank": per_rank(m, "time/generate_s"),
            "scoring_wait_s": m.get("time/score_wait_s"),
            "update_s": train_s,
            "sleep_wake_s": sum(sleep_wake) if sleep_wake else None,
            "other_s": (
                step_s - rollout_s - train_s - sum(sleep_wake)
                if None not in (step_s, rollout_s, train_s)
                else None
            ),
            "rollout_peak_gib_per_rank": per_rank(m, "mem/rollout_peak_gib"),
            "train_peak_gib_per_rank": per_rank(m, "mem/train_peak_gib"),
            "prob_pearson": m.get("consistency/prob_pearson"),
            "logprob_abs_diff_mean": m.get("consistency/logprob_abs_diff_mean"),
            "logprob_abs_diff_max": m.get("consistency/logprob_abs_diff_max"),
            "tokens": m.get("consistency/tokens"),
            "kept_frac": m.get("adv/kept_frac"),
            "optimizer_steps": m.get("train/updates"),
            "reward_mmk12": m.get("reward/mmk12"),
        }
        out.append(row)
    heads = (
        "| step | step s | generation s (per rank) | scoring wait s | update s | sleep/wake s | other s "
        "| rollout peak GiB per GPU | train peak GiB per GPU | prob Pearson | mean abs dlogp | max abs dlogp "
        "| tokens | kept | mmk12 reward |"
    )
    lines = [heads, "|" + "---|" * (heads.count("|") - 1)]
    for r in out:
        lines.append(
            f"| {r['step']} | {fmt(r['step_s'])} | {fmt(r['generation_s'])} "
            f"({ranks(r['generation_s_per_rank'])}) | {fmt(r['scoring_wait_s'], 2)} | {fmt(r['update_s'])} "
            f"| {fmt(r['sleep_wake_s'], 2)} | {fmt(r['other_s'])} | {ranks(r['rollout_peak_gib_per_rank'])} "
            f"| {ranks(r['train_peak_gib_per_rank'])} | {fmt(r['prob_pearson'], 5)} "
            f"| {fmt(r['logprob_abs_diff_mean'], -1)} | {fmt(r['logprob_abs_diff_max'], -1)} "
            f"| {fmt(r['tokens'], 0)} | {fmt(r['kept_frac'], 2)} | {fmt(r['reward_mmk12'], 3)} |"
        )
    print("\n".join(lines))
    print("Step 0 includes the first call's warm-up (allocator, kernels, CUDA graph capture).")
    Path(a.json).write_text(json.dumps({"metrics": str(a.metrics), "steps": out}, indent=1) + "\n")
    print(f"wrote {a.json}")


def ranks(values: list[float]) -> str:
    return " / ".join(fmt(v) for v in values) or "-"


REFERENCE_IMAGES_PER_GPU = 128  # VeRL-Omni: 32 prompts x 16 images over 4 GPUs, 226 s serial -> 108 s packed


def packing(a) -> None:
    """Generation time per step (the slowest rank) of each cell, and scaled to the reference's 128 images
    per GPU (linear in images: the packed cells run whole batches of max_num_seqs)."""
    results = json.loads(Path(a.results).read_text())
    images = results["args"]["images"]
    scale = REFERENCE_IMAGES_PER_GPU / images
    serial = next((r for r in results["rows"] if r["name"].startswith("serial") and "error" not in r), None)
    out = []
    for r in results["rows"]:
        if "error" in r:
            out.append({"name": r["name"], "error": r["error"]})
            continue
        out.append(
            {
                "name": r["name"],
                "generation_s": r["generation_s"],
                "generation_s_per_rank": r.get("rank_generation_s", [r["generation_s"]]),
                "images_per_gpu": images,
                "scaled_from": r["scaled_from"],
                "x_serial": serial["generation_s"] / r["generation_s"] if serial else None,
                "generation_s_at_128_per_gpu": r["generation_s"] * scale,
                "peak_gib_per_rank": r.get("rank_peak_gib", [r["peak_gib"]]),
                "mfu": r["mfu"],
            }
        )
    world = results.get("world_size", 1)
    args = results["args"]
    print(
        f"{world} GPUs ({results['device']}), {images} images per GPU, {args['size']} px, {args['steps']} "
        f"steps; bf16 matmul ceiling {results['matmul_tflops']:.0f} TFLOP/s"
    )
    heads = (
        f"| configuration | generation s per step (per rank) | x serial | s at {REFERENCE_IMAGES_PER_GPU} "
        "images/GPU (scaled) | MFU | peak GiB per GPU |"
    )
    lines = [heads, "|---|---|---|---|---|---|"]
    for r in out:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:120]} | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {fmt(r['generation_s'])} ({ranks(r['generation_s_per_rank'])}) "
            f"| {fmt(r['x_serial'], 2)} | {fmt(r['generation_s_at_128_per_gpu'])} | {fmt(100 * r['mfu'])}% "
            f"| {ranks(r['peak_gib_per_rank'])} |"
        )
    print("\n".join(lines))
    print(
        f"reference: VeRL-Omni, 4 GPUs, {REFERENCE_IMAGES_PER_GPU} images/GPU: 226 s serial -> 108 s packed"
    )
    summary = {"results": str(a.results), "world_size": world, "device": results["device"], "cells": out}
    Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {a.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("checkpoint", help="write DIR/random_thinker")
    c.add_argument("--out", required=True)
    c.add_argument("--tiny", action="store_true", help="CPU-sized (a rehearsal of the same code path)")
    c.add_argument("--full", action="store_true", help="the full-size text model (48 layers, 128 experts)")
    c.add_argument("--device", help="build on this device (default: the accelerator, else cpu)")
    c.add_argument(
        "--config-only",
        action="store_true",
        help="no weights: the run builds them (scripts.gpu.train_entry --random-init); nothing large on disk",
    )
    m = sub.add_parser("mmk12", help="table + JSON of a training run's metrics.jsonl")
    m.add_argument("metrics")
    m.add_argument("--json", required=True)
    k = sub.add_parser("packing", help="table + JSON of a benchmarks.rollout_packing result")
    k.add_argument("results")
    k.add_argument("--json", required=True)
    a = p.parse_args()
    {"checkpoint": checkpoint, "mmk12": mmk12, "packing": packing}[a.command](a)


if __name__ == "__main__":
    main()
