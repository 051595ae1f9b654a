"""Generation throughput on a Qwen3-Omni thinker: omnirl's GenerationEngine (the native rollout backend) vs
its vLLM backend (`omnirl.rollout.vllm_engine.VLLMEngine`, the same adapter, prompts and seeds, in the
same process) vs transformers' plain `generate` vs `generate_batch`. Flags and how to run it:
benchmarks/README.md."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks.breakdown import kernel_table
from omnirl.algos.correction import consistency_metrics
from omnirl.config import config_for
from omnirl.distributed import DTYPES, device_type
from omnirl.memory import synchronize
from omnirl.models import get_adapter
from omnirl.models.base import GenerationParams, Request
from omnirl.models.lm import pad_responses
from omnirl.models.random_init import write_random_thinker
from omnirl.rollout.generate import GenerationEngine

# The arguments that shape --random-init's thinker (omnirl.models.random_init.write_random_thinker).
THINKER_SHAPE = (
    "vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "moe_intermediate", "experts",
    "experts_per_tok", "dtype", "head_scale",
)  # fmt: skip
WORDS = "the of a to in is that for it as with was on be by at this from or have an are which".split()


def make_requests(args, stops: tuple[int, ...]) -> list[Request]:
    rng = random.Random(0)
    params = GenerationParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=stops
    )
    out = []
    for i in range(args.num_requests):
        n = rng.randint(args.prompt_words // 2, args.prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        inputs = {"image": noise_image(i, args.image_size)} if args.image_size else {}
        out.append(Request(prompt, i, i, 1000 + i, params, inputs=inputs))
    return out


def noise_image(seed: int, size: int):
    """A size x size RGB image of uniform noise."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def response_length(tokens: list[int], stops: set[int]) -> int:
    """Generated tokens up to and including the first stop token."""
    for j, t in enumerate(tokens):
        if t in stops:
            return j + 1
    return len(tokens)


def run_ours(
    adapter, requests, args, keep: list, cuda_graph: bool, stats: dict, compile: bool = False
) -> int:
    engine = GenerationEngine(
        adapter, args.max_num_seqs, args.kv_cache_gib, cuda_graph=cuda_graph, compile=compile
    )
    trajs = engine.generate(requests)
    keep[:] = trajs
    stats.clear()
    stats.update(engine.stats)
    return sum(len(t.response_ids) for t in trajs)


def run_vllm(adapter, cfg, requests, keep: list, stats: dict, engines: list, seeds: bool = True) -> int:
    """The vLLM backend, created on first use (the warm-up's call, which then also holds its start) with the
    same KV budget and max_num_seqs as ours; each generate pushes the trainer's weights first (their time is
    `vllm/push_s` in the stats, inside the call's time). `seeds` False: the same engine with
    rollout.vllm_request_seeds off (vLLM's batched sampler, no per-request seed)."""
    cfg.rollout.vllm_request_seeds = seeds
    from omnirl.rollout.vllm_engine import VLLMEngine

    if not engines:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # our engine's KV cache, freed: vLLM starts from what is free
        engines.append(VLLMEngine(adapter, cfg))
    trajs = engines[0].generate(requests)
    keep[:] = trajs
    stats.clear()
    stats.update(engines[0].stats)
    return sum(len(t.response_ids) for t in trajs)


