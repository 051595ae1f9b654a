"""The stock diffusers pipeline in benchmarks.rollout_packing: diffusers' own pipeline class around the
adapter's modules, its timed cells (`stock`), and --interleave: packed cells and the stock pipeline
timed in turn (`interleaved`)."""

from __future__ import annotations

import functools
import json

import torch

from benchmarks.breakdown import breakdown, label_stock
from benchmarks.measure import over_ranks, peak_gib, rank_columns, reset_peak, timed, timed_repeats
from benchmarks.packing_cells import Cell, batch_shapes, guarded, prompt_buckets
from omnirl import distributed as D
from omnirl import fsdp
from omnirl.models.base import SamplingParams
from omnirl.models.flux.adapter import FluxAdapter
from omnirl.models.ltx2.adapter import LTX2Adapter
from omnirl.models.sd3.adapter import SD3Adapter
from omnirl.models.wan.adapter import WanAdapter


def stock_pipe(adapter, params: SamplingParams):
    """diffusers' own pipeline class around the adapter's modules (the text encoders and tokenizers, the
    policy with its LoRA, the VAE, the scheduler), and the guidance keywords of its `__call__`."""
    modules = {"transformer": adapter.policy, "vae": adapter.vae, "scheduler": adapter.scheduler}
    if isinstance(adapter, LTX2Adapter):
        modules.update(audio_vae=adapter.audio_vae, vocoder=adapter.vocoder, connectors=adapter.connectors)
    if isinstance(adapter, WanAdapter):  # the experts themselves (the policy of two is their ModuleDict)
        modules.update(adapter.experts, boundary_ratio=adapter.boundary_ratio)
        modules["expand_timesteps"] = adapter.expand_timesteps
    pipe = type(adapter.text_pipe)(**{**adapter.text_pipe.components, **modules})
    pipe.set_progress_bar_config(disable=True)
    if isinstance(adapter, WanAdapter):
        # output_type "np": the decoded video as an array, what a video reward reads (ours hands it a
        # tensor); "pil" would add a PIL image per frame the engine never makes.
        cfg_kwargs = dict(
            guidance_scale=params.guidance_scale, num_frames=adapter.settings.num_frames,
            max_sequence_length=adapter.max_sequence_length, output_type="np",
        )  # fmt: skip
        if adapter.boundary_ratio is not None:
            cfg_kwargs["guidance_scale_2"] = adapter.guidance_2(params.guidance_scale)
    elif isinstance(adapter, LTX2Adapter):
        # The adapter's guidance (x0 space, its audio scale and rescales), no STG or modality guidance (the
        # adapter runs neither); "np": the video as an array (the audio comes as a tensor).
        s = adapter.settings
        cfg_kwargs = dict(
            guidance_scale=params.guidance_scale,
            audio_guidance_scale=adapter.audio_scale(params.guidance_scale),
            guidance_rescale=s.guidance_rescale, audio_guidance_rescale=s.audio_guidance_rescale,
            stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
            num_frames=s.num_frames,
            frame_rate=s.frame_rate, max_sequence_length=adapter.max_sequence_length, output_type="np",
        )  # fmt: skip
    elif isinstance(adapter, FluxAdapter):
        # The embedded guidance; true CFG only above 1 (the pipeline runs it when given negative prompts).
        # The pipeline shifts its schedule by calculate_shift, not by a recipe's fixed family.shift: the
        # same steps and shapes, so the same time.
        cfg_kwargs = dict(
            guidance_scale=adapter.guidance, true_cfg_scale=params.guidance_scale,
            max_sequence_length=adapter.max_sequence_length,
        )  # fmt: skip
    elif isinstance(adapter, SD3Adapter):
        cfg_kwargs = dict(
            guidance_scale=params.guidance_scale, max_sequence_length=adapter.max_sequence_length
        )
    else:
        cfg_kwargs = dict(true_cfg_scale=params.guidance_scale)
    cfg_kwargs.setdefault("output_type", "pil")
    return pipe, cfg_kwargs


