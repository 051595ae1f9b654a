"""Packed vs serial diffusion rollout: the VeRL-Omni Qwen-Image reference experiment, and SD3.5-Medium.

    python benchmarks/rollout_packing.py --model qwen_image --random-init --images 128 --out qwen.json
    python benchmarks/rollout_packing.py --model sd35 --random-init --images 256 --max-num-seqs 32 64 128 256

The reference (VeRL-Omni v0.2.0, Qwen-Image LoRA OCR recipe, 512 px, True-CFG 4.0, 10 steps, 128 images
per GPU): 226 s serial (max_num_seqs 1) -> 108 s packed (max_num_seqs 32) per training step.

Generation time runs from requests in to decoded images and trajectories on the host, through omnirl's
DiffusionEngine (the trainer's rollout path: packer, per-request generators, SDE window, log-probs).
- serial: one request at a time, its CFG as two batch-1 forwards per step, eager (what the reference's
  serial meant); timed on `--serial-requests` requests and scaled linearly to `--images`.
- packed: max_num_seqs in `--max-num-seqs`, CFG rows fused into one forward, eager and compiled
  (per-block torch.compile with power-of-two batch buckets; compile time reported apart).
- stock: diffusers' own pipeline (QwenImagePipeline / StableDiffusion3Pipeline) called with batches of
  `--stock-batch` prompts, eager and with `compile_repeated_blocks`.
MFU: transformer FLOPs of the real (unpadded) rows, counted with torch's FlopCounterMode at each
request's own prompt length, over the bf16 matmul rate measured in the same run (8192^3).

`--random-init` builds the full-size models from their public configs with random weights (no download):
a config-only checkpoint is written and the adapter's loader builds each model from its config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from omnirl import distributed as D
from omnirl.config import load_config
from omnirl.memory import synchronize
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams, derive_seed
from omnirl.rollout.diffusion import DiffusionEngine
from omnirl.trainer import shard

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


# ---------------------------------------------------------------------------------------------- models


def write_random_checkpoint(model: str, out: Path) -> None:
    """A config-only checkpoint of the public configs, with the tiny byte-level tokenizers of tiny.py."""
    from omnirl.models import tiny

    def dump(sub: str, cfg: dict) -> None:
        (out / sub).mkdir(parents=True, exist_ok=True)
        (out / sub / "config.json").write_text(json.dumps(cfg))

    if model == "qwen_image":
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig

        (out / "model_index.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
        with torch.device("meta"):  # the defaults are Qwen-Image's; built on meta only to read the config
            dump("transformer", dict(QwenImageTransformer2DModel().config))
            dump("vae", dict(AutoencoderKLQwenImage().config))
        te = Qwen2_5_VLConfig(  # Qwen2.5-VL-7B-Instruct
            text_config=dict(
                vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
            ),
            vision_config=dict(
                depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31],
            ),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        )  # fmt: skip
        te.save_pretrained(out / "text_encoder")
        tiny._qwen_image_tokenizer().save_pretrained(out / "tokenizer")
        (out / "scheduler").mkdir(parents=True, exist_ok=True)
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_SCHEDULER))
    else:
        raise ValueError(f"--random-init has no configs for {model!r}")


QWEN_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "use_dynamic_shifting": True,
}  # fmt: skip


def random_init_loader(device: torch.device):
    """Replaces `load_pretrained`: build the model from its config directly on the device, random weights."""
    from diffusers import ModelMixin

    def load(cls, path, subfolder=None, torch_dtype=None, dtype=None, **_):
        with torch.device(device):
            if issubclass(cls, ModelMixin):
                model = cls.from_config(cls.load_config(path, subfolder=subfolder))
            else:
                model = cls._from_config(cls.config_class.from_pretrained(path, subfolder=subfolder))
        return model.to(torch_dtype or dtype or torch.float32).eval()

    return load


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


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def transformer_flops(adapter, params: SamplingParams):
    """FLOPs of one transformer row as a function of its text length: counted with FlopCounterMode on
    one-step, one-row rollouts at three prompt lengths and fitted exactly by a quadratic (linear layers
    grow linearly with the tokens, attention quadratically)."""
    import dataclasses

    import numpy as np
    from torch.utils.flop_counter import FlopCounterMode

    one = dataclasses.replace(params, num_steps=1, guidance_scale=1.0, sde_window_size=0)
    points = {}
    for words in (8, 20, 45):
        prompt = " ".join(["word"] * words)
        counter = FlopCounterMode(display=False)
        # Count inside the transformer's forward only (not the text encoder or the VAE).
        # (A hook that returns a value replaces the module's inputs / outputs: these return None.)
        pre = adapter.transformer.register_forward_pre_hook(lambda *_, c=counter: [c.__enter__()] and None)
        post = adapter.transformer.register_forward_hook(
            lambda *_, c=counter: [c.__exit__(None, None, None)] and None
        )
        try:
            adapter.rollout([Request(prompt, 0, 0, 0, one)])
        finally:
            pre.remove()
            post.remove()
        points[adapter.bucket(prompt)] = counter.get_total_flops()
    assert len(points) == 3, f"the three prompts must fall in three prompt-length buckets: {points}"
    coeffs = np.polyfit(list(points), list(points.values()), 2)
    return lambda length: float(np.polyval(coeffs, length))


def rollout_flops(adapter, requests: list[Request], flops_of) -> float:
    """Transformer FLOPs of all denoising steps of `requests`, real rows only: the conditional row at the
    prompt's own length, the unconditional one at the negative prompt's (no padding counted)."""
    total = 0.0
    for r in requests:
        total += flops_of(adapter.prompt_length(r.prompt))
        if r.params.guidance_scale > 1:
            total += flops_of(adapter.prompt_length(r.negative_prompt))
    return total * requests[0].params.num_steps


def logprob_gap(adapter, trajs, clip_range: float) -> dict:
    """For the unchanged policy: the trainer's recomputed log-prob of every trained step (micro-batches of 8,
    as the recipe trains) against the rollout's, per timestep; and the clip fraction that gap alone would
    give the first update (ratio outside 1 +- clip_range)."""
    from omnirl.trainer import Pair, pair_logprob

    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    diffs, steps = [], []
    with torch.no_grad():
        for i in range(0, len(pairs), 8):
            mb = pairs[i : i + 8]
            lp, _, _ = pair_logprob(adapter, mb, trajs[0].request.params)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["qwen_image"], default="qwen_image")
    p.add_argument("--path", help="a local checkpoint (else --random-init)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--images", type=int, default=128, help="images per GPU (the reference: 128)")
    p.add_argument("--serial-requests", type=int, default=16, help="0 skips the serial run")
    p.add_argument("--max-num-seqs", type=int, nargs="*", default=[8, 16, 32, 64])
    p.add_argument("--compiled-max-num-seqs", type=int, nargs="*", default=[16, 32])
    p.add_argument("--stock-batch", type=int, nargs="*", default=[16, 32])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--out", default="rollout_packing.json")
    p.add_argument(
        "--logprob-check",
        type=int,
        default=32,
        help="after this max_num_seqs run, compare the "
        "trainer's recomputed log-probs (micro-batches of 8) with the rollout's",
    )
    a = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict = {
        "args": vars(a),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    results["matmul_tflops"] = matmul_tflops(device)
    print(f"bf16 matmul ceiling: {results['matmul_tflops']:.0f} TFLOP/s", flush=True)

    tmp = tempfile.mkdtemp()
    path = a.path
    if a.random_init:
        path = tmp + "/ckpt"
        write_random_checkpoint(a.model, Path(path))
        import omnirl.models.qwen_image as module

        module.load_pretrained = random_init_loader(device)
    cfg = load_config(
        "qwen_image_flowgrpo_ocr",
        ["--model.path", path, "--sampling.height", str(a.size), "--sampling.width", str(a.size)],
    )
    t_load, adapter = timed(lambda: get_adapter(cfg.model.adapter)(cfg, device))
    print(f"models built in {t_load:.0f} s, {peak_gib():.1f} GiB", flush=True)
    # The trainer's path: a 1-rank process group and FSDP2 with the recipe's MixedPrecisionPolicy, so the
    # rollout gathers the float32 LoRA once per phase in bfloat16 (peft would otherwise run every LoRA
    # matmul in float32, which is what a training run never does).
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", "29555")
    shard(cfg, adapter, None, D.init_distributed())
    s = cfg.sampling
    params = SamplingParams(
        s.height, s.width, a.steps, s.guidance_scale, s.noise_level, s.sde_type, s.sde_window_size,
        tuple(s.sde_window_range),
    )  # fmt: skip
    texts = prompts(a.images, 0)
    requests = make_requests(texts, params, s.negative_prompt)
    flops_total = rollout_flops(adapter, requests, transformer_flops(adapter, params))
    results["transformer_tflop_per_rollout"] = flops_total / 1e12
    rows = []

    def run_engine(name, reqs, scale, **kw):
        engine = DiffusionEngine(adapter, **kw)
        compile_s = 0.0
        if kw.get("compile"):
            compile_s, _ = timed(lambda: engine.generate(reqs))  # compiles every bucket shape
        engine.generate(reqs[: min(len(reqs), 2)])  # warm-up (allocator, kernels)
        torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
        secs, trajs = timed(lambda: engine.generate(reqs))
        gen = secs * scale
        row = {
            "name": name, "generation_s": gen, "images_per_s": a.images / gen, "scaled_from": len(reqs),
            "mfu": flops_total / gen / (results["matmul_tflops"] * 1e12), "peak_gib": peak_gib(),
            "compile_s": max(compile_s - secs, 0.0),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
        return trajs

    def save():
        results["rows"] = rows
        Path(a.out).write_text(json.dumps(results, indent=1))

    if a.serial_requests:
        run_engine(
        "serial (max_num_seqs 1, CFG 2 forwards, eager)",
        requests[: a.serial_requests], a.images / a.serial_requests,
        max_num_seqs=1, fused_cfg=False,
    )  # fmt: skip
    for n in a.max_num_seqs:
        trajs = run_engine(f"packed max_num_seqs {n}, eager", requests, 1.0, max_num_seqs=n)
        if n == a.logprob_check:
            results["logprob_check"] = logprob_gap(adapter, trajs, cfg.algo.clip_range)
            print(json.dumps(results["logprob_check"]), flush=True)
            save()
    stock(adapter, texts, params, a, rows, results, flops_total, save, compiled=False)
    for n in a.compiled_max_num_seqs:
        run_engine(f"packed max_num_seqs {n}, compiled", requests, 1.0, max_num_seqs=n, compile=True)
    if a.compiled_max_num_seqs:
        stock(adapter, texts, params, a, rows, results, flops_total, save, compiled=True)
    save()
    serial = rows[0]["generation_s"] if a.serial_requests else float("nan")
    print(
        f"\n{'configuration':55s} {'gen s':>8s} {'img/s':>7s} {'x serial':>8s} {'MFU':>6s} {'peak GiB':>8s}"
    )
    for r in rows:
        print(
            f"{r['name']:55s} {r['generation_s']:8.1f} {r['images_per_s']:7.2f} "
            f"{serial / r['generation_s']:8.2f} {100 * r['mfu']:5.1f}% {r['peak_gib']:8.1f}"
        )
    print(f"wrote {a.out}")


def stock(adapter, texts, params, a, rows, results, flops_total, save, compiled: bool) -> None:
    """diffusers' QwenImagePipeline around the same modules (LoRA attached), batches of prompts per call."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(
        scheduler=adapter.scheduler, vae=adapter.vae, text_encoder=adapter.text_encoder,
        tokenizer=adapter.tokenizer, transformer=adapter.transformer,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    if compiled:  # per repeated block, as compile_repeated_blocks does (FSDP2 renames the block class)
        for block in adapter.fsdp_units():
            block.compile(fullgraph=True)
    for b in a.stock_batch:
        n = max(b, min(len(texts), 2 * b))

        def call(k=n, b=b):
            for i in range(0, k, b):
                pipe(
                    prompt=texts[i : i + b], negative_prompt=[" "] * len(texts[i : i + b]),
                    true_cfg_scale=params.guidance_scale, num_inference_steps=params.num_steps,
                    height=params.height, width=params.width, output_type="pil",
                )  # fmt: skip

        with D.gathered_weights(adapter.transformer):  # as the engine does: weights gathered once
            compile_s = timed(lambda b=b: call(b))[0] if compiled else 0.0
            call(2, 2) if not compiled else None  # warm-up (kernels, allocator)
            secs = timed(call)[0]
        gen = secs * a.images / n
        row = {
            "name": f"stock QwenImagePipeline {b} prompts/call, {'compiled' if compiled else 'eager'}",
            "generation_s": gen, "images_per_s": a.images / gen, "scaled_from": n,
            "mfu": flops_total / gen / (results["matmul_tflops"] * 1e12), "peak_gib": peak_gib(),
            "compile_s": max(compile_s - secs * b / n, 0.0),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()


if __name__ == "__main__":
    main()
