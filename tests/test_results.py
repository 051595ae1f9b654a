"""The numbers README and the result pages quote from a CPU run, against the run's record (written by
`scripts/summarize_run.py --record`): a quote its record does not give fails, and so does a record whose
summary is not what its own per-step values give."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
TINY = "benchmarks/results/tiny_recipes_cpu.md"
LTX = "ltx23_tiny_t2av_flowgrpo_cpu_2026-12-05.json"
WAN = "wan22_ti2v_tiny_dancegrpo_cpu_2026-12-05.json"
NFT = "sd3_tiny_nft_cpu_2026-12-05.json"
NFT_DECAY0 = "sd3_tiny_nft_decay0_cpu_2026-12-05.json"
DPPO = "qwen_image_tiny_flowdppo_cpu_2026-12-05.json"
PICKSCORE = "sd3_tiny_flowgrpo_pickscore_cpu_2026-12-05.json"
FLUX = "benchmarks/results/flux_tiny_cpu.md"
FLUX_RUNS = [f"flux_tiny_{a}" for a in ("flowgrpo", "dancegrpo", "mixgrpo", "dgpo")] + ["sd3_tiny_dgpo"]


def std(name: str) -> str:
    """The record of the same run's within-step reward std (`--key reward/std`)."""
    return name.replace("_cpu_", "_std_cpu_")


# (file, record, quoted text): the text is formatted from the record (first, last, change, steps, step_s,
# values: every step's; b: the means of its blocks of 10 steps, blocks: those joined at 3 decimals; min and
# max of the values) and must appear in the file, whitespace aside.
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
    ("docs/log.md", "bagel_tiny_cpu_2026-12-05.json", "({change:+.3f} in {steps} steps at the reference's"),
    # The tiny recipes of tiny_recipes_cpu.md: LTX-2.3, Wan2.2 DanceGRPO, DiffusionNFT, Flow-DPPO, PickScore.
    (TINY, LTX, "in dBFS), {steps} steps on 2 ranks ({step_s:.0f} s of steps)"),
    (TINY, LTX,
     "| `ltx23_tiny_t2av_flowgrpo` | {steps} | {first:.2f} dB | {last:.2f} dB | **{change:+.2f} dB** (the "
     "first 10"),
    (TINY, std(LTX), "steps' within-step std: {first:.2f} dB) |"),
    (TINY, LTX,
     "Per step the loudness rises from {values[0]:.2f} dB (step 0) to {values[9]:.2f} dB at step 9 and then "
     "holds: the blocks of 10 steps are {b[0]:.2f}, {b[1]:.2f}, {b[2]:.2f}, {b[3]:.2f}."),
    (TINY, LTX,
     "last 3's): {values[0]:.2f}, {values[1]:.2f}, {values[2]:.2f}, {values[3]:.2f}, {values[4]:.2f}, "
     "{values[5]:.2f}, {values[6]:.2f}, {values[7]:.2f}."),
    (TINY, WAN, "trained | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** (the first 10 steps'"),
    (TINY, std(WAN), "within-step std: {first:.4f}) | {step_s:.0f} s |"),
    (TINY, WAN, "(Wan: {b[0]:.3f}, {b[1]:.3f}, {b[2]:.3f}, {b[3]:.3f}, {b[4]:.3f}, {b[5]:.3f})"),
    (TINY, NFT,
     "the soft-updated old policy | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** | "
     "{step_s:.0f} s |"),
    (TINY, NFT_DECAY0,
     "`--algo.diffusion_nft.old_decay_max 0` (the old policy the rollout's) rose from "
     "{first:.4f} to {last:.4f}, "
     "**{change:+.4f}** ({step_s:.0f} s of steps;"),
    (TINY, DPPO,
     "(`algo.adv_clip null`) | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** | {step_s:.0f} s |"),
    (TINY, PICKSCORE, "`--only sd3 --only pickscore` ({step_s:.0f} s of steps)"),
    (TINY, PICKSCORE,
     "| `sd3_tiny_flowgrpo_pickscore` | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** |"),
    (TINY, PICKSCORE, "The means of the ten blocks of 10 steps: {blocks}:"),
    (TINY, std(PICKSCORE), "the first 10 steps' within-step std is {first:.4f})"),
    ("benchmarks/RESULTS.md", DPPO, "{change:+.3f} (DPPO, unclamped)"),
    ("benchmarks/RESULTS.md", NFT, "{change:+.3f} (NFT, soft old policy)"),
    ("benchmarks/RESULTS.md", WAN, "{change:+.4f} (Wan DanceGRPO)"),
    ("benchmarks/RESULTS.md", PICKSCORE, "{change:+.3f} (PickScore, {steps} steps)"),
    ("benchmarks/RESULTS.md", LTX, "{change:+.2f} dB (LTX-2.3 audio loudness, {steps} steps)"),
    # tiny FLUX.1-dev and DGPO
    *(
        quote
        for name in FLUX_RUNS
        for quote in [
            (FLUX, f"{name}_cpu_2026-12-05.json",
             f"| `{name}` | " "{steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** (the first 10 steps'"),
            (FLUX, f"{name}_std_cpu_2026-12-05.json", "within-step std: {first:.4f}) | {step_s:.0f} s |"),
            (FLUX, f"{name}_cpu_2026-12-05.json",
             f"| `{name}` | " + " | ".join(f"{{b[{i}]:.4f}}" for i in range(6)) + " |"),
        ]
    ),
    ("benchmarks/RESULTS.md", "flux2_klein_tiny_flowgrpo_cpu_2026-12-06.json", "{change:+.4f} (FLUX.2-klein"),
    (FLUX, "flux2_klein_tiny_flowgrpo_cpu_2026-12-06.json",
     "| `flux2_klein_tiny_flowgrpo` | {steps} | {first:.4f} | {last:.4f} | **{change:+.4f}** (the first 10"),
    (FLUX, "flux2_klein_tiny_flowgrpo_std_cpu_2026-12-06.json",
     "within-step std: {first:.4f}) | {step_s:.0f} s |"),
    (FLUX, "flux2_klein_tiny_flowgrpo_cpu_2026-12-06.json",
     "| `flux2_klein_tiny_flowgrpo` | " + " | ".join(f"{{b[{i}]:.4f}}" for i in range(6)) + " |"),
    (FLUX, "sd3_tiny_dgpo_lr1e-2_t4_cpu_2026-12-05.json",
     "moved its reward by {change:+.4f} in {steps} steps (first 10 {first:.4f}, last 10 {last:.4f}; "
     "{step_s:.0f} s of steps;"),
    (FLUX, "sd3_tiny_dgpo_std_cpu_2026-12-05.json",
     "the SD3 recipe's first 10 steps' within-step std, {first:.4f}"),
    (FLUX, "sd3_tiny_dgpo_group_weight_cpu_2026-12-05.json", "starts at {values[0]:.1f} (the policy is the"),
    (FLUX, "sd3_tiny_dgpo_group_weight_cpu_2026-12-05.json", "between {min:.3f} and {max:.3f} (SD3)"),
    (FLUX, "flux_tiny_dgpo_group_weight_cpu_2026-12-05.json", "between {min:.3f} and {max:.3f} (FLUX)"),
    ("benchmarks/RESULTS.md", "flux_tiny_flowgrpo_cpu_2026-12-05.json", "| {change:+.3f} (Flow-GRPO),"),
    ("benchmarks/RESULTS.md", "flux_tiny_dancegrpo_cpu_2026-12-05.json", "{change:+.3f} (DanceGRPO),"),
    ("benchmarks/RESULTS.md", "flux_tiny_mixgrpo_cpu_2026-12-05.json", "{change:+.3f} (MixGRPO),"),
    ("benchmarks/RESULTS.md", "flux_tiny_dgpo_cpu_2026-12-05.json", "{change:+.3f} (FLUX DGPO),"),
    ("benchmarks/RESULTS.md", "sd3_tiny_dgpo_cpu_2026-12-05.json",
     "{change:+.3f} (SD3 DGPO), JPEG compressibility, {steps} steps each"),
]  # fmt: skip


