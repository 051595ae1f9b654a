"""The packed configurations ("cells") of benchmarks.rollout_packing, and its `--forward-only` timing of the
transformer forward of every batch a cell's packer makes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import traceback

import torch

from benchmarks.measure import batch_lengths, peak_gib, real_flops, reset_peak, time_calls
from omnirl import fsdp
from omnirl.config import FP8Config, RolloutConfig
from omnirl.memory import empty_cache
from omnirl.models.base import Request
from omnirl.models.qwen_image.adapter import bucket, collate
from omnirl.models.sd3.adapter import SD3Adapter
from omnirl.rollout.diffusion import DiffusionEngine

# ---------------------------------------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True)
class Cell:
    """One packed configuration: what `rollout.*` a recipe would set."""

    max_num_seqs: int
    fused_cfg: bool = True
    compile: bool = False
    buckets: str = "recipe"  # "recipe" | "single" (the largest only) | "negative" (+ the negative's length)
    precision: str = "bf16"  # rollout.precision: "bf16" | "fp8"
    fp8_steps: str = "all"  # rollout.fp8.steps with fp8: "all" | "untrained"
    fast_accum: bool = True  # rollout.fp8.fast_accum with fp8; "exact" turns it off

    @property
    def spec(self) -> str:
        """The --cells spelling of this cell."""
        cfg, compiled = "fused" if self.fused_cfg else "split", "compiled" if self.compile else "eager"
        steps = ":untrained" if self.fp8_steps == "untrained" else ""
        steps += "" if self.fast_accum else ":exact"
        return f"{self.max_num_seqs}:{cfg}:{self.buckets}:{compiled}:{self.precision}{steps}"

    @property
    def name(self) -> str:
        parts = [
            f"packed max_num_seqs {self.max_num_seqs}",
            "CFG fused" if self.fused_cfg else "CFG 2 forwards",
        ]
        parts += {"recipe": [], "single": ["one bucket"], "negative": ["negative-length bucket"]}[
            self.buckets
        ]
        parts += ["fp8"] if self.precision == "fp8" else []
        parts += ["untrained steps only"] if self.fp8_steps == "untrained" else []
        parts += [] if self.fast_accum else ["float32 accumulation"]
        return ", ".join(parts + ["compiled" if self.compile else "eager"])

    def engine(self, adapter) -> DiffusionEngine:
        """The rollout engine a recipe with this cell's `rollout.*` builds (every timed path builds its
        engines here, so no path drops a setting)."""
        fp8 = FP8Config(steps=self.fp8_steps, fast_accum=self.fast_accum)
        rollout = RolloutConfig(
            max_num_seqs=self.max_num_seqs, compile=self.compile, precision=self.precision, fp8=fp8
        )
        return DiffusionEngine(adapter, rollout)

    def requests(self, requests: list[Request]) -> list[Request]:
        """`requests` with the cell's CFG layout in their sampling parameters (`SamplingParams.fused_cfg`)."""
        return [
            dataclasses.replace(r, params=dataclasses.replace(r.params, fused_cfg=self.fused_cfg))
            for r in requests
        ]