def stock_generate(pipe, cfg_kwargs, prompts_: list[str], negative, params, per_call: int, steps: int):
    """The stock pipeline over `prompts_`, `per_call` prompts (and as many negatives) per `__call__`."""
    for i in range(0, len(prompts_), per_call):
        batch = prompts_[i : i + per_call]
        pipe(
            prompt=batch, negative_prompt=[negative] * len(batch), height=params.height, width=params.width,
            num_inference_steps=steps, **cfg_kwargs,
        )  # fmt: skip


def interleaved(
    adapter, cells: list[Cell], requests, texts, negative, params, a, rows, flops_total, ceiling, save
):
    """--interleave: the packed `cells` (all of one mode and prompt-bucket layout) and the stock pipeline
    (`--stock-batch` prompts per call, the cells' mode) on the same prompts, their timed generations taken
    in turn (each cell, then the stock pipeline, then again), so drift on a shared machine hits all alike:
    e.g. max_num_seqs 1 (serial), 8 and 16 against the stock pipeline in one process. Compiled: each compiles
    every shape it will meet in one untimed 2-step generation of all the prompts (the transformer's inputs
    have the same shapes at every step, so 2 steps compile what 10 run), the engines with their own compiled
    blocks (dynamic=False, swapped in per `generate`), the stock pipeline with every block compiled in place
    (as `compile_repeated_blocks`); then a 2-request, 2-step warm-up each. Each row is rewritten after every
    repeat, so a run cut short keeps the repeats it finished."""
    import dataclasses
    import statistics

    b = a.stock_batch[0]
    engines = [c.engine(adapter) for c in cells]
    pipe, cfg_kwargs = stock_pipe(adapter, params)
    compiled = cells[0].compile
    mode = "compiled" if compiled else "eager"

    # The stock pipeline's compiled blocks, as `nn.Module.compile` makes them (`compile_repeated_blocks`),
    # set on the blocks only while it runs: the engine swaps its own compiled `forward` in per `generate`.
    units = list(adapter.fsdp_units())
    stock_impls = [torch.compile(u._call_impl, fullgraph=True) for u in units] if compiled else []

    def stock_call(prompts_: list[str], steps: int = params.num_steps) -> None:
        for u, impl in zip(units, stock_impls):
            u._compiled_call_impl = impl
        try:
            with fsdp.gathered_weights(adapter.policy):  # once per generation, as the engine's `generate`
                stock_generate(pipe, cfg_kwargs, prompts_, negative, params, b, steps)
        finally:
            for u in units:
                u._compiled_call_impl = None

    short = dataclasses.replace(params, num_steps=2, sde_window_size=1, sde_window_range=(0, 1))
    short_requests = [dataclasses.replace(r, params=short) for r in requests]
    ours = [{"name": c.name, "scaled_from": len(requests), "generation_s_runs": []} for c in cells]
    theirs = {"name": f"stock {type(pipe).__name__} {b} prompts/call, {mode}", "scaled_from": len(texts)}
    theirs["generation_s_runs"] = []
    mine = [*ours, theirs]
    with prompt_buckets(adapter, cells[0].buckets, requests):
        if compiled:
            for row, engine, cell in zip(ours, engines, cells):
                row["compile_s"] = timed(functools.partial(engine.generate, cell.requests(short_requests)))[0]
            theirs["compile_s"] = timed(lambda: stock_call(texts, 2))[0]
        for engine, cell in zip(engines, cells):
            engine.check_memory(cell.requests(requests))  # the memory check's probes, at the timed sizes
        # Warm-up (allocator, kernels, the decode) in 2 steps: the same shapes as the timed calls, and at
        # A14B's ~25 s a video a full-length warm-up would cost as much as a timed run. Compiled, the
        # compile pass above warmed up every timed shape; 2 rows would be a shape of their own.
        if not compiled:
            for engine, cell in zip(engines, cells):
                engine.generate(cell.requests(short_requests[:2]))
            stock_call(texts[:2], 2)
        reset_peak()
        for row, engine, cell in zip(ours, engines, cells):
            row["batches"] = batch_shapes(adapter, engine, cell.requests(requests))
        frames = torch._dynamo.utils.counters["frames"]  # frames dynamo compiled: none may be timed
        calls = [
            (row, functools.partial(engine.generate, cell.requests(requests)))
            for row, engine, cell in zip(ours, engines, cells)
        ]
        for _ in range(a.repeats):
            for row, fn in [*calls, (theirs, lambda: stock_call(texts))]:
                D.barrier()
                before = frames["ok"]
                secs = timed(fn)[0]
                row["compiled_while_timed"] = row.get("compiled_while_timed", 0) + frames["ok"] - before
                row["generation_s_runs"].append(secs)
                gens = over_ranks(statistics.median(row["generation_s_runs"]))
                gen = max(gens)
                row.update(
                    generation_s=gen, images_per_s=a.images / gen, mfu=flops_total / gen / ceiling,
                    **rank_columns({"generation_s": gens}),
                )  # fmt: skip
                rows[:] = [r for r in rows if all(r is not m for m in mine)] + mine
                D.print0(json.dumps(row))
                save()
        peak = max(over_ranks(peak_gib()))  # of all the cells' generations (the same resident models)
        for row in mine:
            row["peak_gib"] = peak
        if a.breakdown:
            for row, engine, cell in zip(ours, engines, cells):
                batch = cell.requests(requests[: cell.max_num_seqs])
                split = breakdown(functools.partial(engine.generate, batch), adapter.device)
                row["breakdown"] = {"requests": len(batch), **split}
            with label_stock(pipe):
                split = breakdown(lambda: stock_call(texts[:b]), adapter.device)
            theirs["breakdown"] = {"requests": b, **split}
    for row in mine:
        row["generation_s_runs"] = [round(t, 3) for t in row["generation_s_runs"]]


