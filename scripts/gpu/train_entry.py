"""scripts/train.py on a recipe with one more reward weight: `uniform_noise` (omnirl/rewards/noise.py).

    torchrun --nproc_per_node 2 -m scripts.gpu.train_entry --noise-weight 0.001 --recipe mmk12 [--cap-gib G]
        [--random-init] [overrides]

The command line can set the weight of a reward a recipe names but cannot add one, so this writes a copy
of the recipe with `uniform_noise` added and runs it: a random-init model then gets reward spread in every
group, and the whole update runs (benchmarks/README.md). `--cap-gib` caps each rank's device memory at G GiB
(torch.cuda.set_per_process_memory_fraction through omnirl.memory.cap_device_memory), to measure on a large
GPU what fits on a smaller one. `--random-init` sets model.weights random: the model is built from
`model.path`'s config with random weights (omnirl.models.random_init: in its dtype, on the device, or on
the host where distributed.frozen_base shards or offloads it; the same weights on every rank), for a
config-only checkpoint (`python -m scripts.gpu.two_gpu_runs checkpoint --config-only`).
"""

import argparse
import tempfile
from pathlib import Path

import yaml

from omnirl.recipe import resolve_recipe
from scripts import train


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--noise-weight", type=float, required=True)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--cap-gib", type=float, default=0)
    parser.add_argument("--random-init", action="store_true")
    args, rest = parser.parse_known_args()
    if args.cap_gib:
        import torch

        from omnirl.distributed import local_device
        from omnirl.memory import cap_device_memory

        if torch.cuda.is_available():
            cap_device_memory(args.cap_gib, local_device())
    path = resolve_recipe(args.recipe)
    recipe = yaml.safe_load(path.read_text())
    recipe["reward"]["weights"]["uniform_noise"] = args.noise_weight
    derived = Path(tempfile.mkdtemp()) / path.name  # per rank; the run's name and settings are the recipe's
    derived.write_text(yaml.safe_dump(recipe, sort_keys=False))
    weights = ["--model.weights", "random"] if args.random_init else []
    train.exit_now(train.main(["--recipe", str(derived), *weights, *rest]))


if __name__ == "__main__":
    main()
