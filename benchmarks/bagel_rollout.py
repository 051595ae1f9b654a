"""BAGEL-7B-MoT on one device: packed vs serial rollout, each phase's peak memory, one update's split.

    python -m benchmarks.bagel_rollout --random-init [--rows 16] [--serial 4] [--out FILE]
    python -m benchmarks.bagel_rollout --tiny      # the plumbing, on the tiny model (CPU)

With the settings of yaml/bagel_flowgrpo_ocr_lora (512 px, 15 steps, three-branch CFG text 4.0 with the
conditional and text-unconditional rows in one forward, noise level 0.7, a 2-step SDE window, bfloat16 base,
LoRA r64 on the generation copies, gradient checkpointing), it measures:

1. The rollout of `--rows` requests packed into one batch against `--serial` of them one at a time (a
   batch of 1 each), after a one-step warm-up of each shape; time per image.
2. Each phase's time and peak device memory above the weights: the prompts' contexts (the understanding
   copy, once per prompt), the whole packed rollout, the VAE decode of its latents (its own call).
3. One update on a micro-batch of the recipe's size (`optim.micro_batch_size` (sample, trained step)
   pairs of that rollout): the log-prob recomputation with gradients, the backward of a surrogate loss (the
   mean log-prob: the flow_grpo loss runs the same forward and backward), and the AdamW step on the LoRA.

`--random-init` builds BAGEL-7B-MoT from its public config with random weights
(`omnirl.models.bagel.public_config.write_random`, then `model.weights random`: the 13.6 B parameters of
the text to image path, bfloat16) and a random FLUX autoencoder; the images are noise, speed and memory
are the real model's. The tokenizer is the tiny byte-level one: a prompt costs about one token per byte.
Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from omnirl.memory import GIB

PROMPTS = [
    'A storefront sign that reads "OPEN"', 'a poster with the words "flow grpo"',
    'a chalkboard that says "hello world"', 'a neon sign reading "BAGEL"',
]  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measured(fn, device: torch.device) -> dict:
    """One call's seconds and its peak device memory above what was allocated before it."""
    accel = device.type != "cpu"
    sync(device)
    before = torch.cuda.memory_allocated(device) if accel else 0
    if accel:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - before) / GIB if accel else 0.0
    return {"s": seconds, "peak_above_gib": peak, "out": out}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--random-init", action="store_true", help="BAGEL-7B-MoT's shapes, random weights")
    which.add_argument("--tiny", action="store_true", help="the tiny model on the host (plumbing)")
    parser.add_argument("--rows", type=int, default=16, help="requests of the packed rollout")
    parser.add_argument("--serial", type=int, default=4, help="requests run one at a time")
    parser.add_argument(
        "--split-cfg", action="store_true", help="the CFG branches as two forwards (rollout.fused_cfg false)"
    )
    parser.add_argument("--out", help="write the JSON here")
    a = parser.parse_args(argv)

    from omnirl.distributed import derive_seed
    from omnirl.models import build_adapter
    from omnirl.models.base import Request
    from omnirl.ops.diffusion import Pair, pair_logprob, sampling_params
    from omnirl.recipe import load_config

    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    tmp = Path(tempfile.mkdtemp())
    overrides = ["--data.train_path", "data/ocr_prompts_tiny.jsonl"]
    if a.tiny:
        from omnirl.models.bagel.tiny import make_tiny_bagel

        path = make_tiny_bagel(tmp / "bagel")
        overrides += ["--model.dtype", "float32", "--distributed.param_dtype", "float32"]
        overrides += ["--sampling.height", "32", "--sampling.width", "32"]
        overrides += ["--sampling.num_steps", "4", "--sampling.sde_window_range", "0", "3"]
    else:
        from omnirl.models import write_random_checkpoint

        path = tmp / "bagel"
        write_random_checkpoint("bagel", path)
        overrides += ["--model.weights", "random"]
    if a.split_cfg:
        overrides += ["--rollout.fused_cfg", "false"]
    cfg = load_config("bagel_flowgrpo_ocr_lora", ["--model.path", str(path), *overrides])
    cfg.distributed.fsdp = False
    build = measured(lambda: build_adapter(cfg, device), device)
    adapter = build["out"]
    weights_gib = torch.cuda.memory_allocated(device) / GIB if device.type != "cpu" else 0.0
    params = sampling_params(cfg)

    def requests(n: int, first: int = 0, p=params):
        rows = range(first, first + n)
        return [Request(PROMPTS[i % 4], i, i, derive_seed(0, 0, i), p) for i in rows]

    warm = dataclasses.replace(params, num_steps=1, record_logprobs=False)
    adapter.rollout(requests(a.rows, p=warm))  # kernels and allocator at both shapes
    adapter.rollout(requests(1, p=warm))
    encode = measured(lambda: adapter.encode([r.prompt for r in requests(a.rows)]), device)
    packed = measured(lambda: adapter.rollout(requests(a.rows)), device)
    serial = measured(lambda: [adapter.rollout([r])[0] for r in requests(a.serial, a.rows)], device)
    trajs = packed["out"]
    final = torch.stack([t.final_latents for t in trajs])
    decode = measured(lambda: adapter.decode(final), device)

    micro = cfg.optim.micro_batch_size
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))][:micro]
    optimizer = torch.optim.AdamW(adapter.trainable_parameters(), lr=cfg.optim.lr)
    adapter.policy.train()
    forward = measured(lambda: pair_logprob(adapter, pairs, params).logprob, device)
    backward = measured(lambda: forward["out"].mean().backward(), device)
    step = measured(lambda: (optimizer.step(), optimizer.zero_grad()), device)
    peak_total = torch.cuda.max_memory_allocated(device) / GIB if device.type != "cpu" else 0.0
    context_bytes = sum(t.embeds["context"].numel() * t.embeds["context"].element_size() for t in trajs)

    result = {
        "what": "BAGEL-7B-MoT text to image, bagel_flowgrpo_ocr_lora's settings",
        "weights": "random-init" if a.random_init else "tiny",
        "device": torch.cuda.get_device_name(device) if device.type != "cpu" else platform.processor(),
        "versions": {"torch": torch.__version__},
        "size": [params.height, params.width], "num_steps": params.num_steps,
        "guidance_scale": params.guidance_scale, "fused_cfg": params.fused_cfg, "lora_rank": cfg.lora.rank,
        "lora_modules": adapter.lora_count,
        "parameters_b": sum(p.numel() for p in adapter.policy.parameters()) / 1e9,
        "build_s": build["s"], "weights_gib": weights_gib,
        "rows": a.rows, "serial_rows": a.serial,
        "encode": {k: v for k, v in encode.items() if k != "out"},
        "packed": {"s": packed["s"], "s_per_image": packed["s"] / a.rows,
                   "peak_above_gib": packed["peak_above_gib"]},
        "serial": {"s": serial["s"], "s_per_image": serial["s"] / a.serial,
                   "peak_above_gib": serial["peak_above_gib"]},
        "speedup_per_image": (serial["s"] / a.serial) / (packed["s"] / a.rows),
        "decode": {k: v for k, v in decode.items() if k != "out"},
        "update": {"pairs": len(pairs), "forward": {k: v for k, v in forward.items() if k != "out"},
                   "backward": {k: v for k, v in backward.items() if k != "out"},
                   "optimizer": {k: v for k, v in step.items() if k != "out"}},
        "peak_total_gib": peak_total,
        "context_host_mib_per_sample": context_bytes / len(trajs) / 2**20,
    }  # fmt: skip
    print(table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(r: dict) -> str:
    u = r["update"]
    rows = [
        ("contexts of the packed rows' prompts", r["encode"]),
        (f"packed rollout, {r['rows']} images", r["packed"]),
        (f"serial rollout, {r['serial_rows']} images one at a time", r["serial"]),
        (f"VAE decode, {r['rows']} images", r["decode"]),
        (f"update: log-prob forward, {u['pairs']} pairs", u["forward"]),
        ("update: backward", u["backward"]),
        ("update: AdamW step (LoRA)", u["optimizer"]),
    ]
    lines = [
        f"{r['weights']} BAGEL ({r['parameters_b']:.2f} B parameters, weights {r['weights_gib']:.1f} GiB) on "
        f"{r['device']}: {r['size'][0]}x{r['size'][1]} px, {r['num_steps']} steps, LoRA r{r['lora_rank']} on "
        f"{r['lora_modules']} modules",
        f"{'phase':<46}{'s':>9}{'peak above weights GiB':>24}",
    ]
    lines += [f"{name:<46}{m['s']:>9.3f}{m['peak_above_gib']:>24.2f}" for name, m in rows]
    lines.append(
        f"per image: packed {r['packed']['s_per_image']:.3f} s, serial {r['serial']['s_per_image']:.3f} s "
        f"({r['speedup_per_image']:.2f}x); peak of the whole run {r['peak_total_gib']:.1f} GiB; a sample's "
        f"context on the host {r['context_host_mib_per_sample']:.2f} MiB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