def stock(adapter, texts, negative, params, a, rows, flop_seconds, save, compiled: bool) -> None:
    """diffusers' own pipeline around the same modules (LoRA attached), batches of prompts per call.

    `flop_seconds`: the rollout's FLOPs over the matmul rate (its duration at 100% MFU)."""
    pipe, cfg_kwargs = stock_pipe(adapter, params)
    if compiled:  # per repeated block, as compile_repeated_blocks does (FSDP2 renames the block class)
        for block in adapter.fsdp_units():
            block.compile(fullgraph=True)
    for b in a.stock_batch:
        n = min(a.stock_images or len(texts), len(texts))
        name = f"stock {type(pipe).__name__} {b} prompts/call, {'compiled' if compiled else 'eager'}"

        def call(k=n, b=b):
            stock_generate(pipe, cfg_kwargs, texts[:k], negative, params, b, params.num_steps)

        def run(b=b, n=n, name=name, call=call):
            with fsdp.gathered_weights(adapter.policy):  # as the engine does: weights gathered once
                compile_s = timed(lambda: call(b))[0] if compiled else 0.0
                call(2, 2) if not compiled else None  # warm-up (kernels, allocator)
                reset_peak()
                secs, runs, _ = timed_repeats(call, a.repeats, D.barrier)
                if a.breakdown:
                    with label_stock(pipe):
                        split = breakdown(lambda: call(b, b), adapter.device)
            gens, peaks = over_ranks(secs * a.images / n), over_ranks(peak_gib())
            gen = max(gens)
            row = {
                "name": name, "generation_s": gen, "images_per_s": a.images / gen, "scaled_from": n,
                "mfu": flop_seconds / gen, "peak_gib": max(peaks),
                "compile_s": max(over_ranks(max(compile_s - secs * b / n, 0.0))),
                "generation_s_runs": [r * a.images / n for r in runs],  # this rank's
                **rank_columns({"generation_s": gens, "peak_gib": peaks}),
            }  # fmt: skip
            if a.breakdown:
                row["breakdown"] = {"requests": b, **split}
            rows.append(row)
            D.print0(json.dumps(row))

        guarded(rows, name, run)
        save()