def parse_cell(spec: str) -> Cell:
    """A --cells entry: MAX_NUM_SEQS then options separated by ':' (see --help)."""
    n, *options = spec.split(":")
    kwargs: dict = {}
    for option in options:
        if option in ("fused", "split"):
            kwargs["fused_cfg"] = option == "fused"
        elif option in ("recipe", "single", "negative"):
            kwargs["buckets"] = option
        elif option in ("eager", "compiled"):
            kwargs["compile"] = option == "compiled"
        elif option in ("bf16", "fp8"):
            kwargs["precision"] = option
        elif option == "untrained":  # fp8 on the steps no row trains (rollout.fp8.steps untrained)
            kwargs["fp8_steps"] = option
        elif option == "exact":  # fp8 GEMMs promoting their sums to float32 (rollout.fp8.fast_accum false)
            kwargs["fast_accum"] = False
        else:
            raise argparse.ArgumentTypeError(f"cell {spec!r}: unknown option {option!r}")
    if ("fp8_steps" in kwargs or "fast_accum" in kwargs) and kwargs.get("precision") != "fp8":
        raise argparse.ArgumentTypeError(f"cell {spec!r}: 'untrained' and 'exact' are options of fp8 cells")
    try:
        return Cell(int(n), **kwargs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {spec!r}: max_num_seqs {n!r} is not an integer") from None


def batch_shapes(adapter, engine: DiffusionEngine, requests: list[Request]) -> list[list[int]]:
    """[requests, conditional text length, negative text length] of each batch the engine's packer makes."""
    return [
        [len(idx), *batch_lengths(adapter, [requests[i] for i in idx])]
        for idx in engine.packer.pack(requests, engine.pad)
    ]


@contextlib.contextmanager
def prompt_buckets(adapter, kind: str, requests: list[Request]):
    """The cell's `family.prompt_length_buckets`, set on the adapter for the cell's duration (the same
    as building it with that recipe value: the adapter reads `buckets` on every call). "single": the
    smallest recipe bucket that holds every prompt of `requests`, as a recipe for one prompt set would
    set it; "negative": the negative prompt's own length added."""
    if kind == "recipe":
        yield
        return
    saved = adapter.buckets
    if kind == "single":
        longest = max(adapter.prompt_length(r.prompt) for r in requests)
        adapter.buckets = [bucket(saved, longest)]
    else:
        adapter.buckets = sorted({adapter.prompt_length(requests[0].negative_prompt), *saved})
    try:
        yield
    finally:
        adapter.buckets = saved


@contextlib.contextmanager
def compiled_blocks(engine: DiffusionEngine):
    """The engine's compiled block forwards swapped in, as `DiffusionEngine.generate` does."""
    for block, fn in engine.compiled:
        block.forward = fn
    try:
        yield
    finally:
        for block, _ in engine.compiled:
            del block.forward


def guarded(rows: list[dict], name: str, fn) -> object:
    """Run one cell; an error (out of memory, no kernel, a failed compile) is printed and recorded as the
    cell's row, and the next cell runs: a benchmark run on a rented GPU should not lose the other cells."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (recorded and printed, not swallowed)
        traceback.print_exc(limit=-4)  # the innermost frames: where it failed
        row = {"name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        empty_cache()
        return None


def forward_inputs(adapter, batch: list[Request]) -> dict:
    """The inputs of one denoising step of a packed batch, as `adapter.rollout` builds them: latents,
    sigmas, and the text rows (Qwen-Image: unpadded rows, collated per variant; SD3: the embeddings)."""
    p = batch[0].params
    sd3 = isinstance(adapter, SD3Adapter)
    channels = adapter.policy.config.in_channels // (1 if sd3 else 4)
    h, w = p.height // adapter.vae_scale_factor, p.width // adapter.vae_scale_factor
    guided = p.guidance_scale > 1
    out = {
        "latents": torch.randn(len(batch), channels, h, w, device=adapter.device),  # [B, C, h, w]
        "sigma": torch.full((len(batch),), 0.5, device=adapter.device),  # [B]
        "lengths": batch_lengths(adapter, batch),  # the padded text lengths, as the rollout pads
    }
    negatives = [r.negative_prompt for r in batch] if guided else None
    if sd3:
        out["embeds"] = adapter.encode([r.prompt for r in batch], negatives)
    else:
        out["rows"] = adapter.encode([r.prompt for r in batch] + (negatives or []))  # [L_i, D] each
    return out


def variant_embeds(adapter, inputs: dict, variant: str) -> tuple[dict, tuple[int, int]]:
    """A variant's embeddings and (conditional, negative) padded text lengths: 'engine' as the rollout
    collates them (each text padded to its bucket, masked), 'no mask' the same with every mask true,
    'batch longest' each text padded only to its batch's longest (the stock pipeline's shapes)."""
    if "embeds" in inputs:  # SD3: fixed lengths, no masks
        return inputs["embeds"], inputs["lengths"]
    rows, batch = inputs["rows"], len(inputs["latents"])
    cond, neg = rows[:batch], rows[batch:]
    lengths = inputs["lengths"]
    if variant == "batch longest":
        lengths = (max(len(r) for r in cond), max((len(r) for r in neg), default=0))
    embeds = {}
    embeds["prompt_embeds"], embeds["prompt_embeds_mask"] = collate(cond, lengths[0])
    if neg:
        embeds["negative_prompt_embeds"], embeds["negative_prompt_embeds_mask"] = collate(neg, lengths[1])
    if variant == "no mask":
        embeds = {k: torch.ones_like(v) if k.endswith("_mask") else v for k, v in embeds.items()}
    return embeds, lengths


def forward_variants(adapter, cell: Cell, forced_sdpa: bool) -> list[str]:
    """The cell's timing variants; `forced_sdpa` the ones with a forced SDPA kernel only (they run after
    all others: a kernel that fails on the device must not take the other cells' numbers with it)."""
    if forced_sdpa:
        return ["SDPA cuDNN", "SDPA mem-efficient"] if cell.fused_cfg and not cell.compile else []
    qwen = not isinstance(adapter, SD3Adapter)
    if not cell.fused_cfg:
        return ["engine"] + (["batch longest"] if qwen else [])
    return ["engine"] + (["no mask"] if qwen and not cell.compile else [])


