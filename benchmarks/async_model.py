"""A model, not a measurement: the samples/s of distributed.mode colocated against async on N GPUs, for
each split of the GPUs into rollout and training ranks, from measured phase times of one GPU.

    python -m benchmarks.async_model [--gpus 8] [--link-gbs 100] [--out FILE.json]

Inputs, per recipe: the rollout, update and sleep/wake seconds of one step of B samples on one GPU (the
last step of a recorded phase-memory / step-time run: `benchmarks/results/*_h200_*.json`), and the bytes
of the trained tensors that async broadcasts after every update (a full fine-tune: the transformer's
parameters from the run file, in fp32; a LoRA run: `--lora-gib`, a stated size, not a measured one).

The model, with S = N B samples per step on N GPUs (each GPU's share as in the measured run):

- colocated: every GPU runs rollout, update and sleep/wake one after the other:
  step = R + U + W, samples/s = N B / step;
- async with r rollout and t = N - r training GPUs, staleness >= 1: the two sides run at once and the
  slower one bounds the step; the weights' broadcast (bytes / link bandwidth) is added once per step,
  both sides waiting for it: step = max(R N / r, U N / t) + bytes / bandwidth;
- async at staleness 0: the sides take turns: step = R N / r + U N / t + bytes / bandwidth.

It assumes the rollout and the update scale linearly with the samples per GPU (packing keeps a GPU's
batches full) and ignores the gradient all-reduce of several training ranks and the sample transfer
(host memory, small next to the weights). Its table says which split to try first, not what it gives.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30


@dataclass
class Phases:
    """One recipe's measured step on one GPU."""

    recipe: str
    samples: int  # B: samples per step on the GPU
    rollout_s: float  # R
    update_s: float  # U
    sleep_wake_s: float  # W: sleeping and waking of both phases
    trained_bytes: float  # what async broadcasts after every update
    source: str  # the run file, or where the numbers come from


def colocated_rate(p: Phases, gpus: int) -> float:
    """Samples/s of the colocated mode on `gpus` GPUs."""
    return gpus * p.samples / (p.rollout_s + p.update_s + p.sleep_wake_s)


def async_step_s(p: Phases, gpus: int, rollout: int, link_bytes_s: float, staleness: int = 1) -> float:
    """Seconds of one async step of gpus * B samples with `rollout` rollout GPUs."""
    train = gpus - rollout
    assert 0 < rollout < gpus, (rollout, gpus)
    gen, upd = p.rollout_s * gpus / rollout, p.update_s * gpus / train
    broadcast = p.trained_bytes / link_bytes_s
    return (max(gen, upd) if staleness else gen + upd) + broadcast


def async_rate(p: Phases, gpus: int, rollout: int, link_bytes_s: float, staleness: int = 1) -> float:
    """Samples/s of the async mode on `gpus` GPUs, `rollout` of them generating."""
    return gpus * p.samples / async_step_s(p, gpus, rollout, link_bytes_s, staleness)


def from_phase_run(path: Path, lora_bytes: float) -> Phases:
    """The last step of a phase-memory / step-time run file (one GPU)."""
    d = json.loads(path.read_text())
    last, s = d["per_step"][-1], d["settings"]
    ph = last["phases"]
    sleep_wake = sum(ph[k].get("sleep_s", 0.0) + ph[k].get("wake_s", 0.0) for k in ("rollout", "train"))
    if s["finetune"] == "full":
        params = sum(m["params_b"] for m in d["device"]["loads"] if m["subfolder"].startswith("transformer"))
        trained = params * 1e9 * 4  # fp32 master weights
    else:
        trained = lora_bytes
    return Phases(
        d["recipe"],
        s["prompts_per_step"] * s["group_size"],
        ph["rollout"]["work_s"],
        ph["train"]["work_s"],
        sleep_wake,
        trained,
        f"benchmarks/results/{path.name}, step {last['step']}",
    )


