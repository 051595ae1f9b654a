"""The quickstart recipe under `health.on_alert warn` and `adapt`, side by side: reward, in-group diversity
(relative to the first steps') and the KL weight per step, the alerts, and the guard set's sample grids.

    python -m benchmarks.health_quickstart --model-path tiny_models/sd3 --steps 120 \
        --runs /tmp/health --out benchmarks/results/health_quickstart_cpu_DATE.json

runs `scripts/train.py --recipe sd3_tiny_flowgrpo` twice, one after the other, on one process (the same
samples as the recipe's two ranks), with the guard set below every 10 steps; `--collect` skips the runs and
reads the two output directories under `--runs`. Writes the JSON (every step's values, the alerts), one
SVG chart per metric with both runs, and the guard grids of both runs' last guard step, beside the JSON
(`<out stem>/`), with the first and last logged training samples of each run. The JSON records the
commit (`--commit`: the one the runs ran at; default the checkout's), the command and a summary per run
(`summary`: what the result page's table states); `--page JSON` prints that table, which
tests/test_results.py holds the page to.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

GUARD_PROMPTS = [
    "a red apple on a table",
    "a blue car in the street",
    "a cat sleeping",
    "a mountain lake at dawn",
]  # four prompts, one seed each (health.guard_prompts takes them as four arguments)
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
    """Every step's curves, the alerts and the summary of the runs under `runs` (one directory per mode)."""
    result: dict = {"guard_prompts": GUARD_PROMPTS, "runs": {}}
    for mode in MODES:
        rows = [json.loads(line) for line in open(runs / mode / "metrics.jsonl")]
        alerts_file = runs / mode / "health_alerts.jsonl"
        alerts = [json.loads(x) for x in open(alerts_file)] if alerts_file.exists() else []
        curves = {k: [[r["step"], r[k]] for r in rows if k in r] for k in CURVES}
        result["runs"][mode] = {"steps": len(rows), "curves": curves, "alerts": alerts}
        result["runs"][mode]["summary"] = summary(rows, alerts)
    return result


def summary(rows: list[dict], alerts: list[dict], block: int = 10, threshold: float = 0.5) -> dict:
    """What the page states of one run: the mean reward of its first and last `block` steps, the lowest
    diversity ratio and its step, the ratio's mean over the last block, the steps below `threshold`
    (health.diversity_min's default), the steps with a KL weight above 0 and the largest, the guard reward
    at its first and last evaluation, the largest parity gap and the steps' wall time."""
    reward = [r["reward/mean"] for r in rows]
    ratio = [(r["step"], r["health/diversity_ratio"]) for r in rows if "health/diversity_ratio" in r]
    beta = [r.get("health/kl_beta", 0.0) for r in rows]
    guard = [(r["step"], r["health/guard_reward"]) for r in rows if "health/guard_reward" in r]
    low = min(ratio, key=lambda x: x[1])
    return {
        "steps": len(rows),
        "reward_first": float(np.mean(reward[:block])),
        "reward_last": float(np.mean(reward[-block:])),
        "ratio_lowest": low[1],
        "ratio_lowest_step": low[0],
        "ratio_last": float(np.mean([v for _, v in ratio[-block:]])),
        "ratio_below": sum(v < threshold for _, v in ratio),
        "ratio_steps": len(ratio),
        "kl_steps": sum(b > 0 for b in beta),
        "kl_max": max(beta),
        "guard_first": guard[0] if guard else None,
        "guard_last": guard[-1] if guard else None,
        "parity_gap_max": max(r.get("health/parity_gap", 0.0) for r in rows),
        "time_s": sum(r["time/step_s"] for r in rows),
        "alerts": [
            f"step {a['step']}: `{a['metric']}` {a['value']:.4g} below {a['threshold']:g}" for a in alerts
        ],
    }


def table(result: dict) -> str:
    """The page's table of the two runs (`summary` of each)."""
    w, a = (result["runs"][m]["summary"] for m in MODES)

    def both(f) -> str:
        return f"| {f(w)} | {f(a)} |"

    def reward(s):
        change, n = s["reward_last"] - s["reward_first"], s["steps"]
        steps = f"steps 0-9 -> {n - 10}-{n - 1}"
        return f"{s['reward_first']:.4f} -> {s['reward_last']:.4f} ({change:+.4f}; {steps})"

    def guard(s):
        (i, first), (j, last) = s["guard_first"], s["guard_last"]
        return f"{first:.3f} (step {i}) -> {last:.3f} (step {j})"

    rows = [
        "| | warn | adapt |",
        "|---|---|---|",
        "| steps run " + both(lambda s: s["steps"]),
        "| mean reward, first 10 steps -> last 10 " + both(reward),
        "| in-group diversity / first 3 steps', lowest (step) "
        + both(lambda s: f"{s['ratio_lowest']:.3f} ({s['ratio_lowest_step']})"),
        "| the same, mean of the last 10 steps " + both(lambda s: f"{s['ratio_last']:.3f}"),
        "| steps with the ratio below 0.5 (`health.diversity_min`) "
        + both(lambda s: f"{s['ratio_below']} of {s['ratio_steps']}"),
        "| alerts " + both(lambda s: "; ".join(s["alerts"]) or "none"),
        "| KL weight: steps above 0, largest " + both(lambda s: f"{s['kl_steps']}, {s['kl_max']:.3g}"),
        f"| guard reward ({len(result['guard_prompts'])} prompts, fixed seeds), first -> last " + both(guard),
        "| parity gap (largest mean per timestep, every step) "
        + both(lambda s: f"{s['parity_gap_max']:.3g}"),
        "| wall time of the steps " + both(lambda s: f"{s['time_s']:.0f} s"),
    ]
    return "\n".join(rows)


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
    p.add_argument("--runs", type=Path, help="where the two runs write (one folder per mode)")
    p.add_argument("--out", type=Path, help="the JSON to write")
    p.add_argument("--collect", action="store_true", help="read existing runs instead of running them")
    p.add_argument("--commit", help="the commit the runs ran at (default: this checkout's)")
    p.add_argument("--page", type=Path, help="print the table of this JSON and exit")
    a = p.parse_args()
    if a.page is not None:
        print(table(json.loads(a.page.read_text())))
        return
    if a.runs is None or a.out is None:
        p.error("--runs and --out are required")
    if not a.collect:
        for mode in MODES:
            run(a.model_path, a.steps, a.runs / mode, mode)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": a.commit or head,
        "command": f"python -m benchmarks.health_quickstart --model-path {a.model_path} --steps {a.steps} "
        f"--runs {a.runs} --out {a.out}",
        **collect(a.runs),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    extras = a.out.parent / a.out.stem
    extras.mkdir(exist_ok=True)
    for metric in CURVES:
        if chart := svg(metric, result):
            (extras / f"{metric.replace('/', '_')}.svg").write_text(chart)
    for mode in MODES:
        for kind in ("guard", "samples"):
            grids = sorted((a.runs / mode / kind).glob("step_*.png"))
            for grid in grids[:1] + grids[-1:]:
                shutil.copy(grid, extras / f"{kind}_{mode}_{grid.name}")
    print(table(result))


if __name__ == "__main__":
    main()
