"""How long torch.sort takes for a MoE decode step's expert ids (tokens x top-k of them, below the expert
count) by key dtype, on the device: the grouped-GEMM dispatch sorts them once per MoE layer and step.

    python -m benchmarks.sort_keys [--out sort_keys.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.measure import cuda_time

SIZES = (512, 2048, 8192)  # 64, 256, 1024 tokens x top-8
EXPERTS = (32, 128)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="sort_keys.json")
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    device = torch.device("cuda")
    rows = []
    for n in SIZES:
        for experts in EXPERTS:
            ids = torch.randint(0, experts, (n,), device=device)
            reference = torch.sort(ids, stable=True)[1]
            for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
                keys = ids.to(dtype)
                for stable in (False, True):
                    perm = torch.sort(keys, stable=stable)[1]
                    grouped = torch.equal(ids[perm], ids[reference])
                    us = 1e6 * cuda_time(
                        lambda k=keys, s=stable: torch.sort(k, stable=s), args.iters, warmup=10
                    )
                    rows.append({"ids": n, "experts": experts, "dtype": str(dtype), "stable": stable,
                                 "us": us, "grouped_as_int64": grouped})  # fmt: skip
                    print(f"{n:6d} ids <{experts:4d} {dtype!s:12} stable={stable!s:5} {us:8.2f} us {grouped}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
