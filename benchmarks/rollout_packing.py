"""Packed vs serial diffusion rollout (Qwen-Image, SD3.5-Medium, Wan2.2 TI2V-5B and T2V-A14B, LTX-2.3,
FLUX.1-dev) through omnirl's DiffusionEngine, against the stock diffusers pipeline. Flags, cells and how to
run it: benchmarks/README.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
from pathlib import Path

import diffusers
import torch
import transformers
from torch import nn

from benchmarks.breakdown import breakdown, print_breakdown
from benchmarks.measure import (
    add_qwen_bpe,
    make_requests,
    matmul_tflops,
    over_ranks,
    peak_gib,
    place_as_trainer,
    rank_columns,
    real_flops,
    reset_peak,
    text_lengths,
    timed,
    timed_repeats,
    transformer_flops,
)
from benchmarks.packing_cells import (
    Cell,
    batch_shapes,
    forward_cell,
    guarded,
    parse_cell,
    print_forward,
    prompt_buckets,
)
from benchmarks.packing_stock import interleaved, stock
from omnirl import distributed as D
from omnirl.models import build_adapter, write_random_checkpoint
from omnirl.models.base import Request, SamplingParams
from omnirl.models.ltx2.adapter import LTX2Adapter
from omnirl.models.wan.adapter import WanAdapter
from omnirl.recipe import load_config

# --model (write_random_checkpoint's name for the models) -> its recipe
MODELS = {
    "qwen_image": "qwen_image_flowgrpo_ocr",
    "sd3": "sd35_flowgrpo_ocr",
    "wan_ti2v": "wan22_ti2v_dancegrpo",
    "wan_a14b": "wan22_a14b_flowgrpo_lora",
    "ltx2": "ltx23_t2av_flowgrpo_lora",
    "flux": "flux_dancegrpo_hpsv3",
}
VIDEO_MODELS = ("wan_ti2v", "wan_a14b", "ltx2")

WORDS = (
    "a storefront sign a neon sign a chalkboard menu a vintage poster glowing warm light on a rainy street "
    "in the evening with reflections detailed photograph cinematic wide angle shot soft focus background"
).split()


def prompts(n: int, seed: int) -> list[str]:
    """OCR-style prompts of varied length (roughly 8 to 60 words)."""
    rng = random.Random(seed)
    texts = ["OPEN", "Coffee Shop", "Summer Sale 50%", "Welcome Home", "Grand Hotel"]
    return [
        f'{" ".join(rng.choices(WORDS, k=rng.randint(4, 56)))} that reads "{rng.choice(texts)}"'
        for _ in range(n)
    ]


def logprob_gap(adapter, trajs, clip_range: float, micro_batch: int = 8) -> dict:
    """For the unchanged policy: the trainer's recomputed log-prob of every trained step (in micro-batches,
    as the recipe trains) against the rollout's, per timestep; and the clip fraction that gap alone would
    give the first update (ratio outside 1 +- clip_range)."""
    from omnirl.ops.diffusion import Pair, pair_logprob

    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    diffs, steps = [], []
    with torch.no_grad():
        for i in range(0, len(pairs), micro_batch):
            mb = pairs[i : i + micro_batch]
            lp = pair_logprob(adapter, mb, trajs[0].request.params).logprob
            diffs += (lp.cpu() - torch.stack([p.traj.logprobs[p.k] for p in mb])).tolist()
            steps += [int(p.traj.step_indices[p.k]) for p in mb]
    d = torch.tensor(diffs).abs()
    st = torch.tensor(steps)
    per_step = {
        int(k): {
            "mean_abs": d[st == k].mean().item(),
            "max_abs": d[st == k].max().item(),
            "n": int((st == k).sum()),
        }
        for k in st.unique()
    }
    ratio = torch.tensor(diffs).exp()
    return {
        "mean_abs": d.mean().item(), "max_abs": d.max().item(), "per_step": per_step,
        "clip_frac_first_update": ((ratio - 1).abs() > clip_range).float().mean().item(),
    }  # fmt: skip


def precision_gap(adapter, trajs, reference, clip_range: float, micro_batch: int) -> dict:
    """An FP8 cell's rollouts against the trainer: the trainer's recomputed log-prob of every trained step
    against the FP8 rollout's, per timestep (the gap the rollout correction weights), the seconds that
    recompute takes (what algo.old_logprob recompute adds to an RL step: the trainer's eager forward of
    every trained step, `micro_batch` samples at a time, as the recipe trains), and the pixel difference of
    the final images (or videos) from those of the policy's own precision (`reference`: the same cell in
    bf16, the same requests and seeds; None when it did not run)."""
    recompute_s, gap = timed(lambda: logprob_gap(adapter, trajs, clip_range, micro_batch))
    out = {"recompute_s": recompute_s, "logprob_gap": gap}
    if reference:
        diff = torch.stack([
            (pixels(a) - pixels(b)).abs().mean() for a, b in zip(trajs, reference, strict=True)
        ])  # fmt: skip
        mse = torch.stack([((pixels(a) - pixels(b)) ** 2).mean() for a, b in zip(trajs, reference)]).mean()
        out["pixels"] = {
            "mean_abs": diff.mean().item(), "max_sample_mean_abs": diff.max().item(),
            "max_abs": max((pixels(a) - pixels(b)).abs().max().item() for a, b in zip(trajs, reference)),
            "psnr_db": (10 * torch.log10(1 / mse)).item(),
        }  # fmt: skip
    return out


def pixels(traj) -> torch.Tensor:
    """A trajectory's output in [0, 1], float32: its image [3, H, W] or its video [F, 3, H, W]."""
    o = traj.output
    return (o.image if o.image is not None else o.video).float()


