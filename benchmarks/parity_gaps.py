"""The parity gate's gaps, measured: the trainer's log-prob of the rollout's recorded steps (tokens) against
the rollout's own at the first update of each tiny recipe, per precision, every place the gate checks
(per stream and timestep index; per span of response positions), the worst of each run beside the
tolerance the gate applies (health.parity_tolerance).

    python -m benchmarks.parity_gaps --models tiny_models --precisions fp32 bf16 \
        --out benchmarks/results/parity_gaps_cpu_DATE.json
    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks.parity_gaps --precisions fp32 vllm --recipes mmk12_tiny \
        --model mmk12_tiny=PATH --out benchmarks/results/parity_gaps_vllm_cpu_DATE.json
    python -m benchmarks.parity_gaps --precisions bf16 fp8 fp8_train --models tiny_models \
        --recipes sd3_tiny_flowgrpo qwen_image_tiny_flowgrpo wan22_ti2v_tiny_dancegrpo \
        --out benchmarks/results/parity_gaps_fp8_GPU_DATE.json      (a GPU: FP8 GEMMs need one)

Each run is `scripts/train.py --recipe R` for one step in this process (the recipe's groups, no
checkpoint, no images) with health.parity off, so that a gap past the tolerance is measured instead of
stopping the run. Precisions: fp32 the recipe as it is (float32); bf16 model.dtype and
distributed.param_dtype bfloat16; fp8 bf16 with rollout.precision fp8 on every step (the diffusion
families with an FP8 rollout) and the bf16 trainer recomputing the old log-probs (algo.old_logprob
recompute: the gap the rollout correction weighs); fp8_train that with the update's GEMMs in FP8 too
(train.precision fp8: rollout and trainer one function, the rollout's log-probs kept); vllm
rollout.backend vllm (omni; the model needs heads of 32 for vLLM's CPU attention: tiny_k12's head_dim=32
build). A run that fails records its `error:` line. `--dry-run`
prints each run's command line and runs nothing. `--page` renders the JSON's table (the page and
docs/health.md quote it; tests/test_results.py holds them to it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BF16 = ["--model.dtype", "bfloat16", "--distributed.param_dtype", "bfloat16"]
FP8_ROLLOUT = ["--rollout.precision", "fp8", "--rollout.fp8.steps", "all"]
PRECISIONS = {
    "fp32": [],
    "bf16": BF16,
    "fp8": [
        *BF16,
        *FP8_ROLLOUT,
        "--algo.old_logprob",
        "recompute",
    ],
    "fp8_train": [*BF16, *FP8_ROLLOUT, "--train.precision", "fp8"],
    "vllm": ["--rollout.backend", "vllm", "--rollout.vllm.max_model_len", "512"],
}
SMALL = [
    "--run.steps", "1", "--checkpoint.every", "0", "--log.image_every", "0", "--log.no-tensorboard",
    "--validation.every", "0",
    "--health.no-parity", "--health.guard_every", "0",
]  # fmt: skip


def tiny_recipes() -> list[str]:
    return sorted(p.stem for p in (ROOT / "yaml").glob("*_tiny*.yaml"))


def argv(recipe: str, precision: str, model: str | None, out: Path) -> list[str]:
    """scripts/train.py's arguments of one run."""
    path = ["--model.path", model] if model else []
    return ["--recipe", recipe, *path, "--run.output_dir", str(out), *SMALL, *PRECISIONS[precision]]


