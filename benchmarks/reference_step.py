"""One Flow-GRPO RL step of the reference implementation, timed: yifan123/flow_grpo's
`scripts/train_sd3.py` (diffusers + accelerate, fp32 transformer and LoRA masters under accelerate's bf16
autocast, no gradient checkpointing), run unmodified from a checkout of it, so that its step can be put
beside omnirl's (`scripts/gpu/step_time.sh`, job `sd35_compiled`) on the same GPU.

    python -m benchmarks.reference_step --ref-dir CHECKOUT --model CKPT_DIR --epochs 4 --out OUT.json
    python -m benchmarks.reference_step --ref-dir CHECKOUT --tiny --out OUT.json   # CPU rehearsal

What a user runs on one GPU is the reference's own launch line, `accelerate launch --config_file
scripts/accelerate_configs/multi_gpu.yaml --num_processes=1 scripts/train_sd3.py --config
config/grpo.py:general_ocr_sd3_1gpu`. This runner does the same in-process: it sets the environment that
launcher gives its one process (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_*, and ACCELERATE_USE_CPU on a CPU),
imports the script as a module, lets absl parse `--config=<ref>/config/grpo.py:general_ocr_sd3_1gpu`
(ml_collections' config flag reads the reference's config files), overrides the fields below on the parsed
config and calls the script's `main`. Nothing of the reference is copied here or edited there.

The settings (the reference comparison's), each as the reference's config field that carries it
(`OVERRIDES`):

- 512 px: `resolution` 512.
- 10 sampling steps: `sample.num_steps` 10.
- CFG 4.5, both halves trained: `sample.guidance_scale` 4.5, `train.cfg` True (its `compute_log_prob` runs
  the unconditional and conditional rows as one batch and detaches the unconditional prediction).
- 4 prompts x 8 images: `sample.train_batch_size` 8, `sample.num_image_per_prompt` 8,
  `sample.num_batches_per_epoch` 4 (its sampler gives each sampling batch one prompt's 8 images).
- 9 trained timesteps: `train.timestep_fraction` 0.99; it trains `int(num_steps * 0.99)` = 9 of 10.
- micro-batches of 8 rows: `train.batch_size` 8 (it rebatches the epoch's samples into
  `num_batches_per_epoch` batches, 32 / 4 = 8 rows: 16 transformer rows with CFG).
- 2 optimizer steps: `train.gradient_accumulation_steps` 2 (its Accelerator accumulates 2 x 9 backward
  calls, of 4 x 9 per epoch).
- LoRA r32 / alpha 64: fixed in train_sd3.py (gaussian init, on attn.to_q / to_k / to_v / to_out.0 and
  attn.add_q_proj / add_k_proj / add_v_proj / to_add_out).
- kl beta 0.04: `train.beta` 0.04 (it then runs a no-grad forward with the adapter disabled per trained
  timestep).
- T5 at 128 tokens: not configurable; train_sd3.py always encodes with `max_sequence_length=128`.
- bf16 autocast: `mixed_precision` "bf16" (accelerate wraps the prepared transformer's forward in it; the
  transformer stays float32, the text encoders are cast to bf16, the VAE stays float32, as its code does).
- the JPEG compressibility reward: `reward_fn` {"jpeg_compressibility": 1.0}.
- prompts: `prompt_fn` "general_ocr" (its plain-text loader), `dataset` a folder written here.
- no eval, no saving: `eval_freq` `NEVER` (below), `save_freq` past the run.
- no wandb: imported unconditionally; a stub module (`stub_wandb`).

The rest is the recipe's: `train.ema` True, `sample.noise_level` 0.7, `sample.global_std` True, per-prompt
stat tracking, AdamW lr 3e-4, clip range 1e-4, adv clip 5. The prompts are OCR prompts of
`scripts/make_ocr_prompts.py`'s vocabulary; their content does not change the work (CLIP is padded to 77
tokens and T5 to 128). `--tiny`: omnirl's tiny random-init SD3 on the CPU at 64 px, 3 sampling steps (2
trained), 2 prompts x 2 images, micro-batches of 2 rows, 2 optimizer steps: a rehearsal of the plumbing, with
accelerate's bf16 autocast on the CPU and the DDP wrapper over gloo (`accelerate launch --cpu`'s MULTI_CPU).

Eval: the script evaluates whenever `epoch % config.eval_freq == 0`, so at epoch 0 for any int. `NEVER`, an
int whose reflected modulo is never 0, keeps it from running without an edit; `Eval:` would be timed apart.

Runner-side shims, each for a library newer than the reference's pins (it pins accelerate 1.4.0, diffusers
0.33.1, transformers 4.40, peft 0.10):
- accelerate: the script calls `transformer.module.disable_adapter()` (the KL reference pass), which needs
  the DDP wrapper that accelerate <= 1.4 puts on a one-process MULTI_GPU run; later releases leave a
  one-process model unwrapped, and `.module` is then an AttributeError. The fix is not code: accelerate
  1.4.0, the reference's pin, travels as a wheel (`benchmarks/reference_bundle.sh`) ahead of the host's.
- `imp`: config/grpo.py calls `imp.load_source`, a module Python 3.12 removed; `IMP_SHIM` stands in for it.
- wandb: imported and called unconditionally; a stub module whose calls do nothing.
- a config-only checkpoint (`omnirl.models.write_random_checkpoint`, no weight files) cannot go through
  `StableDiffusion3Pipeline.from_pretrained`; the script's name for that class is pointed at
  `ConfigOnlyPipeline`, which builds the same pipeline from the configs with random weights (as omnirl's
  `--random-init` does) on the device, in float32 as `from_pretrained` leaves it; the script then moves and
  casts the models as its own code does. A checkpoint with weights loads through the real class.
diffusers 0.42.1, transformers 5.x and peft 0.21.2 need nothing more (the CPU rehearsal runs through).

Timing reads the script's own progress bars: its module-level `tqdm` is wrapped, and the bars it opens
(`Epoch N: sampling`, `Waiting for rewards`, `Epoch N.0: training`, `Eval:`) mark the phases, after a
device synchronize: sampling (generation, the rewards' wait and the advantages, up to the training bar),
training (every micro-batch's forward, KL reference forward, backward and optimizer step, EMA), the epoch
(both). Epoch 0 carries the warm-up; the steady state is the median of epochs 1..N-1 with its range. The
run stops when the bar of epoch N opens, or earlier when `--budget-s` would be passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

from scripts.make_ocr_prompts import SCENES, make_text

CONFIG = "config/grpo.py:general_ocr_sd3_1gpu"  # the reference's one-GPU recipe, overridden below


class Never(int):
    """An int for `eval_freq`: `epoch % NEVER` is 1, so `epoch % eval_freq == 0` never holds (epoch 0
    included), where any plain int would run the evaluation at epoch 0."""

    def __rmod__(self, other):
        return 1


NEVER = Never(1 << 30)

# The reference comparison's settings as the reference's config fields (the module docstring's table).
OVERRIDES: dict[str, Any] = {
    "resolution": 512,
    "sample.num_steps": 10,
    "sample.guidance_scale": 4.5,
    "train.cfg": True,
    "sample.train_batch_size": 8,
    "sample.num_image_per_prompt": 8,
    "sample.num_batches_per_epoch": 4,
    "train.timestep_fraction": 0.99,
    "train.batch_size": 8,
    "train.gradient_accumulation_steps": 2,
    "train.beta": 0.04,
    "mixed_precision": "bf16",
    "reward_fn": {"jpeg_compressibility": 1.0},
    "prompt_fn": "general_ocr",
    "eval_freq": NEVER,
    "save_freq": 1 << 30,
}
TINY_OVERRIDES: dict[str, Any] = OVERRIDES | {
    "resolution": 64,
    "sample.num_steps": 3,
    "sample.train_batch_size": 2,
    "sample.num_image_per_prompt": 2,
    "sample.num_batches_per_epoch": 2,
    "train.batch_size": 2,
    "train.gradient_accumulation_steps": 1,
}


def derived(o: dict[str, Any]) -> dict[str, int]:
    """What the reference makes of the overrides `o` on one process: prompts and images per epoch, trained
    timesteps per image, rows per micro-batch (before the CFG doubling) and optimizer steps per epoch, by
    the arithmetic of its train_sd3.py."""
    images = o["sample.train_batch_size"] * o["sample.num_batches_per_epoch"]
    timesteps = int(o["sample.num_steps"] * o["train.timestep_fraction"])
    micro_batches = o["sample.num_batches_per_epoch"]  # it rebatches into this many batches
    backward_calls = micro_batches * timesteps
    accumulate = o["train.gradient_accumulation_steps"] * timesteps  # its Accelerator's accumulation
    return {
        "prompts_per_epoch": images // o["sample.num_image_per_prompt"],
        "images_per_epoch": images,
        "trained_timesteps": timesteps,
        "rows_per_micro_batch": images // micro_batches,
        "optimizer_steps": backward_calls // accumulate,
    }


def write_prompts(out: Path, train: int = 64, test: int = 16, seed: int = 0) -> Path:
    """train.txt / test.txt of plain OCR prompts (the reference's `general_ocr` loader reads one a line)."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        lines = [rng.choice(SCENES).format(make_text(rng)) for _ in range(n)]
        (out / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return out


def set_field(cfg, dotted: str, value) -> None:
    node = cfg
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    node[last] = value


IMP_SHIM = types.ModuleType("imp")


def _load_source(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


IMP_SHIM.load_source = _load_source  # type: ignore[attr-defined]


def stub_wandb() -> None:
    """A `wandb` whose init / log / Image do nothing (the script imports and calls it unconditionally). It
    has a spec but no distribution metadata: the libraries' availability checks (`find_spec`, then the
    package's metadata) find it and still report wandb as not installed."""
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    for name in ("init", "log", "Image", "finish"):
        setattr(wandb, name, lambda *a, **k: None)
    sys.modules["wandb"] = wandb


def launcher_env(cpu: bool) -> None:
    """The environment `accelerate launch --num_processes=1` (torchrun) gives its one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(port)
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    os.environ.update(env)


class ConfigOnlyPipeline:
    """What the script calls `StableDiffusion3Pipeline`: `from_pretrained` of a checkpoint with weights is
    the real one's; of a config-only checkpoint, the pipeline built from its configs with random weights
    on the device, in float32 (`omnirl.models.random_init.random_init_loader`)."""

    @staticmethod
    def from_pretrained(path: str):
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        if any(Path(path, "transformer").glob("*.safetensors")):
            return StableDiffusion3Pipeline.from_pretrained(path)
        from omnirl.models.random_init import random_init_loader

        load = random_init_loader(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(0)
        parts: dict[str, Any] = {
            "transformer": load(SD3Transformer2DModel, path, subfolder="transformer"),
            "vae": load(AutoencoderKL, path, subfolder="vae"),
            "text_encoder": load(CLIPTextModelWithProjection, path, subfolder="text_encoder"),
            "text_encoder_2": load(CLIPTextModelWithProjection, path, subfolder="text_encoder_2"),
            "text_encoder_3": load(T5EncoderModel, path, subfolder="text_encoder_3"),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"),
        }
        for s in ("", "_2", "_3"):
            parts[f"tokenizer{s}"] = AutoTokenizer.from_pretrained(path, subfolder=f"tokenizer{s}")
        return StableDiffusion3Pipeline(**parts)


class Stop(Exception):
    """Raised from a progress bar to end the script's endless epoch loop."""


class PhaseClock:
    """Times the script's phases off the progress bars it opens (see the module docstring)."""

    def __init__(self, epochs: int, budget_s: float, on_epoch):
        self.epochs, self.budget_s, self.on_epoch = epochs, budget_s, on_epoch
        self.begin = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.eval_s: list[float] = []
        self.stopped_by = ""

    def now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, original):
        def bar(iterable=None, *args, desc: str = "", **kwargs):
            it = original(iterable, *args, desc=desc, **kwargs)
            if m := re.fullmatch(r"Epoch (\d+): sampling", desc):
                self.sampling_opens(int(m[1]))
            elif desc == "Waiting for rewards":
                self.rows[-1]["generation_s"] = self.now() - self.rows[-1]["t0"]
                return self.closing(it, "rewards_done")
            elif re.fullmatch(r"Epoch \d+\.\d+: training", desc):
                self.rows[-1]["t_train"] = self.now()
                return self.closing(it, "trained")
            elif desc.startswith("Eval"):
                return self.closing(it, "eval", self.now())
            return it

        return bar

    def closing(self, it, event: str, t_open: float = 0.0):
        yield from it
        t = self.now()
        if event == "eval":
            self.eval_s.append(t - t_open)
            return
        row = self.rows[-1]
        row[event] = t
        if event == "trained":
            self.epoch_done(row)

    def sampling_opens(self, epoch: int) -> None:
        t = self.now()
        if epoch >= self.epochs:
            raise Stop
        if self.budget_s and self.rows:
            longest = max(r["epoch_s"] for r in self.rows)
            if t - self.begin + longest > self.budget_s:
                self.stopped_by = f"budget {self.budget_s:.0f} s before epoch {epoch}"
                raise Stop
        self.rows.append({"epoch": epoch, "t0": t})

    def epoch_done(self, row: dict) -> None:
        row["reward_wait_s"] = row.pop("rewards_done") - row["t0"] - row["generation_s"]
        row["sampling_s"] = row["t_train"] - row["t0"]
        row["training_s"] = row["trained"] - row["t_train"]
        row["epoch_s"] = row["trained"] - row["t0"]
        for k in ("t0", "t_train", "trained"):
            row.pop(k)
        self.on_epoch()

    def epochs_done(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "epoch_s" in r]


PHASES = ("generation_s", "reward_wait_s", "sampling_s", "training_s", "epoch_s")


def steady(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of each phase over epochs 1..N-1 (epoch 0 carries the warm-up)."""
    later = rows[1:]
    if not later:
        return {}
    return {
        k: {
            "median": statistics.median(r[k] for r in later),
            "min": min(r[k] for r in later),
            "max": max(r[k] for r in later),
        }
        for k in PHASES
    }


def commit_of(ref: Path) -> str | None:
    if (ref / "COMMIT").is_file():
        return (ref / "COMMIT").read_text().strip()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        cmd = ["git", "-C", str(ref), "rev-parse", "HEAD"]
        return subprocess.check_output(cmd, text=True, stderr=subprocess.DEVNULL).strip()
    return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "diffusers", "accelerate", "peft", "transformers", "ml_collections", "absl-py"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--ref-dir", type=Path, required=True, help="a checkout of yifan123/flow_grpo")
    p.add_argument("--model", type=Path, help="SD3.5 checkpoint dir (with weights, or config-only)")
    p.add_argument("--epochs", type=int, default=4, help="RL steps (the reference's epochs) to time")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal on omnirl's tiny random-init SD3")
    p.add_argument("--budget-s", type=float, default=0.0, help="stop before an epoch that would pass it")
    a = p.parse_args()
    ref = a.ref_dir.resolve()
    work = Path(tempfile.mkdtemp(prefix="reference_step_"))
    if a.tiny:
        from omnirl.models import tiny_models

        model = a.model or tiny_models()["sd3"](work / "tiny_sd3")
    elif a.model is None:
        p.error("--model is required without --tiny")
    else:
        model = a.model
    overrides = TINY_OVERRIDES if a.tiny else OVERRIDES
    overrides = overrides | {
        "dataset": str(write_prompts(work / "prompts")),
        "pretrained.model": str(Path(model).resolve()),
        "logdir": str(work / "logs"),
        "save_dir": str(work / "save"),
    }

    # The reference imports: its package and config/ from the checkout, a stand-in for what it imports
    # but this run does not use, and the launcher's environment.
    sys.path.insert(0, str(ref))
    try:
        import imp  # noqa: F401  (Python <= 3.11)
    except ModuleNotFoundError:
        sys.modules["imp"] = IMP_SHIM
    stub_wandb()
    launcher_env(cpu=not torch.cuda.is_available())
    spec = importlib.util.spec_from_file_location("flow_grpo_train_sd3", ref / "scripts" / "train_sd3.py")
    assert spec is not None and spec.loader is not None
    script: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from absl import app

    out: dict[str, Any] = {
        "benchmark": "reference_step",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "command": shlex.join([sys.executable, "-m", "benchmarks.reference_step", *sys.argv[1:]]),
        "reference": {"repo": "yifan123/flow_grpo", "commit": commit_of(ref), "config": CONFIG},
        "settings": {k: (int(v) if isinstance(v, Never) else v) for k, v in overrides.items()}
        | {"eval_freq": "never"},
        "derived": derived(overrides),
    }

    def write() -> None:
        rows = clock.epochs_done()
        out.update(epochs=rows, eval_s=clock.eval_s, steady=steady(rows), stopped_by=clock.stopped_by)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))

    clock = PhaseClock(a.epochs, a.budget_s, write)
    script.tqdm = clock.wrap(script.tqdm)
    script.StableDiffusion3Pipeline = ConfigOnlyPipeline

    def run(argv):
        cfg = script.FLAGS.config
        for k, v in overrides.items():
            set_field(cfg, k, v)
        out["config"] = json.loads(cfg.to_json_best_effort())
        with contextlib.suppress(Stop):
            script.main(argv)

    with contextlib.suppress(SystemExit):
        app.run(run, argv=["train_sd3.py", f"--config={ref / CONFIG}"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    write()
    rows = out["epochs"]
    print(f"\nreference_step ({out['hardware']}, flow_grpo {str(out['reference']['commit'])[:10]})")
    print(f"{'epoch':>6} " + " ".join(f"{k[:-2]:>12}" for k in PHASES))
    for r in rows:
        print(f"{r['epoch']:>6} " + " ".join(f"{r[k]:>12.2f}" for k in PHASES))
    for k, s in out["steady"].items():
        print(f"steady {k[:-2]:>12}: median {s['median']:.2f} s (range {s['min']:.2f}-{s['max']:.2f})")
    if clock.eval_s:
        print(f"eval: {clock.eval_s}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
