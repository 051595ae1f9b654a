"""Measuring helpers of the rollout benchmarks: the trainer's placement of the policy, transformer FLOPs
counted per text length, the bf16 matmul ceiling, wall-clock and CUDA-event timing, peak memory, and a
reading from every rank.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.distributed import all_reduce, derive_seed
from omnirl.fsdp import compute_dtype
from omnirl.memory import synchronize
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flux.adapter import FluxAdapter
from omnirl.models.ltx2.adapter import LTX2Adapter
from omnirl.models.qwen_image.adapter import padded_lengths
from omnirl.models.sd3.adapter import SD3Adapter
from omnirl.models.wan.adapter import WanAdapter

CLIP_TOKENS = 77  # SD3's two CLIP encoders, padded to their maximum, ahead of the T5 tokens


def place_as_trainer(policy: nn.Module, units: list[nn.Module], cfg, dist: D.DistInfo | None) -> D.DistInfo:
    """The trainer's placement of a LoRA `policy`: a process group (1 rank without torchrun) and FSDP2 over
    `units` with the recipe's MixedPrecisionPolicy (cfg.distributed), the frozen base replicated. A rollout
    then gathers the float32 LoRA once per phase in the recipe's param_dtype; unwrapped, peft would run
    every LoRA matmul in float32 (with a cast of its input), which a training run never does."""
    if dist is None:
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", "29555")
        dist = D.init_distributed()
    assert dist.mesh is not None  # init_distributed makes a mesh for every process group
    frozen = {p for p in policy.parameters() if not p.requires_grad}  # the LoRA's base
    d = cfg.distributed
    fsdp.apply_fsdp(policy, units, dist.mesh, d.param_dtype, d.reduce_dtype, frozen)
    return dist


def text_lengths(adapter, request: Request) -> tuple[int, int]:
    """(conditional, negative) text lengths of a request's rows, unpadded.

    SD3 encodes every prompt to CLIP 77 + T5 max_sequence_length tokens, all of them attended to (the
    model's own padding, no mask), so there both are that fixed length; Wan zero-pads UMT5's embeddings to
    max_sequence_length and cross-attends to all of them, so there too."""
    if isinstance(adapter, SD3Adapter):
        n = CLIP_TOKENS + adapter.max_sequence_length
        return n, n
    # LTX-2: Gemma pads to it, the connectors keep it; FLUX: T5 pads to it, CLIP enters pooled
    if isinstance(adapter, (WanAdapter, LTX2Adapter, FluxAdapter)):
        return adapter.max_sequence_length, adapter.max_sequence_length
    return adapter.prompt_length(request.prompt), adapter.prompt_length(request.negative_prompt)


def batch_lengths(adapter, batch: list[Request]) -> tuple[int, int]:
    """(conditional, negative) text lengths a packed batch is padded to, as the adapter's rollout pads it."""
    if isinstance(adapter, (SD3Adapter, WanAdapter, LTX2Adapter, FluxAdapter)):
        return text_lengths(adapter, batch[0])
    cond, neg = zip(*(text_lengths(adapter, r) for r in batch))
    guided = batch[0].params.guidance_scale > 1
    fused = batch[0].params.fused_cfg
    return padded_lengths(adapter.buckets, list(cond), list(neg) if guided else [], fused)


def transformer_flops(adapter, params: SamplingParams):
    """FLOPs of one transformer row as a function of its text length, counted with FlopCounterMode on
    one-row, unguided `adapter.velocity` calls over zero embeddings (so it works on the meta device too).
    Qwen-Image: counted at three lengths and fitted exactly by a quadratic (linear layers grow linearly
    with the tokens, attention quadratically). SD3, FLUX and Wan: one count, every row has the same text
    length (Wan's two A14B experts have one shape: the count of one holds for both)."""
    import numpy as np
    from torch.utils.flop_counter import FlopCounterMode

    dev = adapter.device
    if isinstance(adapter, LTX2Adapter):
        return ltx2_flops(adapter, params)
    sd3, wan = isinstance(adapter, SD3Adapter), isinstance(adapter, WanAdapter)
    flux = isinstance(adapter, FluxAdapter)
    cfg = adapter.config if wan else adapter.policy.config
    if wan:  # [C, f, h, w] video latents, UMT5 embeddings of width text_dim
        shape, width = adapter.latent_shape(params.height, params.width), cfg.text_dim
    else:
        h, w = params.height // adapter.vae_scale_factor, params.width // adapter.vae_scale_factor
        channels = cfg.in_channels if sd3 else cfg.in_channels // 4  # Qwen-Image packs 2x2 latent patches
        shape, width = (channels, h, w), cfg.joint_attention_dim

    def count(length: int) -> float:
        embeds = {"prompt_embeds": torch.zeros(1, length, width, device=dev)}
        if sd3 or flux:
            embeds["pooled_prompt_embeds"] = torch.zeros(1, cfg.pooled_projection_dim, device=dev)
        elif not wan:  # on the host: velocity only asks whether every row is full (then passes no mask)
            embeds["prompt_embeds_mask"] = torch.ones(1, length, dtype=torch.bool)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            x = torch.zeros(1, *shape, device=dev)
            if wan and adapter.boundary_ratio is not None:
                # velocity routes rows to experts by a host sync (nonzero), which the meta device cannot
                # run, and under FSDP runs the other expert on one row too: one expert through the policy
                # (the experts' ModuleDict: its root gathers the experts' own parameters), both have one
                # shape; this layout has no expand_timesteps
                dtype = compute_dtype(adapter.policy, adapter.transformer_dtype)
                t, text = torch.full((1,), 500.0, device=dev), embeds["prompt_embeds"].to(dtype)
                x = x.to(dtype)
                adapter.policy("transformer", hidden_states=x, timestep=t, encoder_hidden_states=text)
            else:
                adapter.velocity(x, torch.full((1,), 0.5, device=dev), embeds, 1.0)
        return counter.get_total_flops()

    if sd3 or wan or flux:
        flops = count(text_lengths(adapter, None)[0])
        return lambda length: flops
    lengths = (16, 128, 256)
    coeffs = np.polyfit(lengths, [count(n) for n in lengths], 2)
    return lambda length: float(np.polyval(coeffs, length))


def ltx2_flops(adapter: LTX2Adapter, params: SamplingParams):
    """LTX-2's one count (FlopCounterMode over one unguided `velocity` row of zero latents and embeddings:
    both streams, every prompt padded to max_sequence_length), as a function of the text length."""
    from torch.utils.flop_counter import FlopCounterMode

    dev, c, n = adapter.device, adapter.config, adapter.max_sequence_length
    grid = adapter.grid(params.height, params.width)
    embeds = {
        "prompt_embeds": torch.zeros(1, n, c.cross_attention_dim, device=dev),
        "audio_prompt_embeds": torch.zeros(1, n, c.audio_cross_attention_dim, device=dev),
        "prompt_mask": torch.ones(1, n, device=dev),
    }
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        x = torch.zeros(1, *adapter.latent_shape(params.height, params.width), device=dev)
        inputs = adapter.forward_inputs(embeds, grid, 1.0, True, adapter.transformer)
        adapter._velocity(x, torch.full((1,), 0.5, device=dev), inputs, grid, 1.0, adapter.transformer)
    flops = counter.get_total_flops()
    return lambda length: flops


def real_flops(adapter, requests: list[Request], flops_at) -> float:
    """Transformer FLOPs of one denoising step of `requests`, real rows only: the conditional row at the
    prompt's own length, the unconditional one at the negative prompt's (no padding counted)."""
    total = 0.0
    for r in requests:
        cond, neg = text_lengths(adapter, r)
        total += flops_at(cond) + (flops_at(neg) if r.params.guidance_scale > 1 else 0.0)
    return total


# ---------------------------------------------------------------------------------------------- timing


def matmul_tflops(device) -> float:
    n = 8192 if device.type == "cuda" else 512  # a CPU smoke run only checks the plumbing
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - t) / 1e12