def from_mmk12_run(path: Path, samples: int, lora_bytes: float) -> Phases:
    """The last step of an mmk12 one-GPU run file (its own keys)."""
    last = json.loads(path.read_text())["steps"][-1]
    return Phases(
        "mmk12",
        samples,
        last["generation_s"],
        last["update_s"],
        last["sleep_wake_s"],
        lora_bytes,
        f"benchmarks/results/{path.name}, step {last['step']}",
    )


# The runs the table is made of: one per recipe, its last (warm) step.
PHASE_RUNS = [
    "phase_memory_sd35_flowgrpo_ocr_h200_2026-11-30.json",
    "step_time_qwen_image_ocr_flow_grpo_h200_2026-12-01.json",
    "phase_memory_qwen_image_edit_flowgrpo_h200_2026-11-30.json",
    "phase_memory_wan22_ti2v_dancegrpo_h200_2026-12-01.json",
    "phase_memory_wan22_a14b_flowgrpo_lora_h200_2026-12-01.json",
    "phase_memory_ltx23_t2av_flowgrpo_lora_h200_2026-12-02.json",
]
MMK12_RUN = "mmk12_one_gpu_native_h200_2026-12-02.json"


def table(recipes: list[Phases], gpus: int, link_bytes_s: float) -> tuple[str, list[dict]]:
    """The markdown table (samples/s per recipe and split) and its rows."""
    splits = list(range(1, gpus))
    head = "| recipe | colocated | " + " | ".join(f"{r}R+{gpus - r}T" for r in splits) + " | best | x |"
    lines = [head, "|" + "---|" * (len(splits) + 4)]
    rows = []
    for p in recipes:
        col = colocated_rate(p, gpus)
        rates = [async_rate(p, gpus, r, link_bytes_s) for r in splits]
        best = max(range(len(splits)), key=lambda i: rates[i])
        cells = " | ".join(f"**{v:.2f}**" if i == best else f"{v:.2f}" for i, v in enumerate(rates))
        split = f"{splits[best]}R+{gpus - splits[best]}T"
        lines.append(f"| {p.recipe} | {col:.2f} | {cells} | {split} | {rates[best] / col:.2f} |")
        rows.append(
            {**asdict(p), "colocated": col, "async": dict(zip(splits, rates)), "best_rollout": splits[best]}
        )
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--link-gbs", type=float, default=100.0, help="broadcast bandwidth, GB/s (assumed)")
    ap.add_argument("--lora-gib", type=float, default=0.5, help="a LoRA's trained bytes, GiB (assumed)")
    ap.add_argument(
        "--mmk12-samples", type=int, default=128, help="responses per step of the mmk12 run (8 prompts x 16)"
    )
    ap.add_argument("--sd35", nargs=4, type=float, metavar=("SAMPLES", "ROLLOUT_S", "UPDATE_S", "SLEEP_S"),
                    help="an SD3.5 Flow-GRPO step measured apart (adds a row)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lora = args.lora_gib * GIB
    recipes = [from_phase_run(RESULTS / name, lora) for name in PHASE_RUNS]
    recipes.append(from_mmk12_run(RESULTS / MMK12_RUN, args.mmk12_samples, lora))
    if args.sd35:
        n, r, u, w = args.sd35
        recipes.insert(0, Phases("sd35_flowgrpo (given)", int(n), r, u, w, lora, "command line"))
    text, rows = table(recipes, args.gpus, args.link_gbs * 1e9)
    print(
        f"MODEL, NOT A MEASUREMENT: predicted samples/s on {args.gpus} GPUs, colocated against async "
        f"(staleness >= 1) with r rollout (R) and t training (T) GPUs; broadcast at {args.link_gbs} GB/s "
        f"(assumed), a LoRA taken as {args.lora_gib} GiB (assumed); x = best async / colocated\n"
    )
    print(text)
    print("\nsources: " + "; ".join(f"{p.recipe}: {p.source}" for p in recipes))
    if args.out:
        args.out.write_text(
            json.dumps({"model": True, "gpus": args.gpus, "link_gbs": args.link_gbs, "rows": rows})
        )


if __name__ == "__main__":
    main()
