"""Print how a run's reward moved: the mean of the first and of the last 10 logged steps (of the first and
the second half on a run under 20 steps, so that the two never overlap).

python scripts/summarize_run.py outputs/RUN/metrics.jsonl [--key reward/mean] [--window 10]
    [--record FILE.json --command "the command that made the run"]

`--record` writes what it prints, every step's value and where it came from (the commit, the command,
the machine, the library versions) to FILE.json: a result page's numbers are quoted from such a file, and
tests/test_results.py holds every quote to its record.

The health alerts are those of health_alerts.jsonl beside metrics.jsonl (docs/health.md), one line each.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def summary(vals: list[float], window: int) -> tuple[int, float, float]:
    """(w, mean of the first w values, mean of the last w): w is `window`, or half the run when the run is
    shorter than two windows (at least 1)."""
    w = max(1, min(window, len(vals) // 2))
    return w, sum(vals[:w]) / w, sum(vals[-w:]) / w


def provenance(command: str) -> dict:
    """The commit (with whether the tree had uncommitted changes), the command, the machine and the
    versions of the libraries a run's numbers depend on."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    versions = {}
    for name in ("torch", "diffusers", "transformers", "peft", "numpy", "pillow"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
        },
        "versions": versions,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("--key", default="reward/mean")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--record", help="write the summary, every step's value and the provenance here (JSON)")
    p.add_argument("--command", help="with --record: the command that made the run")
    a = p.parse_args()
    if a.record and not a.command:
        p.error("--record needs --command: the command that made the run")
    rows = [json.loads(line) for line in open(a.metrics) if line.strip()]
    vals = [r[a.key] for r in rows if a.key in r]
    if not vals:
        raise SystemExit(f"{a.metrics}: no {a.key!r} values")
    w, first, last = summary(vals, a.window)
    secs = sum(r.get("time/step_s", 0.0) for r in rows)
    print(
        f"{len(vals)} steps in {secs:.0f} s: {a.key} first {w} steps {first:.4f} -> last {w} {last:.4f} "
        f"(change {last - first:+.4f})"
    )
    if a.record:
        record = {
            **provenance(a.command),
            "key": a.key,
            "steps": len(vals),
            "window": w,
            "first": first,
            "last": last,
            "change": last - first,
            "step_s": secs,
            "values": vals,
        }
        with open(a.record, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
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
