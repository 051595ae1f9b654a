"""How far a run resumed on another number of ranks drifts from the run that never stopped.

    python benchmarks/resume_drift.py --model-path tiny_models/sd3 --out results/resume_drift.json

For each --mini-batches value: the tiny SD3 recipe runs --steps steps on --ranks ranks (checkpoint every
--resume-at steps), then the same command resumes its step --resume-at checkpoint on --resume-ranks ranks
and runs to the end. Both draw the same samples and update on the same mini-batches (request seeds and the
update's shuffle come from the global index, never the rank); what differs is the order of the gradient
sums, whose rounding Adam and the RL loop then amplify. Prints one row per setting (the first step whose
mean reward differs, the largest reward difference per stretch of steps, the final LoRA's largest
difference) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
LORA = "lora/pytorch_lora_weights.safetensors"


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}); see {log}")


def launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", required=True, help="the tiny SD3 (scripts/make_tiny_models.py)")
    p.add_argument("--work", type=Path, default=Path("/tmp/omnirl_resume_drift"), help="run directories")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--resume-at", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--resume-ranks", type=int, default=1)
    p.add_argument("--mini-batches", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    rows = []
    for mb in a.mini_batches:
        work = a.work / f"mb{mb}"
        common = [
            "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo", "--model.path", a.model_path,
            "--run.steps", str(a.steps), "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
            "--sampling.num_steps", "4", "--optim.mini_batches", str(mb), "--optim.micro_batch_size", "8",
            "--checkpoint.every", str(a.resume_at), "--checkpoint.keep", str(a.steps),
            "--log.image_every", "0", "--log.no-tensorboard",
        ]  # fmt: skip
        ref, resumed = work / "reference", work / "resumed"
        work.mkdir(parents=True, exist_ok=True)
        checkpoint = ref / f"checkpoints/step_{a.resume_at:06d}"
        run([*launcher(a.ranks), *common, "--run.output_dir", str(ref)], work / "reference.log")
        resume = ["--run.output_dir", str(resumed), "--checkpoint.resume", str(checkpoint)]
        run([*launcher(a.resume_ranks), *common, *resume], work / "resumed.log")
        r0, r1 = metrics(ref / "metrics.jsonl"), metrics(resumed / "metrics.jsonl")
        diff = [abs(x["reward/mean"] - y["reward/mean"]) for x, y in zip(r0, r1)]
        w0, w1 = load_file(ref / LORA), load_file(resumed / LORA)
        stretches = [(a.resume_at, 10), (10, 20), (20, a.steps)]
        rows.append(
            {
                "mini_batches": mb,
                "first_differing_step": next((s for s, d in enumerate(diff) if d > 0), None),
                "reward_diff_max": {f"{lo}-{hi - 1}": max(diff[lo:hi], default=0.0) for lo, hi in stretches},
                "lora_diff_max": max((w0[k] - w1[k]).abs().max().item() for k in w0),
                "lora_abs_max": max(v.abs().max().item() for v in w0.values()),
                "reward_first5_last5": [sum(r["reward/mean"] for r in rs) / 5 for rs in (r0[:5], r0[-5:])],
            }
        )
        print(json.dumps(rows[-1]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {k: v for k, v in vars(a).items() if k not in ("work", "out")}
    a.out.write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