# ---------------------------------------------------------------------------------------------- main


def parse_size(text: str) -> tuple[int, int]:
    """--size: "HxW", or one number for a square."""
    try:
        h, w = text.lower().split("x") if "x" in text.lower() else (text, text)
        return int(h), int(w)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size {text!r}: give HxW (e.g. 704x1280) or one number") from None


def cell_groups(a: argparse.Namespace) -> tuple[list[Cell], list[Cell]]:
    """The packed cells the arguments name: (eager ones, compiled ones), in the order they run."""
    eager = [Cell(n) for n in a.max_num_seqs] + [Cell(n, fused_cfg=False) for n in a.unfused_max_num_seqs]
    eager += [Cell(n, buckets="single") for n in a.single_bucket]
    eager += [Cell(n, fused_cfg=False, buckets="negative") for n in a.negative_bucket]
    compiled = [Cell(n, compile=True) for n in a.compiled_max_num_seqs]
    eager += [c for c in a.cells if not c.compile]
    compiled += [c for c in a.cells if c.compile]
    return eager, compiled


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen_image")
    p.add_argument("--path", help="a local checkpoint (else --random-init)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument(
        "--finetune",
        choices=["lora", "full"],
        help="model.finetune (default: the recipe's); lora keeps the base in bf16 where a full fine-tune's "
        "float32 weights would not leave room for the stock pipeline's batches (FLUX.1-dev on 80 GB)",
    )
    p.add_argument("--dry-run", action="store_true", help="build every model on meta, count, exit")
    add_qwen_bpe(p)  # with --random-init
    p.add_argument("--images", type=int, default=128, help="images per GPU (the reference: 128)")
    p.add_argument("--serial-requests", type=int, default=16, help="0 skips the serial run")
    p.add_argument(
        "--serial-compiled",
        action="store_true",
        help="also the serial run with compiled blocks (the same --serial-requests, compile time apart)",
    )
    p.add_argument("--max-num-seqs", type=int, nargs="*", default=[8, 16, 32, 64], help="fused cells")
    p.add_argument("--unfused-max-num-seqs", type=int, nargs="*", default=[], help="CFG as two forwards")
    p.add_argument("--single-bucket", type=int, nargs="*", default=[], help="fused, one prompt bucket")
    p.add_argument("--negative-bucket", type=int, nargs="*", default=[], help="unfused, negative unpadded")
    p.add_argument("--compiled-max-num-seqs", type=int, nargs="*", default=[16, 32])
    p.add_argument(
        "--cells",
        nargs="*",
        default=[],
        type=parse_cell,
        help="more packed cells, each MAX_NUM_SEQS[:fused|split][:recipe|single|negative][:eager|compiled]"
        "[:bf16|fp8[:untrained][:exact]], "
        "e.g. 32:split:single:compiled (defaults: fused, recipe buckets, eager)",
    )
    p.add_argument(
        "--stock-compiled",
        action="store_true",
        help="also the stock pipeline compiled (else only with compiled cells)",
    )
    p.add_argument("--stock-batch", type=int, nargs="*", default=[16, 32])
    p.add_argument(
        "--stock-images",
        type=int,
        default=0,
        help="prompts the stock pipeline is timed on, its time scaled to --images (0: all --images, the "
        "same prompts as the packed cells)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="after each cell's timed runs, profile one batch of it: host and device time per phase "
        "(benchmarks/breakdown.py), for ours and the stock pipeline alike",
    )
    p.add_argument(
        "--no-stock-eager", action="store_true", help="the stock pipeline only compiled (with compiled cells)"
    )
    p.add_argument("--forward-only", action="store_true", help="time the transformer forward alone")
    p.add_argument(
        "--forward-iters", type=int, default=3, help="timed forwards per batch (after one warm-up)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed generations per cell (after the warm-up); a row reports their median and lists each",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="the packed cells against the stock pipeline at one --stock-batch in the same mode (eager "
        "cells first, then compiled ones), their timed generations taken in turn (each cell, stock, each "
        "cell, ...) so that drift on a shared machine hits all alike, e.g. --cells 1 8 16 for serial, 8 "
        "and 16 against the stock pipeline; the rows are written after every repeat. Compiled cells "
        "compile every shape in an untimed 2-step generation first",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--size",
        type=parse_size,
        help="HxW (or one number for a square); default the recipe's (512 for the image recipes)",
    )
    p.add_argument(
        "--frames", type=int, help="video models: frames (family.num_frames; default the recipe's)"
    )
    p.add_argument("--out", default="rollout_packing.json")
    p.add_argument(
        "--logprob-check",
        type=int,
        default=32,
        help="after this max_num_seqs run, compare the "
        "trainer's recomputed log-probs (micro-batches of 8) with the rollout's",
    )
    a = p.parse_args()
    if not (a.path or a.random_init):
        p.error("give --path or --random-init")
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.interleave:
        if not (sum(map(len, cell_groups(a))) >= 1 and len(a.stock_batch) == 1):
            p.error(
                "--interleave times packed cells against the stock pipeline at one --stock-batch in their "
                "mode: give one --stock-batch and at least one cell"
            )
        for cells in cell_groups(a):
            layouts = {c.buckets for c in cells}
            if len(layouts) > 1:
                p.error(
                    "--interleave: the cells of one mode share one prompt-bucket layout (the buckets are set "
                    f"for the whole timed loop), got {sorted(layouts)}"
                )
        if a.serial_requests or a.forward_only:
            p.error(
                "--interleave times packed cells against the stock pipeline (max_num_seqs 1 is the serial "
                "rollout): give --serial-requests 0 and no --forward-only"
            )
    if a.qwen_bpe and not (a.random_init and a.model == "qwen_image"):
        p.error("--qwen-bpe is for --random-init --model qwen_image (a real checkpoint has its tokenizer)")
    if a.model != "qwen_image" and (
        a.single_bucket or a.negative_bucket or any(c.buckets != "recipe" for c in a.cells)
    ):
        p.error(f"--single-bucket / --negative-bucket: {a.model} pads every prompt to one fixed length")
    if a.model in VIDEO_MODELS and a.forward_only:
        p.error("--forward-only times the image models' forwards (its inputs are image latents)")
    if a.frames is not None and a.model not in VIDEO_MODELS:
        p.error(f"--frames is for the video models, not {a.model}")
    if a.forward_only and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--forward-only runs in a single process (not under torchrun with several ranks)")
    return a


