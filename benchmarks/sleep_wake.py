"""Sleep/wake of AdamW state: omnirl's `memory.Sleeper` against naive per-tensor copies, in GiB/s per
transition. Flags and how to run it: benchmarks/README.md."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from omnirl import distributed as D
from omnirl import memory
from omnirl.memory import GIB, Sleeper, optimizer_state, phase

HIDDEN, RANK = 3072, 64
FULL_BLOCK = [
    *[(HIDDEN, HIDDEN)] * 4,  # to_q, to_k, to_v, to_out
    *[(HIDDEN,)] * 4,  # their biases
    (4 * HIDDEN, HIDDEN),  # MLP up
    (4 * HIDDEN,),
    (HIDDEN, 4 * HIDDEN),  # MLP down
    (HIDDEN,),
    *[(HIDDEN,)] * 4,  # two norms, weight and bias
]
LORA_TARGET = [(RANK, HIDDEN), (HIDDEN, RANK)]  # lora_A, lora_B


def shapes(workload: str, gib: float) -> list[tuple[int, ...]]:
    """Parameter shapes, cycling through a block, until their AdamW state (8 bytes a value) reaches `gib`."""
    pattern = FULL_BLOCK if workload == "full" else LORA_TARGET
    out, total = [], 0
    while total < gib * GIB:
        shape = pattern[len(out) % len(pattern)]
        out.append(shape)
        total += 8 * torch.Size(shape).numel()
    return out


def build(workload: str, gib: float, device: torch.device) -> torch.optim.AdamW:
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes(workload, gib)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def fingerprint(opt) -> list[torch.Tensor]:
    """The bytes of the first and last state tensors and a float64 sum over all of them."""
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    total = torch.stack([t.double().sum() for t in state]).sum()
    return [state[0].clone(), state[-1].clone(), total]


def moved_bytes(opt) -> int:
    return sum(v.nbytes for s in opt.state.values() for k, v in s.items() if k != "step")


def run_sleeper(opt, device, repeats: int, pack_mib: int) -> dict:
    memory.PACK_BELOW = pack_mib << 20
    sleeper = Sleeper(device)
    ref = fingerprint(opt)
    cycles = []
    for _ in range(repeats + 1):  # the first cycle also pins the host chunks
        stats: dict[str, float] = {}
        with phase("rollout", stats, sleeper, sleep={"optimizer": optimizer_state(opt)}):
            pass
        with phase("train", stats, sleeper, wake=["optimizer"]):
            pass
        cycles.append(stats)
    got = fingerprint(opt)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "state not restored bit-exact"
    steady = cycles[1:]
    out = {
        "method": f"sleeper (pack < {pack_mib} MiB)",
        "first_sleep_s": cycles[0]["time/rollout_sleep_s"],
        "sleep_s": statistics.median(c["time/rollout_sleep_s"] for c in steady),
        "wake_s": statistics.median(c["time/train_wake_s"] for c in steady),
        "host_gib": sleeper.host_bytes / GIB,
    }
    if "mem/rollout_peak_gib" in steady[-1]:  # accelerator only
        out["device_asleep_gib"] = steady[-1]["mem/rollout_peak_gib"]
        out["device_awake_gib"] = steady[-1]["mem/train_peak_gib"]
    return out


def run_naive(opt, device, repeats: int) -> dict:
    def move(target) -> float:
        start = time.perf_counter()
        for s in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                s[k] = s[k].to(target, copy=True)  # copy: on CPU, too, the bytes move
        memory.synchronize()
        return time.perf_counter() - start

    ref = fingerprint(opt)
    sleeps, wakes = [], []
    for _ in range(repeats + 1):
        sleeps.append(move(torch.device("cpu")))
        memory.empty_cache()
        wakes.append(move(device))
    got = fingerprint(opt)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "state not restored bit-exact"
    return {
        "method": "naive per-tensor .to()",
        "first_sleep_s": sleeps[0],
        "sleep_s": statistics.median(sleeps[1:]),
        "wake_s": statistics.median(wakes[1:]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--gib", type=float, default=10.0, help="GiB of AdamW state per workload")
    parser.add_argument("--workloads", default="full,lora")
    parser.add_argument("--pack-mib", default="4,16,64", help="Sleeper packing thresholds to compare")
    parser.add_argument("--repeats", type=int, default=5, help="timed cycles after the first")
    parser.add_argument("--out", default="benchmarks/results/sleep_wake.json")
    args = parser.parse_args(argv)

    device = D.init_distributed().device
    rows = []
    for workload in args.workloads.split(","):
        opt = build(workload, args.gib, device)
        nbytes, count = moved_bytes(opt), 2 * len(opt.state)
        results = [run_sleeper(opt, device, args.repeats, int(m)) for m in args.pack_mib.split(",")]
        results.append(run_naive(opt, device, args.repeats))
        for r in results:
            r.update(workload=workload, gib=nbytes / GIB, tensors=count)
            r["sleep_gib_s"] = r["gib"] / r["sleep_s"]
            r["wake_gib_s"] = r["gib"] / r["wake_s"]
            rows.append(r)
        del opt
        memory.empty_cache()

    head = f"{'workload':8} {'method':24} {'GiB':>6} {'tensors':>7} {'first s':>8} {'sleep s':>8} "
    head += f"{'wake s':>8} {'sleep GiB/s':>11} {'wake GiB/s':>10}"
    print(f"device: {device} ({device.type}), torch {torch.__version__}")
    print(head)
    for r in rows:
        print(
            f"{r['workload']:8} {r['method']:24} {r['gib']:6.2f} {r['tensors']:7d} {r['first_sleep_s']:8.3f} "
            f"{r['sleep_s']:8.3f} {r['wake_s']:8.3f} {r['sleep_gib_s']:11.1f} {r['wake_gib_s']:10.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "host": platform.node(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
