"""scripts/train.py with one more reward, `uniform_noise`, added to the recipe's reward weights.

    torchrun --nproc_per_node 2 scripts/gpu/train_entry.py --noise-weight 0.001 --recipe mmk12 [overrides]

Why: a random-init model earns no real reward (the mmk12 reward scores its responses 0), so every group has
zero spread and is dropped: the step would run no update and measure no actor-vs-rollout consistency. A
small uniform score (weight 1e-3: a uniform draw in [0, 1) times the weight) gives every group spread, so
the whole update runs on every response, while the recipe's own reward is still computed (its cost is part
of the step) and logged (`reward/mmk12`). It carries no signal: the run measures time, memory and
consistency, not learning. The recipe is otherwise the named one, with the command line's overrides.
"""

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import train  # noqa: E402  (scripts/train.py)

from omnirl.config import resolve_recipe  # noqa: E402
from omnirl.rewards import REWARDS  # noqa: E402


class UniformNoise:
    """A uniform draw in [0, 1) per response, from a generator seeded by the rank: spread, no signal."""

    def __init__(self):
        self.rng = random.Random(int(os.environ.get("RANK", "0")))

    def __call__(self, responses, prompts, metadata) -> list[float]:
        return [self.rng.random() for _ in responses]


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--noise-weight", type=float, required=True)
    parser.add_argument("--recipe", required=True)
    args, rest = parser.parse_known_args()
    path = resolve_recipe(args.recipe)
    recipe = yaml.safe_load(path.read_text())
    recipe["reward"]["weights"]["uniform_noise"] = args.noise_weight
    derived = Path(tempfile.mkdtemp()) / path.name  # per rank; the run's name and settings are the recipe's
    derived.write_text(yaml.safe_dump(recipe, sort_keys=False))
    REWARDS["uniform_noise"] = "__main__:UniformNoise"
    train.exit_now(train.main(["--recipe", str(derived), *rest]))


if __name__ == "__main__":
    main()