@torch.no_grad()
def check_logprobs(adapter, trajs, temperature: float, micro_batch: int = 16) -> dict[str, float]:
    """Trainer-side log-probs (one forward over prompt + response) of the engine's responses vs the ones it
    recorded: mean / max |diff| of log-probs and the Pearson correlation of the token probabilities."""
    trainer, rollout, positions = [], [], []
    for i in range(0, len(trajs), micro_batch):
        chunk = trajs[i : i + micro_batch]
        batch = adapter.collate([t.prompt_inputs() for t in chunk])
        batch = {k: v.to(adapter.device) for k, v in batch.items()}
        seqs, mask = pad_responses([t.response_ids for t in chunk], adapter.pad_token_id)
        seqs, mask = seqs.to(adapter.device), mask.to(adapter.device)
        lp = adapter.token_logprobs(batch, seqs, mask, temperature)
        trainer.append(lp[mask].cpu())
        rollout += [t.logprobs for t in chunk]
        positions += [torch.arange(len(t.response_ids)) for t in chunk]
    trainer, rollout, positions = torch.cat(trainer), torch.cat(rollout), torch.cat(positions)
    m = consistency_metrics(trainer, rollout, torch.ones_like(trainer, dtype=torch.bool))  # as logged
    return {
        "tokens": int(m["consistency/tokens"]),
        "mean_abs_diff": m["consistency/logprob_abs_diff_mean"],
        "max_abs_diff": m["consistency/logprob_abs_diff_max"],
        "prob_pearson": m["consistency/prob_pearson"],
        "mean_logprob": rollout.double().mean().item(),
        # Does the difference grow along the response (KV-cache decode vs one forward)? |diff| by position.
        "mean_abs_diff_by_position": {
            f"{lo}-{hi}": (trainer - rollout)[(positions >= lo) & (positions < hi)].abs().mean().item()
            for lo, hi in ((0, 32), (32, 128), (128, 256), (256, 1 << 20))
            if ((positions >= lo) & (positions < hi)).any()
        },
    }


def run_generate(adapter, requests, args, stops) -> int:
    """Plain `generate` on static batches of max_num_seqs left-padded prompts."""
    total = 0
    config = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=sorted(stops),
        pad_token_id=adapter.pad_token_id,
        suppress_tokens=list(adapter.placeholder_token_ids),
    )
    for i in range(0, len(requests), args.max_num_seqs):
        batch = adapter.collate([adapter.prepare(r) for r in requests[i : i + args.max_num_seqs]])
        batch = {k: v.to(adapter.device) for k, v in batch.items()}
        out = adapter.thinker.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1] :]
        total += sum(response_length(row, stops) for row in out.tolist())
    return total


def run_generate_batch(adapter, requests, args, stops) -> int:
    """transformers' continuous batching (paged KV cache); it takes token ids, so text prompts only."""
    config = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=sorted(stops),
        pad_token_id=adapter.pad_token_id,
    )
    ids = [adapter.prepare(r)["input_ids"].tolist() for r in requests]
    # No switch to flash attention: that would fetch a kernel from the hub, out of an offline machine's reach.
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs, auto_switch_to_flash=False)
    out = adapter.thinker.generate_batch(ids, generation_config=config, continuous_batching_config=cb)
    return sum(response_length(o.generated_tokens, stops) for o in out.values())


def print_kernels(name: str, table: dict) -> None:
    print(f"{name}: {table['what']}, {table['busy_s']:.3f} s busy in {table['wall_s']:.2f} s (profiled)")
    for r in table["top"]:
        print(f"  {100 * r['share']:5.1f}%  {r['s']:8.4f} s  {r['calls']:7d}  {r['name'][:100]}")


