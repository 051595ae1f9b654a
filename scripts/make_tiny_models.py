"""Build the tiny random-init models (real diffusers / transformers classes) as local checkpoints.

    python scripts/make_tiny_models.py --out tiny_models [--only sd3] [--force]

writes tiny_models/<family> for every family in omnirl.models.tiny.TINY_MODELS; recipes then name
e.g. `model.path: tiny_models/sd3`. A family already built is skipped unless --force.
"""

import argparse
import shutil
import time
from pathlib import Path

from omnirl.models.tiny import TINY_MODELS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="tiny_models", help="output directory (one sub-directory per family)"
    )
    parser.add_argument("--only", choices=sorted(TINY_MODELS), action="append", help="build only this family")
    parser.add_argument("--force", action="store_true", help="rebuild families that already exist")
    args = parser.parse_args()

    for name in args.only or sorted(TINY_MODELS):
        target = Path(args.out) / name
        if target.exists() and not args.force:
            print(f"{target}: exists, skipped (--force rebuilds it)")
            continue
        # Built aside and moved into place, so an interrupted build never looks like a finished model.
        partial = target.with_name(name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        start = time.perf_counter()
        TINY_MODELS[name](partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        size_mb = sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**20
        print(f"{target}: built in {time.perf_counter() - start:.1f} s, {size_mb:.1f} MB")


if __name__ == "__main__":
    main()
