"""The quickstart recipe under `health.on_alert warn` and `adapt`, side by side: reward, in-group diversity
(relative to the first steps') and the KL weight per step, the alerts, and the guard set's sample grids.

    python -m benchmarks.health_quickstart --model-path tiny_models/sd3 --steps 120 \
        --runs /tmp/health --out benchmarks/results/health_quickstart_cpu_DATE.json

runs `scripts/train.py --recipe sd3_tiny_flowgrpo` twice, one after the other, on one process (the same
samples as the recipe's two ranks), with the guard set below every 10 steps; `--collect` skips the runs and
reads the two output directories under `--runs`. Writes the JSON (every step's values, the alerts), one
SVG chart per metric with both runs, and the guard grids of both runs' last guard step, beside the JSON
(`<out stem>/`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

GUARD_PROMPTS = [
    "a red apple on a table",
    "a blue car in the street",
    "a cat sleeping",
    "a mountain lake at dawn",
]
MODES = ("warn", "adapt")
CURVES = {
    "reward/mean": "mean JPEG-compressibility reward",
    "health/diversity_ratio": "in-group diversity / first 3 steps'",
    "health/kl_beta": "KL weight (algo.kl_beta)",
    "health/guard_reward": "guard reward (fixed prompts and seeds)",
}
COLOURS = {"warn": "#d62728", "adapt": "#1f77b4"}


def run(model_path: str, steps: int, out: Path, mode: str) -> None:
    cmd = [
        sys.executable, "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo",
        "--model.path", model_path, "--run.steps", str(steps), "--run.output_dir", str(out),
        "--checkpoint.every", "0", "--log.image_every", "10", "--health.on_alert", mode,
        "--health.guard_every", "10", "--health.guard_prompts", *GUARD_PROMPTS,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def collect(runs: Path) -> dict:
    """Every step's curves and the alerts of the runs under `runs` (one directory per mode)."""
    result: dict = {"guard_prompts": GUARD_PROMPTS, "runs": {}}
    for mode in MODES:
        rows = [json.loads(line) for line in open(runs / mode / "metrics.jsonl")]
        alerts_file = runs / mode / "health_alerts.jsonl"
        alerts = [json.loads(x) for x in open(alerts_file)] if alerts_file.exists() else []
        curves = {k: [[r["step"], r[k]] for r in rows if k in r] for k in CURVES}
        result["runs"][mode] = {"steps": len(rows), "curves": curves, "alerts": alerts}
    return result


def svg(metric: str, result: dict) -> str:
    """One line chart of `metric` for both runs (x: step)."""
    w, h, pad = 480, 240, 40
    series = {m: result["runs"][m]["curves"][metric] for m in MODES}
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    x_max = max(p[0] for p in points) or 1
    lo, hi = min(p[1] for p in points), max(p[1] for p in points)
    hi = hi if hi > lo else lo + 1

    def xy(p):
        return pad + (w - 2 * pad) * p[0] / x_max, h - pad - (h - 2 * pad) * (p[1] - lo) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">']
    out.append(f'<rect width="{w}" height="{h}" fill="white"/>')
    out.append(f'<text x="{pad}" y="15">{CURVES[metric]}</text>')
    out.append(f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>')
    out.append(f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>')
    out.append(f'<text x="{w - pad}" y="{h - pad + 14}" text-anchor="end">step {x_max}</text>')
    out.append(f'<text x="{pad - 4}" y="{pad}" text-anchor="end">{hi:.3g}</text>')
    out.append(f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">{lo:.3g}</text>')
    for i, (mode, s) in enumerate(series.items()):
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(xy, s))
        out.append(f'<polyline fill="none" stroke="{COLOURS[mode]}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{w - pad - 60}" y="{pad + 14 * i}" fill="{COLOURS[mode]}">{mode}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny_models/sd3")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--runs", type=Path, required=True, help="where the two runs write (one folder per mode)")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p.add_argument("--collect", action="store_true", help="read existing runs instead of running them")
    a = p.parse_args()
    if not a.collect:
        for mode in MODES:
            run(a.model_path, a.steps, a.runs / mode, mode)
    result = collect(a.runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    extras = a.out.parent / a.out.stem
    extras.mkdir(exist_ok=True)
    for metric in CURVES:
        if chart := svg(metric, result):
            (extras / f"{metric.replace('/', '_')}.svg").write_text(chart)
    for mode in MODES:
        grids = sorted((a.runs / mode / "guard").glob("step_*.png"))
        for grid in grids[:1] + grids[-1:]:
            shutil.copy(grid, extras / f"guard_{mode}_{grid.name}")
    for mode in MODES:
        r = result["runs"][mode]
        first = {k: v[0][1] for k, v in r["curves"].items() if v}
        last = {k: v[-1][1] for k, v in r["curves"].items() if v}
        print(f"{mode}: {r['steps']} steps, alerts {[(x['step'], x['metric']) for x in r['alerts']]}")
        for k in CURVES:
            if k in first:
                print(f"  {k}: first {first[k]:.4f} last {last[k]:.4f}")


if __name__ == "__main__":
    main()
