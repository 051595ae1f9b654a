"""Generation throughput on a Qwen3-Omni thinker: omnirl's GenerationEngine (the native rollout backend) vs
its vLLM backend (`omnirl.rollout.vllm_engine.VLLMEngine`, the same adapter, prompts and seeds, in the
same process) vs plain vLLM (the same vLLM engine's `LLM.generate` with nothing of ours, and with one of
our settings at a time) vs transformers' plain `generate` vs `generate_batch`, on one or more loads
(concurrency x stop fraction). Flags and how to run it: benchmarks/README.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks.breakdown import kernel_table
from benchmarks.measure import place_as_trainer
from benchmarks.vllm_methods import PLAIN, cap_vllm, run_vllm, run_vllm_plain
from omnirl.algos.correction import consistency_metrics
from omnirl.distributed import device_type
from omnirl.fsdp import DTYPES, gathered_weights
from omnirl.memory import synchronize
from omnirl.models import get_adapter
from omnirl.models.base import GenerationParams, Request
from omnirl.models.lm import pad_responses
from omnirl.models.qwen3_omni_thinker.public_config import write_random_thinker
from omnirl.recipe import config_for
from omnirl.rollout.compiled import ELEMENTWISE_MODULES
from omnirl.rollout.generate import GenerationEngine

# The arguments that shape --random-init's thinker
# (omnirl.models.qwen3_omni_thinker.public_config.write_random_thinker).
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
    for first in range(0, args.num_requests, args.group_size):
        # a group's samples share one prompt and inputs, as a rollout's do
        n = rng.randint(args.prompt_words // 2, args.prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        inputs = {"image": noise_image(first, args.image_size)} if args.image_size else {}
        for i in range(first, min(first + args.group_size, args.num_requests)):
            out.append(Request(prompt, first // args.group_size, i, 1000 + i, params, inputs=inputs))
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


def run_ours(adapter, requests, args, keep: list, stats: dict, **settings) -> int:
    """The native engine with one of NATIVE's settings (GenerationEngine's keyword arguments)."""
    engine = GenerationEngine(adapter, args.max_num_seqs, args.kv_cache_gib, **settings)
    trajs = engine.generate(requests)
    keep[:] = trajs
    stats.clear()
    stats.update(engine.stats)
    return sum(len(t.response_ids) for t in trajs)


def parse_loads(text: str, args) -> list[tuple[int, float, int]]:
    """--loads "SEQS:STOP_FRAC[:REQUESTS],..." -> [(max_num_seqs, stop_frac, requests)] (REQUESTS default
    --num-requests); empty: the single load of --max-num-seqs, --stop-frac and --num-requests."""
    if not text:
        return [(args.max_num_seqs, args.stop_frac, args.num_requests)]
    loads = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            if not 1 <= len(parts) <= 3:
                raise ValueError
            load = (int(parts[0]), float(parts[1]) if len(parts) > 1 else 0.0)
            load += (int(parts[2]) if len(parts) > 2 else args.num_requests,)
        except ValueError:
            raise ValueError(
                f"--loads: {item!r} is not SEQS:STOP_FRAC[:REQUESTS] (e.g. 64:0.01:128)"
            ) from None
        if load[0] < 1 or not 0 <= load[1] < 1 or load[2] < 1:
            raise ValueError(f"--loads: {item!r} needs SEQS >= 1, STOP_FRAC in [0, 1) and REQUESTS >= 1")
        loads.append(load)
    return loads


def summarize(runs: list[float]) -> dict:
    """The median tokens/s of the repeats and their spread relative to it."""
    med = statistics.median(runs)
    return {"tokens_per_s": med, "tokens_per_s_runs": runs, "spread": (max(runs) - min(runs)) / med}


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
        rollout += [t.logprobs for t in chunk if t.logprobs is not None]
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
        "--group-size", type=int, default=1, help="samples per prompt: consecutive requests share a prompt "
        "and its image, with their own seeds, as a rollout's groups do (the native engine prepares and "
        "prefills each prompt once; vLLM's prefix cache reuses it)",
    )  # fmt: skip
    p.add_argument(
        "--image-size", type=int, default=0, help="each prompt also gets a noise image of this size "
        "(0 = text only; generate_batch takes no images and is then skipped)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--lora-std", type=float, default=0.0, help="the LoRA's B weights drawn with this std (peft "
        "starts them at 0: its matmuls then run but add nothing: merged and unmerged agree exactly)",
    )  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--stop-frac", type=float, default=0.0, help="fraction of the vocabulary that stops")
    p.add_argument(
        "--methods", default="ours,ours_eager,generate,generate_batch", help="of ours, ours_eager, "
        "ours_compiled (generation.compile: decoder layers compiled in the decode step), ours_merged "
        "(generation.merge_lora: the LoRA merged into copies of its weights for the call), ours_norms "
        "(ours_merged with the decode step's norms and routers compiled), ours_moe (ours_norms with the "
        "whole MoE block compiled: routing, dispatch, activations, combine; the grouped GEMMs stay aten's), "
        "ours_rows (ours_norms with generation.row_buckets 4: a step computes the busy slots' smallest "
        "of 4 slot counts), ours_one_window "
        "(generation.kv_windows 1: every step attends to the whole KV cache), vllm, "
        "vllm_unseeded, vllm_nolp, vllm_plain, vllm_plain_bias, vllm_plain_logprobs, vllm_plain_flat, "
        "vllm_plain_seeds, generate, generate_batch (vllm: the vLLM rollout backend, needs vllm installed; "
        "vllm_unseeded: the same engine with rollout.vllm.request_seeds off; vllm_nolp: unseeded and "
        "rollout.vllm.logprobs off; vllm_plain: that engine's LLM.generate with plain "
        "sampling settings and token prompts, and _bias / _logprobs / _flat / _seeds: plus one of the "
        "backend's settings: the placeholder ban, log-probs as dicts or flat lists, per-request seeds)",
    )  # fmt: skip
    p.add_argument(
        "--loads", default="", help="SEQS:STOP_FRAC,... : every method on each load in turn (max_num_seqs "
        "and --stop-frac per load; one vLLM engine for all, built for the largest); empty: the two flags",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each method per load (interleaved)")
    p.add_argument("--repeat-methods", default="", help="the methods --repeats applies to (empty: all)")
    p.add_argument("--vllm-max-model-len", type=int, default=0, help="vLLM's max_model_len (0: the model's)")
    p.add_argument("--check-logprobs", action="store_true", help="re-score our responses as the trainer")
    p.add_argument("--warmup", type=int, default=4, help="requests of a warm-up run per method (0 = none)")
    p.add_argument(
        "--kernels", type=int, default=0, help="after each timed run, profile one more (untimed) and record "
        "its N costliest device kernels (on CPU: aten operators) with their calls and share (0 = none)",
    )  # fmt: skip
    p.add_argument("--kernel-methods", default="", help="the methods --kernels profiles (empty: all)")
    p.add_argument(
        "--kernel-requests", type=int, default=0, help="the profiled run of --kernels takes the first N "
        "requests (0 = all)",
    )  # fmt: skip
    p.add_argument("--out", default="benchmarks/generate_throughput.json")
    p.add_argument(
        "--keep-model", default="", help="write the --random-init checkpoint here (DIR/random_thinker) "
        "for later runs' --model, instead of into a temporary folder",
    )  # fmt: skip
    args = p.parse_args()
    try:
        parse_loads(args.loads, args)
    except ValueError as e:
        p.error(str(e))  # one error line, exit 2, before anything loads
    if args.group_size < 1:
        p.error(f"--group-size must be >= 1, got {args.group_size}")

    torch.set_num_threads(1 if device_type() == "cpu" else torch.get_num_threads())
    tmp = tempfile.mkdtemp()  # the checkpoint stays until the end: the vLLM backend reads it too
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: str) -> None:
    device = torch.device(device_type())
    loads = parse_loads(args.loads, args)  # checked in main
    if args.random_init:
        shape = {k: getattr(args, k) for k in THINKER_SHAPE}
        path = write_random_thinker(Path(args.keep_model or tmp), device, **shape)
    elif args.model:
        path = Path(args.model)
    else:
        from omnirl.models.qwen3_omni_thinker.tiny import make_tiny_qwen3_omni

        path = make_tiny_qwen3_omni(Path(tmp) / "tiny")
    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.dtype = str(path), args.dtype
    cfg.model.finetune = "lora"
    cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    # The vLLM backend's settings: ours' KV budget, the largest load's max_num_seqs (cap_vllm: each load's).
    cfg.rollout.backend, cfg.rollout.max_num_seqs = "vllm", max(load[0] for load in loads)
    cfg.generation.kv_cache_gib, cfg.rollout.vllm.max_model_len = args.kv_cache_gib, args.vllm_max_model_len
    # The mmk12 recipe's placement: FSDP2 with the LoRA gathered in its base's dtype (a LoRA computes in its
    # base's dtype: config_checks), so the rollouts run the adapter's matmuls as a training run does. FSDP2's
    # mixed precision has no float16 (distributed.param_dtype), so a float16 LoRA runs unwrapped, as a
    # recipe with that dtype must (distributed.fsdp false).
    start = time.perf_counter()
    adapter = get_adapter("qwen3_omni_thinker")(cfg, device)
    if args.lora_std:  # a trained adapter's numbers (peft starts B at 0: the LoRA adds nothing)
        gen = torch.Generator(device).manual_seed(0)
        with torch.no_grad():
            for name, p in adapter.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * args.lora_std)
    if args.dtype != "float16":
        cfg.distributed.param_dtype = args.dtype
        place_as_trainer(adapter.policy, adapter.fsdp_units(), cfg, None)
    load_s = time.perf_counter() - start

    vocab = adapter.lm_head.weight.shape[0]
    candidates = [t for t in range(vocab) if t not in adapter.placeholder_token_ids]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    if args.image_size:  # token ids only: no images
        methods = [m for m in methods if m != "generate_batch" and m not in PLAIN]
    params = sum(p.numel() for p in adapter.model.parameters())
    report: dict = {"args": vars(args), "device": str(device), "parameters": params, "loads": {}}
    with gathered_weights(adapter.model):  # what the rollouts' LoRA matmuls run in
        lora = {str(p.dtype) for n, p in adapter.model.named_parameters() if "lora_" in n}
    report["lora_compute_dtype"] = sorted(d.removeprefix("torch.") for d in lora)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engines: list = []
    warmed: set[str] = set()
    for max_num_seqs, stop_frac, num_requests in loads:
        rng = random.Random(1)
        stops = tuple(sorted(rng.sample(candidates, int(stop_frac * vocab)))) if stop_frac else ()
        load = {"max_num_seqs": max_num_seqs, "stop_frac": stop_frac, "num_requests": num_requests}
        load_args = argparse.Namespace(**{**vars(args), **load})
        name = f"{max_num_seqs} concurrent, stop-frac {stop_frac:g}, {num_requests} requests"
        print(f"== load: {name}", flush=True)
        cap_vllm(engines, max_num_seqs)
        entry = report["loads"][name] = dict(load)
        run_load(
            load_args, adapter, cfg, device, methods, stops, engines, warmed, entry, lambda: write(report)
        )
        if len(loads) == 1:  # one load: its results at the top level too, as before --loads
            report.update({k: v for k, v in entry.items() if k not in load})
        write(report)
    print(f"model {'random-init' if args.random_init else path}: {params / 1e6:.1f} M parameters, ", end="")
    lora_dtype = ", ".join(report["lora_compute_dtype"])
    print(f"{args.dtype} (LoRA computing in {lora_dtype}), {device}, loaded in {load_s:.1f} s")
    for name, entry in report["loads"].items():
        print_table(name, args, entry["results"])
    print(f"wrote {args.out}")


# The native engine's variants: run_ours's keyword arguments. Compiled parts of the decode step are class-name
# ends (omnirl.rollout.compiled): the norms and routers, or those with the whole MoE block (whose grouped
# GEMMs inductor leaves to aten without max-autotune).
MOE_MODULES = (*ELEMENTWISE_MODULES, "SparseMoeBlock")
NORMS = {"merge_lora": True, "compile_modules": ELEMENTWISE_MODULES}
NATIVE: dict[str, dict] = {
    "ours": {},
    "ours_merged": {"merge_lora": True},
    "ours_norms": NORMS,
    "ours_u8": {**NORMS, "narrow_expert_ids": True},
    "ours_moe": {"merge_lora": True, "compile_modules": MOE_MODULES},
    "ours_one_window": {"kv_windows": 1},
    "ours_rows": {**NORMS, "row_buckets": 4},
    "ours_eager": {"cuda_graph": False},
    "ours_compiled": {"compile": True},
}
# Methods whose log-probs the trainer re-scores: all but the native variants that draw ours's samples by
# construction (the eager step the graph replays; narrower attention reads).
LOGPROB_CHECKED = (
    *(m for m in NATIVE if m not in ("ours_eager", "ours_one_window")),
    "vllm",
    "vllm_unseeded",
)
# Variants whose compiles need the timed run's shapes (their warm-up runs them, then other shapes).
COMPILED = tuple(m for m, kw in NATIVE.items() if kw.get("compile") or kw.get("compile_modules"))


def write(report: dict) -> None:
    """The report so far (after each method: a later one may hang)."""
    Path(report["args"]["out"]).write_text(json.dumps(report, indent=2) + "\n")


# The order they run in; generate_batch switches the attention implementation: last.
BACKEND = ("vllm", "vllm_unseeded", "vllm_nolp")  # our vLLM backend, as a rollout runs it
METHODS = (*NATIVE, *BACKEND, *PLAIN, "generate", "generate_batch")


def run_load(args, adapter, cfg, device, methods, stops, engines, warmed: set, entry: dict, save) -> None:
    """Every method on one load (args.max_num_seqs, args.stop_frac), --repeats times, into `entry`."""
    all_stops = set(stops) | set(adapter.eos_token_ids)
    requests = make_requests(args, stops)
    kept: dict[str, list] = {m: [] for m in (*NATIVE, *BACKEND)}
    stats: dict = {}
    prompts: dict = {}
    if any(m in PLAIN for m in methods):  # plain vLLM's token prompts, made before any clock
        from vllm.inputs import TokensPrompt

        prompts = {
            r.index: TokensPrompt(prompt_token_ids=adapter.prepare(r)["input_ids"].tolist()) for r in requests
        }
    runs = {
        **{
            m: (
                lambda reqs, m=m, settings=settings: run_ours(adapter, reqs, args, kept[m], stats, **settings)
            )
            for m, settings in NATIVE.items()
        },
        "vllm": lambda reqs: run_vllm(adapter, cfg, reqs, kept["vllm"], stats, engines),
        "vllm_unseeded": lambda reqs: run_vllm(
            adapter, cfg, reqs, kept["vllm_unseeded"], stats, engines, seeds=False
        ),
        "vllm_nolp": lambda reqs: run_vllm(
            adapter, cfg, reqs, kept["vllm_nolp"], stats, engines, seeds=False, logprobs=False
        ),
        **{
            m: (lambda reqs, extras=extras: run_vllm_plain(adapter, cfg, reqs, prompts, engines, extras))
            for m, extras in PLAIN.items()
        },
        "generate": lambda reqs: run_generate(adapter, reqs, args, all_stops),
        "generate_batch": lambda reqs: run_generate_batch(adapter, reqs, args, all_stops),
    }
    results = entry["results"] = {}
    for name in methods:  # warm-ups: once per method and process (a vLLM engine's start, graph captures)
        if name in warmed or not args.warmup:
            continue
        try:
            warm = requests[: args.warmup]
            if name not in COMPILED:  # (whose compiles need the timed run's shapes)
                short = dataclasses.replace(warm[0].params, max_new_tokens=min(16, args.max_new_tokens))
                warm = [dataclasses.replace(r, params=short) for r in warm]
            timed(runs[name], warm)
            if args.warmup > 1 and name in COMPILED:  # other shapes: the dynamic compile, untimed
                timed(runs[name], requests[: args.warmup // 2])
            cap_vllm(engines, args.max_num_seqs)  # an engine the warm-up created
            warmed.add(name)
        except Exception as e:  # noqa: BLE001 (recorded: the other methods still run)
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            print(f"{name}: warm-up FAILED {type(e).__name__}: {e}", flush=True)
    vllm_methods = [m for m in methods if m.startswith("vllm") and m not in results]
    if vllm_methods and args.warmup:  # vLLM's first batch of this size JIT-compiles kernels: not timed
        short = dataclasses.replace(requests[0].params, max_new_tokens=min(16, args.max_new_tokens))
        batch = [dataclasses.replace(r, params=short) for r in requests[: args.max_num_seqs]]
        timed(runs[vllm_methods[0]], batch)
    live = [m for m in methods if m not in results]
    for rep in range(args.repeats):  # repeats interleaved, so a drift of the machine hits every method
        repeated = args.repeat_methods.split(",") if args.repeat_methods else live
        for name in live:
            if "error" in results.get(name, {}) or (rep > 0 and name not in repeated):
                continue
            try:
                tokens, seconds = timed(runs[name], requests)
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
                print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
                save()
                continue
            # (unseeded samples, hence lengths, may differ from run to run: each run's own tokens/s)
            r = results.setdefault(name, {"tokens": tokens, "tokens_runs": [], "seconds_runs": []})
            r["tokens_runs"].append(tokens)
            r["seconds_runs"].append(seconds)
            r["seconds"] = statistics.median(r["seconds_runs"])
            r.update(summarize([n / t for n, t in zip(r["tokens_runs"], r["seconds_runs"])]))
            print(f"{name}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f}/s)", flush=True)
            if name.startswith("ours"):  # the engine's own account: decode steps, prefills, graph capture
                r.update(stats)
                r["ms_per_decode_step"] = 1e3 * (seconds - stats["capture_s"]) / stats["decode_steps"]
            if name in BACKEND:  # start, push, prepare, generate and collect times
                r.update(stats)
                r["tokens_per_s_generate"] = tokens / stats["vllm/generate_s"]
            if rep == 0:
                after_first_run(args, adapter, name, kept, entry, runs, requests, device, stats)
            save()
    base = results.get("vllm_plain", {}).get("tokens_per_s")
    for r in results.values():  # each method's speed over plain vLLM's
        if base and "tokens_per_s" in r:
            r["vs_vllm_plain"] = r["tokens_per_s"] / base


# Variants of the native engine whose samples are compared with `ours`'s: (report key, label). The CUDA graph
# replays the eager step; the KV windows only narrow the attention's reads; fused compiled kernels round
# differently, so some samples move.
SAME_SAMPLES = {
    "ours_merged": ("merged_vs_ours_identical_responses", "merged LoRA vs not"),
    "ours_norms": ("norms_vs_ours_identical_responses", "merged LoRA + compiled norms vs neither"),
    "ours_u8": ("u8_vs_ours_identical_responses", "ours_norms with uint8 expert ids vs ours"),
    "ours_rows": ("rows_vs_ours_identical_responses", "ours_norms with 4 row buckets vs ours"),
    "ours_moe": ("moe_vs_ours_identical_responses", "merged LoRA + compiled norms and MoE vs neither"),
    "ours_eager": ("graph_vs_eager_identical_responses", "CUDA graph vs eager"),
    "ours_one_window": ("windows_vs_one_window_identical_responses", "KV windows vs one window"),
    "ours_compiled": ("compiled_vs_ours_identical_responses", "compiled vs not"),
}


def after_first_run(args, adapter, name, kept, entry, runs, requests, device, stats) -> None:
    """After a method's first timed run: compare samples, re-score log-probs, and the kernel table."""
    results = entry["results"]
    if name in SAME_SAMPLES and kept["ours"]:  # a variant of the native engine: the same samples?
        key, label = SAME_SAMPLES[name]
        same = sum(torch.equal(a.response_ids, b.response_ids) for a, b in zip(kept["ours"], kept[name]))
        entry[key] = f"{same}/{len(kept['ours'])}"
        print(f"{label}: {same}/{len(kept['ours'])} responses identical", flush=True)
    if args.check_logprobs and name in LOGPROB_CHECKED:
        key = {"ours": "logprob_check", "ours_compiled": "compiled_logprob_check"}.get(
            name, f"{name}_logprob_check"
        )
        entry[key] = check_logprobs(adapter, kept[name], args.temperature)
        print(f"trainer vs {name} rollout log-probs: {entry[key]}", flush=True)
    if args.kernels and (
        not args.kernel_methods or name in args.kernel_methods.split(",")
    ):  # where the time goes: one more run under the profiler (the first --kernel-requests)
        subset = requests[: args.kernel_requests] if args.kernel_requests else requests
        table = kernel_table(lambda: runs[name](subset), device, args.kernels)
        table["requests"] = len(subset)
        if name.startswith("ours"):  # per decode step (prefills, graph warm-up and capture included)
            table["busy_ms_per_decode_step"] = 1e3 * table["busy_s"] / stats["decode_steps"]
        results[name]["kernels"] = table
        print_kernels(name, table)


def print_table(load: str, args, results: dict) -> None:
    print(f"{load}: max_new_tokens {args.max_new_tokens}, up to {args.repeats} run(s)")
    head = f"{'method':<22}{'tokens':>9}{'seconds':>9}{'tokens/s':>11}{'spread':>8}{'vs plain':>10}"
    print(f"{head}{'vs generate':>13}")
    base = results.get("generate", {}).get("tokens_per_s")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22} failed: {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        plain = f"{r['vs_vllm_plain']:.3f}" if "vs_vllm_plain" in r else "-"
        print(
            f"{name:<22}{r['tokens']:>9}{r['seconds']:>9.2f}{r['tokens_per_s']:>11.1f}"
            f"{100 * r['spread']:>7.1f}%{plain:>10}{ratio:>13}"
        )


if __name__ == "__main__":
    main()