def build(a, device: torch.device):
    """The recipe's config and adapter; with --random-init the full-size models from their public configs."""
    recipe = MODELS[a.model]
    path = a.path
    if a.random_init:
        path = tempfile.mkdtemp() + "/ckpt"
        write_random_checkpoint(a.model, Path(path), a.qwen_bpe)
    random = ["--model.weights", "random"] if a.random_init or device.type == "meta" else []
    size = ["--sampling.height", str(a.size[0]), "--sampling.width", str(a.size[1])] if a.size else []
    frames = ["--family.num_frames", str(a.frames)] if a.frames else []
    finetune = ["--model.finetune", a.finetune] if a.finetune else []
    cfg = load_config(recipe, ["--model.path", path, *random, *size, *frames, *finetune])
    return cfg, build_adapter(cfg, device)


def dry_run(a) -> None:
    """Every model built on the meta device: parameter counts and the transformer's counted FLOPs."""
    cfg, adapter = build(a, torch.device("meta"))
    print(f"{a.model}: models built on the meta device from {'public configs' if a.random_init else a.path}")
    modules = {n: m for n, m in vars(adapter).items() if isinstance(m, nn.Module)}
    if isinstance(adapter, WanAdapter) and len(adapter.experts) > 1:  # each expert on its own line
        modules = {**adapter.experts, **{n: m for n, m in modules.items() if n != "_policy"}}
    for name, module in modules.items():
        if isinstance(module, nn.Module):
            lora = sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)
            base = sum(p.numel() for p in module.parameters()) - lora
            print(f"  {name:16s} {type(module).__name__:38s} {base:15,d} params ({base / 1e9:.3f} B)" + (
                f" (+ LoRA rank {cfg.lora.rank}: {lora / 1e6:.1f} M)" if lora else ""
            ))  # fmt: skip
    s = cfg.sampling
    params = SamplingParams(s.height, s.width, a.steps, s.guidance_scale, 0.0, "ode", 0, (0, 1))
    if isinstance(adapter, LTX2Adapter):
        g = adapter.grid(s.height, s.width)
        print(f"  video {s.height}x{s.width}, {cfg.family.num_frames} frames: "
              f"{g.frames}x{g.height}x{g.width} video and {g.audio_frames} audio tokens per row")  # fmt: skip
    if isinstance(adapter, WanAdapter):
        _, f, h, w = adapter.latent_shape(s.height, s.width)
        print(f"  video {s.height}x{s.width}, {cfg.family.num_frames} frames: {f}x{h}x{w} latents, "
              f"{adapter.num_tokens(make_requests(['x'], params, '')[0]):,d} tokens per row")  # fmt: skip
    flops_at = transformer_flops(adapter, params)
    requests = make_requests(prompts(a.images, 0), params, s.negative_prompt)
    lengths = [text_lengths(adapter, r) for r in requests]
    per_image = real_flops(adapter, requests, flops_at) / len(requests) * a.steps
    cond = sum(c for c, _ in lengths) / len(lengths)
    print(
        f"  transformer at {s.height}x{s.width}: {flops_at(round(cond)) / 1e12:.2f} TFLOP per row-forward at "
        f"the mean prompt length ({cond:.0f} text tokens), {flops_at(lengths[0][1]) / 1e12:.2f} at the "
        f"negative prompt's ({lengths[0][1]}); {per_image / 1e12:.1f} TFLOP per image "
        f"({a.steps} steps, CFG {s.guidance_scale}, unpadded rows)"
    )
    for n, tflops in (("~45%", 780 * 0.45), ("~60%", 780 * 0.60)):  # an H200's dense bf16 peak x MFU
        print(
            f"  at {n} MFU of an H200 (780 TFLOP/s bf16): {per_image / tflops / 1e12:.1f} s of transformer "
            f"per {'video' if isinstance(adapter, (WanAdapter, LTX2Adapter)) else 'image'}"
        )