def timed(fn, *a) -> tuple[int, float]:
    synchronize()
    start = time.perf_counter()
    tokens = fn(*a)
    synchronize()
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a Qwen3-Omni checkpoint (default: the tiny one, built)")
    p.add_argument("--random-init", action="store_true", help="a random-init thinker of the shape below")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--experts-per-tok", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--head-scale", type=float, default=1.0, help="multiply the random lm_head (sharpen)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--prompt-words", type=int, default=40, help="prompts have words in [n / 2, n]")
    p.add_argument(
        "--image-size", type=int, default=0, help="each prompt also gets a noise image of this size "
        "(0 = text only; generate_batch takes no images and is then skipped)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--stop-frac", type=float, default=0.0, help="fraction of the vocabulary that stops")
    p.add_argument(
        "--methods", default="ours,ours_eager,generate,generate_batch", help="of ours, ours_eager, "
        "ours_compiled (generation.compile: decoder layers compiled in the decode step), vllm, "
        "vllm_unseeded, generate, generate_batch (vllm: the vLLM rollout backend, needs vllm installed; "
        "vllm_unseeded: the same engine with rollout.vllm_request_seeds off)",
    )  # fmt: skip
    p.add_argument("--vllm-max-model-len", type=int, default=0, help="vLLM's max_model_len (0: the model's)")
    p.add_argument("--check-logprobs", action="store_true", help="re-score our responses as the trainer")
    p.add_argument("--warmup", type=int, default=4, help="requests of a warm-up run per method (0 = none)")
    p.add_argument(
        "--kernels", type=int, default=0, help="after each timed run, profile one more (untimed) and record "
        "its N costliest device kernels (on CPU: aten operators) with their calls and share (0 = none)",
    )  # fmt: skip
    p.add_argument("--out", default="benchmarks/generate_throughput.json")
    p.add_argument(
        "--keep-model", default="", help="write the --random-init checkpoint here (DIR/random_thinker) "
        "for later runs' --model, instead of into a temporary folder",
    )  # fmt: skip
    args = p.parse_args()

    torch.set_num_threads(1 if device_type() == "cpu" else torch.get_num_threads())
    tmp = tempfile.mkdtemp()  # the checkpoint stays until the end: the vLLM backend reads it too
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: str) -> None:
    device = torch.device(device_type())
    if args.random_init:
        shape = {k: getattr(args, k) for k in THINKER_SHAPE}
        path = write_random_thinker(Path(args.keep_model or tmp), device, **shape)
    elif args.model:
        path = Path(args.model)
    else:
        from omnirl.models.tiny import make_tiny_qwen3_omni

        path = make_tiny_qwen3_omni(Path(tmp) / "tiny")
    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.dtype = str(path), args.dtype
    cfg.model.finetune = "lora"
    cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    # The vLLM backend's settings: ours' KV budget and max_num_seqs.
    cfg.rollout.backend, cfg.rollout.max_num_seqs = "vllm", args.max_num_seqs
    cfg.generation.kv_cache_gib, cfg.rollout.vllm_max_model_len = args.kv_cache_gib, args.vllm_max_model_len
    start = time.perf_counter()
    adapter = get_adapter("qwen3_omni_thinker")(cfg, device)
    load_s = time.perf_counter() - start

    vocab = adapter.lm_head.weight.shape[0]
    rng = random.Random(1)
    candidates = [t for t in range(vocab) if t not in adapter.placeholder_token_ids]
    stops = tuple(sorted(rng.sample(candidates, int(args.stop_frac * vocab)))) if args.stop_frac else ()
    all_stops = set(stops) | set(adapter.eos_token_ids)
    requests = make_requests(args, stops)
    trajs: list = []
    eager_trajs: list = []
    compiled_trajs: list = []
    vllm_trajs: list = []
    unseeded_trajs: list = []
    engines: list = []
    stats: dict = {}
    runs = {
        "ours": lambda reqs: run_ours(adapter, reqs, args, trajs, True, stats),
        "ours_eager": lambda reqs: run_ours(adapter, reqs, args, eager_trajs, False, stats),
        "ours_compiled": lambda reqs: run_ours(
            adapter, reqs, args, compiled_trajs, True, stats, compile=True
        ),
        "vllm": lambda reqs: run_vllm(adapter, cfg, reqs, vllm_trajs, stats, engines),
        "vllm_unseeded": lambda reqs: run_vllm(
            adapter, cfg, reqs, unseeded_trajs, stats, engines, seeds=False
        ),
        "generate": lambda reqs: run_generate(adapter, reqs, args, all_stops),
        "generate_batch": lambda reqs: run_generate_batch(adapter, reqs, args, all_stops),
    }
    # generate_batch switches the attention implementation while it runs: keep it last.
    order = ("ours", "ours_eager", "ours_compiled", "vllm", "vllm_unseeded", "generate", "generate_batch")
    methods = [m for m in order if m in args.methods.split(",")]
    if args.image_size:
        methods = [m for m in methods if m != "generate_batch"]
    params = sum(p.numel() for p in adapter.model.parameters())
    report = {"args": vars(args), "device": str(device), "parameters": params, "results": {}}
    results = report["results"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in methods:
        try:
            if args.warmup:
                timed(runs[name], requests[: args.warmup])
            if args.warmup > 1 and name == "ours_compiled":  # other shapes: the dynamic compile, untimed
                timed(runs[name], requests[: args.warmup // 2])
            tokens, seconds = timed(runs[name], requests)
        except Exception as e:  # noqa: BLE001 (recorded: the other methods still run)
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()  # where it failed, for the log
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            continue
        results[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        if name.startswith("ours"):  # the engine's own account: decode steps, prefills, graph capture
            results[name].update(stats)
            results[name]["ms_per_decode_step"] = 1e3 * (seconds - stats["capture_s"]) / stats["decode_steps"]
        if name == "ours_eager" and trajs:  # the CUDA-graph replay against the eager step: same samples?
            same = sum(torch.equal(a.response_ids, b.response_ids) for a, b in zip(trajs, eager_trajs))
            report["graph_vs_eager_identical_responses"] = f"{same}/{len(trajs)}"
            print(f"CUDA graph vs eager: {same}/{len(trajs)} responses identical", flush=True)
        if name == "ours_compiled" and trajs:  # fused kernels round differently: how many samples moved?
            same = sum(torch.equal(a.response_ids, b.response_ids) for a, b in zip(trajs, compiled_trajs))
            report["compiled_vs_ours_identical_responses"] = f"{same}/{len(trajs)}"
            print(f"compiled vs not: {same}/{len(trajs)} responses identical", flush=True)
        if name == "ours_compiled" and args.check_logprobs:
            report["compiled_logprob_check"] = check_logprobs(adapter, compiled_trajs, args.temperature)
            print(f"trainer vs compiled rollout log-probs: {report['compiled_logprob_check']}", flush=True)
        print(f"{name}: {tokens} tokens in {seconds:.2f} s", flush=True)
        if name.startswith("vllm"):  # start, push and generate times; tokens/s of the generate alone
            results[name].update(stats)
            results[name]["tokens_per_s_generate"] = tokens / stats["vllm/generate_s"]
        if name in ("ours", "vllm", "vllm_unseeded") and args.check_logprobs:
            key = "logprob_check" if name == "ours" else f"{name}_logprob_check"
            kept = {"ours": trajs, "vllm": vllm_trajs, "vllm_unseeded": unseeded_trajs}[name]
            report[key] = check_logprobs(adapter, kept, args.temperature)
            print(f"trainer vs {name} rollout log-probs: {report[key]}", flush=True)
        if args.kernels:  # where the time goes: one more run of the same requests under the profiler
            table = kernel_table(lambda name=name: runs[name](requests), device, args.kernels)
            if name.startswith("ours"):  # per decode step (prefills, graph warm-up and capture included)
                table["busy_ms_per_decode_step"] = 1e3 * table["busy_s"] / stats["decode_steps"]
            results[name]["kernels"] = table
            print_kernels(name, table)
        out.write_text(json.dumps(report, indent=2) + "\n")  # after each method: a later one may hang
    name = "random-init" if args.random_init else path
    print(f"model {name}: {params / 1e6:.1f} M parameters, {args.dtype}, {device}, loaded in {load_s:.1f} s")
    print(f"{args.num_requests} requests, max_num_seqs {args.max_num_seqs}, ", end="")
    print(f"max_new_tokens {args.max_new_tokens}, {len(stops)} extra stop tokens")
    print(f"{'method':<16}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'vs generate':>13}")
    base = results.get("generate", {}).get("tokens_per_s")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<16} failed: {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{name:<16}{r['tokens']:>10}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.1f}{ratio:>13}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
