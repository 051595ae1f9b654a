"""scripts/train.py on a recipe with one more reward weight: `uniform_noise` (omnirl/rewards/noise.py).

    torchrun --nproc_per_node 2 -m scripts.gpu.train_entry --noise-weight 0.001 --recipe mmk12 [--cap-gib G]
        [overrides]

The command line can set the weight of a reward a recipe names but cannot add one, so this writes a copy
of the recipe with `uniform_noise` added and runs it: a random-init model then gets reward spread in every
group, and the whole update runs (benchmarks/README.md). `--cap-gib` caps each rank's device memory at G GiB
(torch.cuda.set_per_process_memory_fraction through omnirl.memory.cap_device_memory), to measure on a large
GPU what fits on a smaller one.
"""

import argparse
import tempfile
from pathlib import Path

import yaml

from omnirl.config import resolve_recipe
from scripts import train


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--noise-weight", type=float, required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--cap-gib", type=float, default=0)
    args, rest = parser.parse_known_args()
    if args.cap_gib:
        import os

        import torch

        from omnirl.memory import cap_device_memory

        if torch.cuda.is_available():
            cap_device_memory(args.cap_gib, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    path = resolve_recipe(args.recipe)
    recipe = yaml.safe_load(path.read_text())
    recipe["reward"]["weights"]["uniform_noise"] = args.noise_weight
    derived = Path(tempfile.mkdtemp()) / path.name  # per rank; the run's name and settings are the recipe's
    derived.write_text(yaml.safe_dump(recipe, sort_keys=False))
    train.exit_now(train.main(["--recipe", str(derived), *rest]))


if __name__ == "__main__":
    main()
