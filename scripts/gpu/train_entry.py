"""scripts/train.py on a recipe with one more reward weight: `uniform_noise` (omnirl/rewards/noise.py).

    torchrun --nproc_per_node 2 -m scripts.gpu.train_entry --noise-weight 0.001 --recipe mmk12 [--cap-gib G]
        [--random-init] [overrides]

The command line can set the weight of a reward a recipe names but cannot add one, so this writes a copy
of the recipe with `uniform_noise` added and runs it: a random-init model then gets reward spread in every
group, and the whole update runs (benchmarks/README.md). `--cap-gib` caps each rank's device memory at G GiB
(torch.cuda.set_per_process_memory_fraction through omnirl.memory.cap_device_memory), to measure on a large
GPU what fits on a smaller one. `--random-init` builds the omni adapters' model from `model.path`'s config
with random weights (omnirl.models.random_init.random_init_loader: in its dtype, on the device, or on the
host where distributed.frozen_base shards or offloads it; the same weights on every rank), for a
config-only checkpoint (`python -m scripts.gpu.two_gpu_runs checkpoint --config-only`).
"""

import argparse
import tempfile
from pathlib import Path

import yaml

from omnirl.config import ConfigError
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
    if args.random_init:
        try:
            frozen_base = train.parse(str(derived), rest).distributed.frozen_base
        except ConfigError:  # train.main reports it in its one line
            frozen_base = "replicate"
        random_weights(frozen_base)
    train.exit_now(train.main(["--recipe", str(derived), *rest]))


def random_weights(frozen_base: str) -> None:
    """The omni adapters' `load_pretrained` replaced by `random_init_loader`, seeded alike on every rank."""
    import torch

    from omnirl.distributed import local_device
    from omnirl.models import qwen3_omni, qwen_vl
    from omnirl.models.random_init import random_init_loader

    load = random_init_loader(local_device(), policy_on_host=frozen_base != "replicate")

    def seeded(cls, path, **kwargs):
        torch.manual_seed(0)
        return load(cls, path, **kwargs)

    qwen3_omni.load_pretrained = qwen_vl.load_pretrained = seeded


if __name__ == "__main__":
    main()