def main() -> None:
    a = parse_args()
    # The pipelines warn on every prompt truncated to CLIP's 77 / T5's max_sequence_length tokens: that
    # would flood the log.
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    if a.dry_run:
        dry_run(a)
        return
    # Under torchrun: the process group first, which puts this rank on its own GPU (LOCAL_RANK).
    dist = D.init_distributed() if "RANK" in os.environ else None
    device = dist.device if dist else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict = {
        "args": {k: [c.spec for c in v] if k == "cells" else v for k, v in vars(a).items()},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    results["matmul_tflops"] = matmul_tflops(device)
    ceiling = results["matmul_tflops"] * 1e12
    D.print0(f"bf16 matmul ceiling: {results['matmul_tflops']:.0f} TFLOP/s")

    t_load, (cfg, adapter) = timed(lambda: build(a, device))
    D.print0(f"models built in {t_load:.0f} s, {peak_gib():.1f} GiB")
    dist = place_as_trainer(adapter.policy, adapter.fsdp_units(), cfg, dist)
    results["world_size"] = dist.world_size
    s = cfg.sampling
    # The recipe's SDE window, cut to --steps: a window lies inside the schedule (flow_sde.window).
    lo, hi = s.sde_window_range[0], min(s.sde_window_range[1], a.steps)
    size = min(s.sde_window_size, hi - lo)
    params = SamplingParams(
        s.height, s.width, a.steps, s.guidance_scale, s.noise_level, s.sde_type, size, (lo, hi),
        # a subset recipe's subsets, else a window at a random start (one rollout's cost, not a schedule's)
        sde_window_schedule="subset" if s.sde_window_schedule == "subset" else "contiguous",
    )  # fmt: skip
    # This rank's share of one prompt list (all of it in a single process); seeds from the global index.
    mine = slice(dist.rank * a.images, (dist.rank + 1) * a.images)
    texts_all = prompts(a.images * dist.world_size, 0)
    texts = texts_all[mine]
    requests = make_requests(texts_all, params, s.negative_prompt)[mine]
    flops_at = transformer_flops(adapter, params)
    flops_total = real_flops(adapter, requests, flops_at) * a.steps
    # The mean over ranks, so that flops_total / seconds / ceiling below is all ranks' FLOPs over all GPUs'
    # ceiling (the MFU of the whole step).
    flops_total = sum(over_ranks(flops_total)) / dist.world_size
    results["transformer_tflop_per_rollout"] = flops_total / 1e12
    rows = []

    def save():
        results["rows"] = rows
        if dist.is_main:
            Path(a.out).write_text(json.dumps(results, indent=1))

    eager, compiled = cell_groups(a)
    if a.forward_only:
        for forced_sdpa in (False, True):
            for cell in eager + compiled:
                forward_cell(adapter, cell, requests, flops_at, ceiling, a, rows, forced_sdpa)
                save()
        print_forward(rows)
        print(f"wrote {a.out}")
        return

    if a.interleave:
        for cells in (eager, compiled):  # the eager cells first: the compiled ones compile the blocks
            if cells:
                neg = s.negative_prompt
                interleaved(adapter, cells, requests, texts, neg, params, a, rows, flops_total, ceiling, save)
                save()
        if dist.is_main:
            print_generation(rows)
            print(f"wrote {a.out}")
        return

    def run_engine(cell: Cell, reqs: list[Request], scale: float, name: str = ""):
        name = name or cell.name
        reqs = cell.requests(reqs)
        engine = cell.engine(adapter)
        with prompt_buckets(adapter, cell.buckets, reqs):
            compile_s = 0.0
            if cell.compile:
                compile_s, _ = timed(lambda: engine.generate(reqs))  # compiles every bucket shape
            engine.check_memory(reqs)  # the probes of the memory check, at the timed batches' sizes
            if not cell.compile:  # compiled: the compile pass warmed up every shape (2 rows would be new)
                engine.generate(reqs[: min(len(reqs), 2)])  # warm-up (allocator, kernels)
            reset_peak()
            # Ranks start each run together (a barrier): a step's generation ends with its slowest rank.
            secs, runs, trajs = timed_repeats(lambda: engine.generate(reqs), a.repeats, D.barrier)
            shapes = batch_shapes(adapter, engine, reqs)
            batch = reqs[: cell.max_num_seqs]
            split = breakdown(lambda: engine.generate(batch), adapter.device) if a.breakdown else None
        gens, peaks = over_ranks(secs * scale), over_ranks(peak_gib())
        gen = max(gens)
        row = {
            "name": name, "generation_s": gen, "images_per_s": a.images / gen, "scaled_from": len(reqs),
            "mfu": flops_total / gen / ceiling, "peak_gib": max(peaks),
            "compile_s": max(over_ranks(max(compile_s - secs, 0.0))), "batches": shapes,
            "generation_s_runs": [r * scale for r in runs],  # this rank's (rank 0's in the JSON)
            **rank_columns({"generation_s": gens, "peak_gib": peaks}),
        }  # fmt: skip
        if split is not None:
            row["breakdown"] = {"requests": len(batch), **split}
        rows.append(row)
        D.print0(json.dumps(row))
        save()
        return trajs

    if a.serial_requests:
        name = "serial (max_num_seqs 1, CFG 2 forwards, eager)"
        serial = Cell(1, fused_cfg=False)
        guarded(
            rows,
            name,
            lambda: run_engine(serial, requests[: a.serial_requests], a.images / a.serial_requests, name),
        )
    # FP8 cells and their bf16 twins keep their rollouts for the precision comparison.
    fp8 = [c for c in eager + compiled if c.precision == "fp8"]
    twins = {dataclasses.replace(c, precision="bf16", fp8_steps="all", fast_accum=True) for c in fp8}
    kept: dict[Cell, list] = {}

    def run_cell(cell: Cell) -> None:
        trajs = guarded(rows, cell.name, lambda: run_engine(cell, requests, 1.0))
        if trajs and cell == Cell(a.logprob_check):  # rank 0's rollouts (every rank runs it: FSDP)
            results["logprob_check"] = logprob_gap(adapter, trajs, cfg.algo.clip_range)
            D.print0(json.dumps(results["logprob_check"]))
        if trajs and cell.precision == "fp8":
            ref = kept.get(dataclasses.replace(cell, precision="bf16", fp8_steps="all", fast_accum=True))
            gap = precision_gap(adapter, trajs, ref, cfg.algo.clip_range, cfg.optim.micro_batch_size)
            results.setdefault("precision", {})[cell.spec] = gap
            D.print0(json.dumps({"precision": cell.spec, **gap}))
        elif trajs and cell in twins:
            kept[cell] = trajs
        save()

    for cell in eager:
        run_cell(cell)
    if not a.no_stock_eager:
        stock(adapter, texts, s.negative_prompt, params, a, rows, flops_total / ceiling, save, compiled=False)
    for cell in compiled:
        run_cell(cell)
    if a.serial_requests and a.serial_compiled:
        name = "serial (max_num_seqs 1, CFG 2 forwards, compiled)"
        serial = Cell(1, fused_cfg=False, compile=True)
        scale = a.images / a.serial_requests
        guarded(rows, name, lambda: run_engine(serial, requests[: a.serial_requests], scale, name))
    if compiled or a.stock_compiled:
        stock(adapter, texts, s.negative_prompt, params, a, rows, flops_total / ceiling, save, compiled=True)
    save()
    if dist.is_main:
        print_generation(rows)
        for r in rows:
            if "breakdown" in r:
                print_breakdown(f"{r['name']}, one batch of {r['breakdown']['requests']}", r["breakdown"])
        print(f"wrote {a.out}")


def print_generation(rows: list[dict]) -> None:
    serial = rows[0]["generation_s"] if rows and rows[0]["name"].startswith("serial") else float("nan")
    w = max([len(r["name"]) for r in rows] + [13])
    print(
        f"\n{'configuration':{w}s} {'gen s':>8s} {'img/s':>7s} {'x serial':>8s} {'MFU':>6s} {'peak GiB':>8s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['name']:{w}s} {r['error'][:100]}")
            continue
        print(
            f"{r['name']:{w}s} {r['generation_s']:8.1f} {r['images_per_s']:7.2f} "
            f"{serial / r['generation_s']:8.2f} {100 * r['mfu']:5.1f}% {r['peak_gib']:8.1f}"
        )


if __name__ == "__main__":
    under_torchrun = "RANK" in os.environ
    main()
    if under_torchrun:  # as scripts/train.py ends: no rank tears down while another is in a collective,
        D.barrier()  # and no interpreter finalization (gloo's threads can abort it)
        D.destroy()
        D.exit_now(0)
