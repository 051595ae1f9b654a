"""Print how a run's reward moved (mean of the first and last 10 logged steps) and the health alerts it had.

python scripts/summarize_run.py outputs/RUN/metrics.jsonl [--key reward/mean] [--window 10]

The alerts are those of health_alerts.jsonl beside metrics.jsonl (docs/health.md), one line each.
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("--key", default="reward/mean")
    p.add_argument("--window", type=int, default=10)
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.metrics) if line.strip()]
    vals = [r[a.key] for r in rows if a.key in r]
    if not vals:
        raise SystemExit(f"{a.metrics}: no {a.key!r} values")
    w = min(a.window, len(vals))
    first, last = sum(vals[:w]) / w, sum(vals[-w:]) / w
    secs = sum(r.get("time/step_s", 0.0) for r in rows)
    print(
        f"{len(vals)} steps in {secs:.0f} s: {a.key} first {w} steps {first:.4f} -> last {w} {last:.4f} "
        f"(change {last - first:+.4f})"
    )
    alerts_file = Path(a.metrics).parent / "health_alerts.jsonl"
    alerts = [json.loads(line) for line in open(alerts_file) if line.strip()] if alerts_file.exists() else []
    print(f"health alerts: {len(alerts)}")
    for x in alerts:
        print(
            f"  step {x['step']}: {x['metric']} {x['value']:.4g} past its threshold {x['threshold']:g} "
            f"(on_alert {x['action']})"
        )


if __name__ == "__main__":
    main()