def forward_cell(
    adapter, cell: Cell, requests: list[Request], flops_at, ceiling: float, a, rows, forced_sdpa: bool
) -> None:
    """Time the transformer forward of one denoising step of every batch of the cell, per variant."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = forward_variants(adapter, cell, forced_sdpa)
    if not variants:
        return
    requests = cell.requests(requests)  # the adapter's keys (the negative rows' padded length) follow it
    p = requests[0].params
    guided = p.guidance_scale > 1
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=cell.max_num_seqs, compile=cell.compile))
    with prompt_buckets(adapter, cell.buckets, requests):
        batches = []
        for idx in engine.packer.pack(requests, fill=engine.pad):
            real = [requests[i] for i in idx]
            batches.append((real, forward_inputs(adapter, real + engine.padding(real))))
    kernels = {"SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "SDPA mem-efficient": SDPBackend.EFFICIENT_ATTENTION}

    def batch_row(variant: str, real: list[Request], inputs: dict) -> dict:
        embeds, (cond, neg) = variant_embeds(adapter, inputs, variant)
        n = len(inputs["latents"])  # with compile: padded to its bucket size with dummy requests

        def step():
            return adapter.velocity(
                inputs["latents"], inputs["sigma"], embeds, p.guidance_scale, cell.fused_cfg
            )

        first, secs = time_calls(step, a.forward_iters)
        if not guided:
            shape, padded = f"{n} rows, text {cond}", n * flops_at(cond)
        elif cell.fused_cfg:  # both texts padded to the longer
            shape, padded = f"{2 * n} rows, text {cond}+{neg}", 2 * n * flops_at(max(cond, neg))
        else:
            shape, padded = f"{n}+{n} rows, text {cond}+{neg}", n * (flops_at(cond) + flops_at(neg))
        useful = real_flops(adapter, real, flops_at)
        return {
            "requests": len(real), "shape": shape, "ms": 1e3 * secs,
            "useful_tflop": useful / 1e12, "padded_tflop": padded / 1e12,
            "mfu": useful / secs / ceiling, "mfu_padded": padded / secs / ceiling,
            "compile_s": max(first - secs, 0.0) if cell.compile else 0.0,
        }  # fmt: skip

    for variant in variants:
        name = f"forward: {cell.name}" + ("" if variant == "engine" else f", {variant}")

        def run(variant=variant, name=name):
            reset_peak()
            kernel = sdpa_kernel(kernels[variant]) if variant in kernels else contextlib.nullcontext()
            with kernel, compiled_blocks(engine), fsdp.gathered_weights(adapter.policy), torch.no_grad():
                detail = [batch_row(variant, real, inputs) for real, inputs in batches]
            secs = sum(d["ms"] for d in detail) / 1e3
            useful, padded = (sum(d[k] for d in detail) * 1e12 for k in ("useful_tflop", "padded_tflop"))
            row = {
                "name": name, "ms_per_step": 1e3 * secs, "transformer_s_per_rollout": secs * p.num_steps,
                "mfu": useful / secs / ceiling, "mfu_padded": padded / secs / ceiling, "peak_gib": peak_gib(),
                "compile_s": sum(d["compile_s"] for d in detail), "batches": detail,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)

        guarded(rows, name, run)


def print_forward(rows: list[dict]) -> None:
    w = max([len(r["name"]) for r in rows] + [41])
    head = "transformer forward of one denoising step"
    print(f"\n{head:{w}s} {'ms':>8s} {'s/rollout':>9s} {'MFU':>6s} {'padded':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:{w}s} {r['error'][:100]}")
            continue
        print(
            f"{r['name']:{w}s} {r['ms_per_step']:8.1f} {r['transformer_s_per_rollout']:9.2f} "
            f"{100 * r['mfu']:5.1f}% {100 * r['mfu_padded']:5.1f}%"
        )
        for b in r["batches"]:
            print(
                f"    {b['requests']:4d} requests: {b['shape']:28s} {b['ms']:8.1f} ms "
                f"MFU {100 * b['mfu']:5.1f}% (padded {100 * b['mfu_padded']:5.1f}%)"
            )
