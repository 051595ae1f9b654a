"""omnirl's entry point.

    torchrun --nproc_per_node N scripts/train.py --recipe NAME [--section.field value ...]

`--recipe NAME` is yaml/NAME.yaml or a path to a YAML file; every other flag overrides one config field
(`--help` lists them all with their documentation).
"""

import argparse
import sys

from omnirl.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--recipe")
    args, rest = parser.parse_known_args(argv)
    if args.recipe is None:
        if "-h" in rest or "--help" in rest:
            import tyro

            from omnirl.config import Config

            tyro.cli(Config, args=rest, description="omnirl: pass --recipe NAME plus overrides")
        print("error: --recipe NAME is required (a yaml/NAME.yaml recipe or a path)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.recipe, rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from omnirl.trainer import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
