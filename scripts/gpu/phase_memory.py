"""Per-phase device memory of a real diffusion recipe: a few RL steps of the recipe through the trainer on its
full-size models with random weights, and per step a table of each phase's peak device memory and
sleep/wake traffic. What runs, what changes against the recipe, and its flags: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu.step_report import count_flops, report, split_table, step_split, summarise_steps

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Recipe:
    model: str  # omnirl.models.write_random_checkpoint's name for the models
    tiny: str  # the tiny recipe of --tiny
    family: str  # omnirl.testing.TINY_MODELS key of the tiny checkpoint
    data: str  # "ocr" or "edit": which generator writes the data (the video recipes read only the prompts)


RECIPES = {
    "qwen_image_flowgrpo_ocr": Recipe("qwen_image", "qwen_image_tiny_flowgrpo", "qwen_image", "ocr"),
    "qwen_image_edit_flowgrpo": Recipe(
        "qwen_image_edit", "qwen_image_edit_tiny_flowgrpo", "qwen_image_edit", "edit"
    ),
    "sd35_flowgrpo_ocr": Recipe("sd3", "sd3_tiny_flowgrpo", "sd3", "ocr"),
    "wan22_ti2v_dancegrpo": Recipe("wan_ti2v", "wan22_ti2v_tiny_dancegrpo", "wan_ti2v", "ocr"),
    "wan22_a14b_flowgrpo_lora": Recipe("wan_a14b", "wan22_a14b_tiny_flowgrpo_lora", "wan_a14b", "ocr"),
    "ltx23_t2av_flowgrpo_lora": Recipe("ltx2", "ltx23_tiny_t2av_flowgrpo", "ltx2", "ocr"),
    "flux_dancegrpo_hpsv3": Recipe("flux", "flux_tiny_dancegrpo", "flux", "ocr"),
    "bagel_flowgrpo_ocr_lora": Recipe("bagel", "bagel_tiny_flowgrpo", "bagel", "ocr"),
}
# Packages a reward needs beyond the trainer's; a reward whose packages are missing is left out.
REWARD_NEEDS = {
    "ocr": ("rapidocr", "rapidfuzz", "onnxruntime"),
    "text_edit": ("rapidocr", "rapidfuzz", "onnxruntime"),
}
PROMPTS_PER_RANK = 2
GIB = 2**30
STOP_S = 10  # seconds a stopped run has to end before it is killed
REPORT_S = STOP_S + 5  # what --budget-s keeps back for stopping the run and writing the report
VERSIONS = ("torch", "diffusers", "transformers", "peft")


# ---------------------------------------------------------------------------------------------- driver


def recipe_name(name: str) -> str:
    name = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    if name not in RECIPES:
        raise SystemExit(f"error: --recipe {name!r}: one of {', '.join(RECIPES)}")
    return name


def make_data(kind: str, out: Path, tiny: bool, rows: int) -> None:
    """The recipe's data from the repo's generators: OUT/train.jsonl and OUT/val.jsonl."""
    if kind == "ocr":
        cmd = ["scripts/make_ocr_prompts.py", "--train", str(max(rows, 64)), "--val", "8"]
    else:  # the real recipe's sources are 512 px, the tiny one's 64 px (their recipes' comments)
        size = "64" if tiny else "512"
        cmd = ["scripts/make_edit_data.py", "--train", str(rows), "--val", "2", "--size", size]
    subprocess.run([sys.executable, *cmd, "--out", str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def reward_weights(
    weights: dict[str, float], noise: float, paths: dict[str, str] | None = None
) -> tuple[dict[str, float], list[str]]:
    """The recipe's weights without the rewards whose packages are missing or whose local checkpoint
    (`reward.paths`: HPSv3's 16 GB, CLIP's) is not on this machine, plus `uniform_noise`."""
    import importlib.util

    paths = paths or {}
    dropped = [
        n
        for n in weights
        if any(importlib.util.find_spec(p) is None for p in REWARD_NEEDS.get(n, ()))
        or (n in paths and not (ROOT / paths[n]).exists())
    ]
    kept = {n: w for n, w in weights.items() if n not in dropped}
    return {**kept, "uniform_noise": noise if kept else 1.0}, dropped


def override_given(overrides: list[str], key: str) -> str | None:
    """The value of `--KEY value` or `--KEY=value` among the overrides, if given (the last one)."""
    value = None
    for i, arg in enumerate(overrides):
        if arg == f"--{key}" and i + 1 < len(overrides):
            value = overrides[i + 1]
        elif arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
    return value


def settings(cfg) -> dict:
    """What decides the peaks, as the run had it."""
    return {
        "model_path": cfg.model.path, "adapter": cfg.model.adapter, "dtype": cfg.model.dtype,
        "finetune": cfg.model.finetune, "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "train_compile": cfg.train.compile, "rollout_precision": cfg.rollout.precision,
        "lora_rank": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
        "lora_targets": len(cfg.lora.target_modules),
        "height": cfg.sampling.height, "width": cfg.sampling.width, "num_steps": cfg.sampling.num_steps,
        "guidance_scale": cfg.sampling.guidance_scale, "sde_window_size": cfg.sampling.sde_window_size,
        "prompts_per_step": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
        "max_num_seqs": cfg.rollout.max_num_seqs,
        "max_num_batched_tokens": cfg.rollout.max_num_batched_tokens,
        "fused_cfg": cfg.rollout.fused_cfg, "compile": cfg.rollout.compile,
        "family": dataclasses.asdict(cfg.family),
        "micro_batch_size": cfg.optim.micro_batch_size, "mini_batches": cfg.optim.mini_batches,
        "kl_beta": cfg.algo.kl_beta, "old_logprob": cfg.algo.old_logprob, "sleep": cfg.memory.sleep,
        "fsdp": cfg.distributed.fsdp, "param_dtype": cfg.distributed.param_dtype,
        "reward_weights": cfg.reward.weights,
    }  # fmt: skip


def run_worker(cmd: list[str], env: dict, budget_s: float) -> tuple[int, bool]:
    """Run `cmd` in its own process group; past `budget_s` (0: no limit) the whole group is stopped.
    Returns (exit status, whether the budget stopped it)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=budget_s or None), False
    except subprocess.TimeoutExpired:
        print(
            f"phase_memory: out of --budget-s: run stopped after {budget_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        timed_out = True
    except KeyboardInterrupt:
        timed_out = False
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to its workers
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(), timed_out


def main(argv: list[str]) -> int:
    from benchmarks.measure import add_qwen_bpe

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--recipe", required=True, help=f"one of {', '.join(RECIPES)}")
    p.add_argument("--out", required=True, help="folder for NAME.json and NAME.md")
    p.add_argument("--steps", type=int, default=3, help="RL steps (3: the third shows the steady state)")
    p.add_argument("--gpus", type=int, default=1, help="ranks (one per GPU), run by torchrun --standalone")
    p.add_argument("--tiny", action="store_true", help="the tiny recipe on CPU: a rehearsal")
    p.add_argument(
        "--budget-s", type=float, default=0, help="end within this many seconds, the run stopped if need be"
    )
    p.add_argument("--noise-weight", type=float, default=1e-3, help="weight of the uniform_noise reward")
    p.add_argument(
        "--reward",
        nargs="+",
        metavar="NAME=WEIGHT",
        help="rewards in place of the recipe's (e.g. jpeg_compressibility=1: a CPU reward, so the step's "
        "reward wait is not the OCR engine's)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    add_qwen_bpe(p)  # the Qwen-Image recipes' random-init checkpoint
    p.add_argument(
        "--cap-gib",
        type=float,
        default=0,
        help="cap each rank's device memory at this many GiB (torch.cuda.set_per_process_memory_fraction; "
        "e.g. 74.5 for an 80 GB GPU on a larger one; 0 = the whole device; no effect on CPU)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="no run: build the models on the meta device and print rank 0's packed rollout batches",
    )
    a, overrides = p.parse_known_args(argv)
    from omnirl.errors import ConfigError

    name = recipe_name(a.recipe)
    spec = RECIPES[name]
    start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = name + ("_tiny" if a.tiny else "")
    work = Path(tempfile.mkdtemp(prefix=f"phase_memory_{tag}_"))
    try:
        return drive(a, name, spec, tag, overrides, out, work, start)
    except ConfigError as e:  # a bad override or recipe value, found before anything runs
        print("error: " + " ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return 2
    finally:
        if a.keep:
            print(f"phase_memory: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def drive(
    a, name: str, spec: Recipe, tag: str, overrides: list[str], out: Path, work: Path, start: float
) -> int:
    import yaml

    from omnirl.recipe import resolve_recipe
    from scripts.train import parse  # load_config, a bad override made a one-line ConfigError

    source = resolve_recipe(spec.tiny if a.tiny else name)
    recipe = yaml.safe_load(source.read_text())
    # The user's overrides decide max_num_seqs (hence the prompt counts below) and the model path. Without
    # one, the checkpoint is written below: the recipe's own path (tiny_models/..., a hub id) is never read,
    # so the check sees an existing folder in its place, whatever the working tree holds.
    given = override_given(overrides, "model.path")
    cfg = parse(str(source), overrides if given else [*overrides, "--model.path", str(work)])
    ckpt = cfg.model.path if given else None
    t0 = time.perf_counter()
    if ckpt is None:
        ckpt = str(work / "ckpt")
        if a.tiny:
            from omnirl.testing import TINY_MODELS

            TINY_MODELS[spec.family](Path(ckpt))
        else:
            from omnirl.models import write_random_checkpoint

            write_random_checkpoint(spec.model, Path(ckpt), a.qwen_bpe)
    ckpt_s = time.perf_counter() - t0
    prompts = PROMPTS_PER_RANK * a.gpus
    make_data(spec.data, work / "data", a.tiny, rows=max(16, prompts * a.steps))
    paths = recipe["reward"].get("paths", {})
    if a.reward:  # the recipe's rewards replaced: their checkpoint paths go with them
        recipe["reward"]["weights"] = {n: float(w) for n, w in (x.split("=", 1) for x in a.reward)}
        paths = {n: v for n, v in paths.items() if n in recipe["reward"]["weights"]}
        recipe["reward"]["paths"] = paths
    weights, dropped = reward_weights(recipe["reward"]["weights"], a.noise_weight, paths)
    if dropped:
        print(f"phase_memory: reward {dropped} left out: its packages or weights are missing (device memory "
              f"does not depend on it; uniform_noise gives the groups spread)", flush=True)  # fmt: skip
        recipe["reward"]["paths"] = {n: v for n, v in paths.items() if n not in dropped}
    recipe["model"].update(path=ckpt, weights="random")  # every model built from its config
    recipe["data"].update(train_path=str(work / "data/train.jsonl"), val_path=str(work / "data/val.jsonl"))
    recipe["run"].update(steps=a.steps, output_dir=str(work / "run"))
    recipe["rollout"].update(
        prompts_per_step=prompts, group_size=max(1, cfg.rollout.max_num_seqs // PROMPTS_PER_RANK)
    )
    recipe["reward"]["weights"] = weights
    recipe["validation"] = {**recipe.get("validation", {}), "every": 0}
    recipe["checkpoint"] = {**recipe.get("checkpoint", {}), "every": 0}
    recipe["export"] = {**recipe.get("export", {}), "lora_at_end": False}
    recipe["log"] = {**recipe.get("log", {}), "tensorboard": False, "image_every": 0}
    derived = work / f"{tag}.yaml"
    derived.write_text(yaml.safe_dump(recipe, sort_keys=False))
    cfg = parse(str(derived), overrides)  # what the worker will run
    from omnirl.rewards import check_reward_paths

    check_reward_paths(cfg.reward.weights, cfg.reward.paths)  # the worker's check, before torchrun starts
    if a.check:
        print(json.dumps(check_plan(cfg, a.gpus), indent=1))
        return 0
    info = work / "info"
    info.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if a.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU, also on a machine with GPUs
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}"]
    cmd = [*torchrun, "-m", "scripts.gpu.phase_memory", "--worker", str(derived), str(info), str(a.cap_gib)]
    cmd += overrides
    r = cfg.rollout
    print(f"phase_memory: {tag}: {a.steps} steps, {r.prompts_per_step} prompts x {r.group_size} "
          f"{sample_word(cfg)} per step on {a.gpus} rank(s), max_num_seqs {cfg.rollout.max_num_seqs}, "
          f"micro-batch {cfg.optim.micro_batch_size}, sleep {cfg.memory.sleep}", flush=True)  # fmt: skip
    run_start = time.perf_counter()
    budget = max(1.0, a.budget_s - (run_start - start) - REPORT_S) if a.budget_s else 0
    rc, timed_out = run_worker(cmd, env, budget)
    run_s = time.perf_counter() - run_start

    from omnirl.metrics import read_metrics

    metrics = work / "run" / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else []
    ranks = sorted(info.glob("rank*.json"))
    device = json.loads(ranks[0].read_text()) if ranks else {}
    loads = device.get("loads", [])
    built = ""
    if loads:
        built = f"models built in {sum(x['s'] for x in loads):.1f} s"
        if loads[-1]["allocated_gib_after"] is not None:
            built += f", {loads[-1]['allocated_gib_after']:.1f} GiB on the device"
    head = header(tag, cfg, device, built)
    try:
        flops = count_flops(cfg, rows, device.get("matmul_tflops"))
    except Exception as e:  # a count that cannot run on the meta device leaves the MFU out, not the run
        print(f"phase_memory: no FLOP count ({type(e).__name__}: {e})", file=sys.stderr)
        flops = None
    split = step_split(rows, flops, cfg.rollout.prompts_per_step * cfg.rollout.group_size / max(a.gpus, 1))
    if split:
        split["samples"] = sample_word(cfg)  # images_per_s counts them
    table = head + "\n\n" + (report(rows, title=f"{tag}, ") if rows else "no step finished\n")
    table += ("\n" + split_table(split, flops)) if split else ""
    problems = []
    if rc:
        problems.append(
            "the run was stopped by --budget-s" if timed_out else f"the run failed (exit status {rc})"
        )
    if len(rows) < a.steps:
        problems.append(f"{len(rows)} of {a.steps} steps logged")
        where = last_phase(device, run_s)
        if where:
            problems.append(f"the run ended {where}")
    for r in rows:
        if r.get("train/updates"):
            continue
        if r.get("train/skipped_nonfinite"):  # forward and backward ran; no optimizer state was made
            problems.append(f"step {r['step']}: every optimizer step skipped (non-finite loss or gradient)")
        else:
            problems.append(f"step {r['step']}: no update ran (no group with reward spread)")
    summary = {
        "recipe": name, "tiny": a.tiny, "source_recipe": str(source.relative_to(ROOT)), "steps": a.steps,
        "world_size": a.gpus, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": ["python", "-m", "scripts.gpu.phase_memory", *sys.argv[1:]],
        "settings": settings(cfg), "reward_left_out": dropped, "device": device,
        "rc": rc, "timed_out": timed_out, "problems": problems, "checkpoint_write_s": ckpt_s,
        "run_s": run_s, "wall_s": time.perf_counter() - start, "per_step": summarise_steps(rows),
        "step_split": split, "flops": flops,
        "table": table, "metrics": rows,
    }  # fmt: skip
    (out / f"{tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{tag}.md").write_text(table)
    if loads:
        print(built + ": " + ", ".join(f"{x['subfolder']} {x['s']:.1f} s" for x in loads), flush=True)
    print("\n" + table)
    for problem in problems:
        print(f"phase_memory: {tag}: {problem}", file=sys.stderr)
    print(f"phase_memory: wrote {out / (tag + '.json')} and .md ({time.perf_counter() - start:.0f} s)")
    return rc or (1 if problems else 0)


def sample_word(cfg) -> str:
    """What a rollout sample of the recipe's model is called: "videos" for a video family, else "images"."""
    from omnirl.models import get_adapter

    return "videos" if "video" in get_adapter(cfg.model.adapter).modalities else "images"


def header(tag: str, cfg, device: dict, built: str) -> str:
    """One line: the run's device, versions and the settings that decide its peaks."""
    versions = ", ".join(f"{k} {v}" for k, v in device.get("versions", {}).items())
    r, o = cfg.rollout, cfg.optim
    lora = f"LoRA r{cfg.lora.rank}" if cfg.model.finetune == "lora" else "full fine-tune"
    cap = f" capped at {device['cap_gib']:g} GiB" if device.get("cap_gib") else ""
    d = cfg.distributed
    return (
        f"{tag} on {device.get('device', '?')}{cap} ({versions}): "
        f"{cfg.sampling.height}x{cfg.sampling.width}, "
        f"{r.prompts_per_step} prompts x {r.group_size} {sample_word(cfg)} per step, "
        f"max_num_seqs {r.max_num_seqs}, "
        f"CFG {'fused' if r.fused_cfg else 'as two forwards'}, {'compiled' if r.compile else 'eager'}, "
        f"micro-batch {o.micro_batch_size}, {lora}, gradient checkpointing "
        f"{ckpt_word(cfg.model.gradient_checkpointing)}, sleep {ckpt_word(cfg.memory.sleep)}, "
        f"update {'compiled' if cfg.train.compile else 'eager'}, rollout {cfg.rollout.precision}"
        f", frozen base {d.frozen_base} (rollout gathers per {d.rollout_gather})"
        + (f"; {built}" if built else "")
    )


def ckpt_word(value) -> str:
    return "auto" if value == "auto" else "on" if value else "off"


def check_plan(cfg, world: int) -> dict:
    """What a run of `cfg` would build and pack, without running it: every model built on the meta device
    (parameter counts), and rank 0's requests of each step packed as its rollout packs them (batch sizes,
    the compatibility key's last fields: e.g. the text buckets), with the update's micro-batch count."""
    import torch
    from torch import nn

    from omnirl import distributed as D
    from omnirl.batching import make_requests
    from omnirl.config import RolloutConfig
    from omnirl.data import LOADERS
    from omnirl.models import build_adapter
    from omnirl.ops.diffusion import sampling_params
    from omnirl.rollout.diffusion import DiffusionEngine

    meta = torch.device("meta")
    adapter = build_adapter(cfg, meta)  # model.weights random: built from the configs, on meta
    params = {}
    for name, module in vars(adapter).items():
        if isinstance(module, nn.Module):
            lora = sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)
            params[name] = {"params_b": sum(p.numel() for p in module.parameters()) / 1e9 - lora / 1e9}
            if lora:
                params[name]["lora_params_m"] = lora / 1e6
    r = cfg.rollout
    engine = DiffusionEngine(
        adapter, RolloutConfig(max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens)
    )
    rows = LOADERS[cfg.data.format](cfg.data.train_path, None)
    dist = D.DistInfo(0, world, 0, meta, None)
    sp = sampling_params(cfg)
    trained = cfg.sampling.sde_window_size or cfg.sampling.num_steps - 1  # trained steps per image
    steps = []
    for step in range(cfg.run.steps):
        requests = make_requests(cfg, rows, step, dist, sp, cfg.sampling.negative_prompt)[0]
        batches = engine.packer.pack(requests, fill=r.compile)
        steps.append({
            "requests": len(requests),
            "batches": [
                {"requests": len(b), "tokens_per_request": engine.tokens(requests[b[-1]]),  # the longest's
                 "key_tail": repr(adapter.compat_key(requests[b[0]])[len(sp.key):])}
                for b in batches
            ],
            "train_rows": len(requests) * trained,
            "micro_batches": -(-len(requests) * trained // cfg.optim.micro_batch_size),
        })  # fmt: skip
    return {"models": params, "steps": steps}


# ---------------------------------------------------------------------------------------------- worker


def trace_phases(record: dict, path: Path) -> None:
    """Each trainer phase's start and end (seconds since this call) into `record["phases"]`, written to
    `path` as it enters and leaves: a run stopped mid-step (out of --budget-s) still says which phase of
    which step it was in, and since when."""
    import contextlib

    from omnirl import memory

    inner, t0, record["phases"] = memory.phase, time.perf_counter(), []

    @contextlib.contextmanager
    def traced(name, *args, **kwargs):
        entry = {"phase": name, "start_s": round(time.perf_counter() - t0, 2), "end_s": None}
        record["phases"].append(entry)
        path.write_text(json.dumps(record, indent=1) + "\n")
        with inner(name, *args, **kwargs):
            yield
        entry["end_s"] = round(time.perf_counter() - t0, 2)
        path.write_text(json.dumps(record, indent=1) + "\n")

    memory.phase = traced  # what `memory.Phases` opens each phase with


def last_phase(device: dict, run_s: float) -> str | None:
    """Where a run that logged fewer steps than asked was when it ended: its last phase (the count of its
    name so far gives the step), when it started and whether it ended; None before the first phase.
    Phase times count from the trainer's start (models loading included), after torchrun's launch."""
    phases = device.get("phases") or []
    if not phases:
        return None
    last = phases[-1]
    n = sum(p["phase"] == last["phase"] for p in phases)
    state = "ended" if last["end_s"] is not None else f"still running at the end ({run_s:.0f} s into the run)"
    started = f"started {last['start_s']:.0f} s after the trainer did"
    return f"in {last['phase']} phase number {n}, {started}, {state}"


def worker(recipe: str, info: str, cap_gib: float, overrides: list[str]) -> None:
    """One rank: its device memory capped at `cap_gib` GiB (0: not capped), each random-init build of the
    recipe's models (model.weights random) recorded, then scripts/train.py's `main`."""
    import importlib

    import torch

    from omnirl.distributed import local_device
    from omnirl.memory import cap_device_memory
    from omnirl.models.random_init import BUILD_HOOKS
    from scripts import train

    rank, device = int(os.environ.get("RANK", 0)), local_device()
    cuda = device.type == "cuda"
    if cap_gib:
        cap_device_memory(cap_gib, device)  # before anything is allocated: the peaks count from it
    record = {
        "rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "device_gib": torch.cuda.get_device_properties(device).total_memory / GIB if cuda else None,
        "cap_gib": cap_gib or None,
        "versions": {m: importlib.import_module(m).__version__ for m in VERSIONS},
        "loads": [],
    }  # fmt: skip
    path = Path(info) / f"rank{rank}.json"

    def recorded(cls, subfolder, model, seconds):
        record["loads"].append({
            "subfolder": subfolder, "class": cls.__name__, "s": seconds,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
            "allocated_gib_after": torch.cuda.memory_allocated(device) / GIB if cuda else None,
        })  # fmt: skip
        path.write_text(json.dumps(record, indent=1) + "\n")

    if cuda:  # the bf16 matmul ceiling the MFU is taken against, measured here before the run
        from benchmarks.measure import matmul_tflops

        record["matmul_tflops"] = matmul_tflops(device)
        torch.cuda.empty_cache()
    path.write_text(json.dumps(record, indent=1) + "\n")
    trace_phases(record, path)
    BUILD_HOOKS.append(recorded)
    train.exit_now(train.main(["--recipe", recipe, *overrides]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5:])
    sys.exit(main(sys.argv[1:]))
