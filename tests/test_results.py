"""The numbers README and the result pages quote from a CPU run, against the run's record (written by
`scripts/summarize_run.py --record`): a quote its record does not give fails, and so does a record whose
summary is not what its own per-step values give."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"

# (file, record, quoted text): the text is formatted from the record (first, last, change, steps, step_s,
# and blocks: the means of its blocks of 10 steps) and must appear in the file, whitespace aside.
QUOTES = [
    ("README.md", "quickstart_cpu_2026-12-05.json",
     "raise the mean JPEG reward from {first:.3f} to {last:.3f} ({change:+.3f})"),
    ("README.md", "quickstart_cpu_2026-12-05.json", "its {steps} steps took {step_s:.0f} s on the shared"),
    ("benchmarks/RESULTS.md", "quickstart_cpu_2026-12-05.json",
     "| Quickstart: tiny SD3 Flow-GRPO, {steps} steps on 2 ranks | 2-core CPU | JPEG reward {first:.3f} -> "
     "{last:.3f} ({change:+.3f}) | 2026-12-05 |"),
    ("benchmarks/results/quickstart_cpu.md", "quickstart_cpu_2026-12-05.json",
     "| `sd3_tiny_flowgrpo` | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** | {step_s:.0f} s |"),
    ("benchmarks/results/quickstart_cpu.md", "quickstart_cpu_2026-12-05.json",
     "The means of the 20 blocks of 10 steps: {blocks}."),
    ("benchmarks/RESULTS.md", "bagel_tiny_cpu_2026-12-05.json", "{change:+.3f} (BAGEL, {steps} steps)"),
    ("benchmarks/results/tiny_recipes_cpu.md", "bagel_tiny_cpu_2026-12-05.json",
     "| `bagel_tiny_flowgrpo` | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}**"),
    ("benchmarks/results/tiny_recipes_cpu.md", "bagel_tiny_cpu_2026-12-05.json", "({step_s:.0f} s of steps)"),
    ("benchmarks/results/tiny_recipes_cpu.md", "bagel_tiny_cpu_2026-12-05.json",
     "The means of the ten blocks of 10 steps: {blocks}:"),
]  # fmt: skip


def summarize_run():
    spec = importlib.util.spec_from_file_location("summarize_run", ROOT / "scripts/summarize_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(name: str) -> dict:
    r = json.loads((RESULTS / name).read_text())
    v = r["values"]
    return {**r, "blocks": ", ".join(f"{sum(v[i : i + 10]) / 10:.3f}" for i in range(0, len(v), 10))}


@pytest.mark.parametrize("path, name, quote", QUOTES)
def test_a_quoted_number_is_its_records(path, name, quote):
    text = " ".join((ROOT / path).read_text().split())
    expected = " ".join(quote.format(**record(name)).split())
    assert expected in text, f"{path} does not quote {name} as {expected!r}"


@pytest.mark.parametrize("name", sorted({name for _, name, _ in QUOTES}))
def test_a_record_is_its_runs_summary(name):
    """The summary fields are what summarize_run computes from the record's per-step values, and the
    record names the commit and the command that made the run."""
    r = record(name)
    w, first, last = summarize_run().summary(r["values"], 10)
    assert (r["steps"], r["window"]) == (len(r["values"]), w)
    assert (r["first"], r["last"], r["change"]) == pytest.approx((first, last, last - first), abs=1e-12)
    assert len(r["commit"]) == 40 and "scripts/train.py --recipe" in r["command"]


def test_a_short_run_compares_its_halves():
    """Under 20 steps the first and last windows would overlap (a run of 12 compared steps 3-10 with
    themselves): the summary compares the halves."""
    summary = summarize_run().summary
    assert summary([1.0] * 6 + [2.0] * 6, 10) == (6, 1.0, 2.0)
    assert summary([1.0, 2.0, 3.0], 10) == (1, 1.0, 3.0)
    assert summary([5.0], 10) == (1, 5.0, 5.0)
    assert summary([0.0] * 10 + [1.0] * 20, 10) == (10, 0.0, 1.0)


# (page, benchmark module, record): the page holds the table the module renders from its record.
TABLES = [
    ("benchmarks/results/health_quickstart.md", "health_quickstart", "health_quickstart_cpu_2026-12-05.json"),
    ("benchmarks/results/parity_gaps_cpu.md", "parity_gaps", "parity_gaps_cpu_2026-12-05.json"),
    ("docs/health.md", "parity_gaps", "parity_gaps_cpu_2026-12-05.json"),
]


@pytest.mark.parametrize("page, module, name", TABLES)
def test_a_result_table_is_its_records(page, module, name):
    table = importlib.import_module(f"benchmarks.{module}").table
    text = (ROOT / page).read_text()
    assert table(json.loads((RESULTS / name).read_text())) in text, f"{page} does not hold {name}'s table"


def test_the_guard_record_holds_several_prompts():
    r = json.loads((RESULTS / "health_quickstart_cpu_2026-12-05.json").read_text())
    assert len(r["guard_prompts"]) > 1 and len(r["commit"]) == 40
    for run in r["runs"].values():
        assert run["summary"]["steps"] == len(run["curves"]["reward/mean"])