def summarize_run():
    spec = importlib.util.spec_from_file_location("summarize_run", ROOT / "scripts/summarize_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(name: str) -> dict:
    r = json.loads((RESULTS / name).read_text())
    v = r["values"]
    b = [sum(v[i : i + 10]) / len(v[i : i + 10]) for i in range(0, len(v), 10)]
    return {**r, "b": b, "blocks": ", ".join(f"{x:.3f}" for x in b), "min": min(v), "max": max(v)}


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


def test_the_health_docs_example_is_the_records_alert():
    """docs/health.md's example alert line is the warn run's alert in the quickstart's record (the page's
    own table is checked against the record below)."""
    runs = json.loads((RESULTS / "health_quickstart_cpu_2026-12-06.json").read_text())["runs"]
    (alert,) = runs["warn"]["alerts"]
    example = " ".join((ROOT / "docs/health.md").read_text().split())
    assert f"step {alert['step']}: health/diversity_ratio {alert['value']:.4f} below its threshold" in example


# (page, benchmark module, record): the page holds the table the module renders from its record.
TABLES = [
    ("benchmarks/results/health_quickstart.md", "health_quickstart", "health_quickstart_cpu_2026-12-06.json"),
    ("benchmarks/results/parity_gaps_cpu.md", "parity_gaps", "parity_gaps_cpu_2026-12-05.json"),
    ("docs/health.md", "parity_gaps", "parity_gaps_cpu_2026-12-05.json"),
    ("benchmarks/results/parity_gaps_cpu.md", "parity_gaps", "parity_gaps_fp8_h100_2026-12-06.json"),
    ("docs/health.md", "parity_gaps", "parity_gaps_fp8_h100_2026-12-06.json"),
]


@pytest.mark.parametrize("page, module, name", TABLES)
def test_a_result_table_is_its_records(page, module, name):
    table = importlib.import_module(f"benchmarks.{module}").table
    text = (ROOT / page).read_text()
    assert table(json.loads((RESULTS / name).read_text())) in text, f"{page} does not hold {name}'s table"


def test_the_guard_record_holds_several_prompts():
    r = json.loads((RESULTS / "health_quickstart_cpu_2026-12-06.json").read_text())
    assert len(r["guard_prompts"]) > 1 and len(r["commit"]) == 40
    for run in r["runs"].values():
        assert run["summary"]["steps"] == len(run["curves"]["reward/mean"])