def train_main():
    spec = importlib.util.spec_from_file_location("omnirl_train_script", ROOT / "scripts/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def measure(recipe: str, precision: str, model: str | None, work: Path) -> dict:
    """One run: its status, its gaps per place, the worst of them and the gate's tolerance."""
    from omnirl.health import parity as P
    from omnirl.metrics import read_metrics
    from omnirl.recipe import load_config

    out = work / f"{recipe}_{precision}"
    args = argv(recipe, precision, model, out)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train_main()(args)
    row = {"recipe": recipe, "precision": precision, "status": status}
    if status != 0 or not (out / "metrics.jsonl").exists():
        errors = [x for x in err.getvalue().splitlines() if x.startswith("error: ")]
        return {**row, "error": errors[-1] if errors else err.getvalue()[-500:]}
    cfg = load_config(recipe, args[2:])
    metrics = read_metrics(out / "metrics.jsonl")[0]
    gaps = P.gaps(metrics)
    row["adapter"] = cfg.model.adapter
    row["gate_precision"] = P.precision(cfg)
    row["tolerance"] = cfg.health.parity_tolerance[P.precision(cfg)]
    row["gaps"] = gaps
    row["logprob_abs_diff_max"] = metrics.get("consistency/logprob_abs_diff_max")
    if gaps:
        row["worst"], row["worst_gap"] = max(gaps.items(), key=lambda kv: kv[1])
    return row


def table(result: dict) -> str:
    """The markdown table of a result: one row per recipe, the worst mean gap of each precision measured."""
    precisions = list(dict.fromkeys(r["precision"] for r in result["runs"]))
    lines = [
        "| recipe | family | " + " | ".join(f"{p} worst gap (where)" for p in precisions) + " |",
        "|---|---|" + "---|" * len(precisions),
    ]
    for recipe in dict.fromkeys(r["recipe"] for r in result["runs"]):
        runs = {r["precision"]: r for r in result["runs"] if r["recipe"] == recipe}
        family = next((r["adapter"] for r in runs.values() if "adapter" in r), "")
        cells = []
        for p in precisions:
            r = runs.get(p)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("failed: " + r["error"].removeprefix("error: ")[:80].replace("|", "/"))
            elif "worst" not in r:
                cells.append("nothing measured (no log-probs)")
            else:
                cells.append(f"{r['worst_gap']:.2e} ({r['worst']}; tolerance {r['tolerance']:g})")
        lines.append(f"| `{recipe}` | {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=None, help="default: every yaml/*_tiny*.yaml")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISIONS))
    p.add_argument("--models", default=None, help="a folder of tiny models: the recipe's own model.path")
    p.add_argument("--model", action="append", default=[], help="RECIPE=PATH: that recipe's model.path")
    p.add_argument("--out", type=Path, help="the JSON to write")
    p.add_argument("--dry-run", action="store_true", help="print each run's command line, run nothing")
    p.add_argument("--page", type=Path, help="print the table of this JSON and exit")
    a = p.parse_args(args)
    if a.page is not None:
        print(table(json.loads(a.page.read_text())))
        return 0
    models = dict(m.split("=", 1) for m in a.model)
    recipes = a.recipes or tiny_recipes()
    if unknown := [r for r in recipes if not (ROOT / "yaml" / f"{r}.yaml").exists()]:
        print(f"error: --recipes: no yaml/{unknown[0]}.yaml", file=sys.stderr)
        return 2
    if not a.dry_run and a.out is None:
        print("error: --out is required (the JSON to write)", file=sys.stderr)
        return 2
    runs: list[dict] = []
    result = header(args)
    with tempfile.TemporaryDirectory() as work:
        for recipe in recipes:
            model = models.get(recipe)
            if model is None and a.models is not None:
                import yaml

                own = yaml.safe_load((ROOT / "yaml" / f"{recipe}.yaml").read_text())["model"]["path"]
                model = str(Path(a.models) / Path(own).name)
            for precision in a.precisions:
                if a.dry_run:
                    cmd = argv(recipe, precision, model, Path(work) / f"{recipe}_{precision}")
                    print("python scripts/train.py " + " ".join(cmd))
                    continue
                row = measure(recipe, precision, model, Path(work))
                print(json.dumps({k: v for k, v in row.items() if k != "gaps"}), flush=True)
                runs.append(row)
                a.out.parent.mkdir(parents=True, exist_ok=True)  # after every run: a record of what ran
                a.out.write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")
    if not a.dry_run:
        print(table({**result, "runs": runs}))
    return 0


def header(args: list[str] | None) -> dict:
    """Where and how the runs ran: date, commit, command, versions, device."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit.strip(),
        "command": "python -m benchmarks.parity_gaps " + " ".join(sys.argv[1:] if args is None else args),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


if __name__ == "__main__":
    sys.exit(main())