def make_requests(texts: list[str], params: SamplingParams, negative: str) -> list[Request]:
    return [
        Request(p, i, i, derive_seed(0, 0, i), params, negative_prompt=negative, metadata={})
        for i, p in enumerate(texts)
    ]


def timed(fn) -> tuple[float, object]:
    synchronize()
    t = time.perf_counter()
    out = fn()
    synchronize()
    return time.perf_counter() - t, out


def timed_repeats(fn, repeats: int, before=lambda: None) -> tuple[float, list[float], object]:
    """(median seconds, every run's seconds, the last output) of `repeats` timed calls of `fn`, each after
    `before()` (a barrier, so ranks start together). One generation is a long run, but two calls of the
    same cell minutes apart differ by a few % (benchmarks/RESULTS.md): a close comparison needs the median."""
    import statistics

    runs, out = [], None
    for _ in range(repeats):
        before()
        secs, out = timed(fn)
        runs.append(secs)
    return statistics.median(runs), runs, out


def cuda_time(fn, iters: int, warmup: int = 0) -> float:
    """Mean seconds of `iters` calls of `fn` after `warmup` untimed ones, between two CUDA events, so the
    host's timer sees no launch latency (every GPU measurement's timer)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_calls(fn, iters: int) -> tuple[float, float]:
    """(seconds of a first, warm-up call; mean seconds of the `iters` calls after it), with CUDA events on
    a GPU (`cuda_time`)."""
    first, _ = timed(fn)
    if not torch.cuda.is_available():
        return first, timed(lambda: [fn() for _ in range(iters)])[0] / iters
    return first, cuda_time(fn, iters)


def add_qwen_bpe(parser) -> None:
    """`--qwen-bpe PATH`, for the measurements that write a random-init Qwen-Image checkpoint
    (`omnirl.models.write_random_checkpoint`)."""
    parser.add_argument(
        "--qwen-bpe",
        help="Qwen's qwen.tiktoken (in the dashscope wheel: dashscope/resources/qwen.tiktoken): a "
        "random-init Qwen-Image checkpoint gets the real Qwen2 tokenizer (omnirl/models/tokenizers.py), so "
        "prompts have their real token counts (without it a byte-level tokenizer spends several times as "
        "many)",
    )


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def over_ranks(value: float) -> list[float]:
    """`value` from every rank, in rank order (one rank: [value]); a collective."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    values = torch.zeros(world, dtype=torch.float64)  # a sum of one entry per rank
    values[rank] = value
    return all_reduce(values).tolist()


def rank_columns(values: dict[str, list[float]]) -> dict:
    """The per-rank lists of a row (`rank_generation_s`, ...): only with several ranks."""
    return {f"rank_{k}": v for k, v in values.items()} if len(next(iter(values.values()))) > 1 else {}
