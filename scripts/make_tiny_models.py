"""Build the tiny random-init models (real diffusers / transformers classes) as local checkpoints.

    python scripts/make_tiny_models.py --out tiny_models [--only sd3] [--force]

writes tiny_models/<family> for every family in omnirl.testing.TINY_MODELS; recipes then name
e.g. `model.path: tiny_models/sd3`. A family already built is skipped unless --force.
"""

import argparse
import logging
import re
import shutil
import time
from pathlib import Path

import diffusers
import transformers

from omnirl.testing import TINY_MODELS


class KnownWarnings(logging.Filter):
    """The library warnings a build prints that do not apply to these models (a filter on the libraries'
    handlers, so every other warning still shows):
    - transformers' "`CLIPImageProcessor` requires torchvision (not installed); falling back to
      `CLIPImageProcessorPil`" (Siglip's too): the PIL processors are the ones omnirl runs (no torchvision).
    - "Unrecognized keys in `rope_parameters` ... {'mrope_section', 'mrope_interleaved'}": the Qwen3-Omni
      talker's text config shares the thinker's M-RoPE parameters but, unlike the thinker's, does not list
      them as known; its rotary embedding (a subclass of the thinker's) reads mrope_section all the same.
    - diffusers' "self.processor=None ... cannot be saved": the Qwen-Image-Edit processor is saved from its
      parts right after the pipeline (building one needs torchvision), and model_index.json names it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "requires torchvision (not installed); falling back to" in text:
            return False
        rope = re.match(r"Unrecognized keys in `rope_parameters` for 'rope_type'='default': \{(.*)\}$", text)
        if rope and all(k.strip(" '").startswith("mrope_") for k in rope.group(1).split(",")):
            return False
        return text != "self.processor=None of type <class 'NoneType'> cannot be saved."


def quiet_known_warnings() -> None:
    transformers.logging.get_logger("transformers")  # sets up the library's handler
    diffusers.logging.get_logger("diffusers")
    for library in ("transformers", "diffusers"):
        for handler in logging.getLogger(library).handlers:
            handler.addFilter(KnownWarnings())


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
    quiet_known_warnings()

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
