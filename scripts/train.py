"""omnirl's entry point.

    torchrun --nproc_per_node N scripts/train.py --recipe NAME [--section.field value ...]

`--recipe NAME` is yaml/NAME.yaml or a path to a YAML file; every other flag overrides one config field
(`--help` lists them all with their documentation).

A mistake in the input (recipe, override, value out of range, model path, adapter / reward / loss name,
data file or row, a checkpoint that does not fit or is damaged, an output directory another run holds) is
one line `error: ...` on stderr and exit status 2, raised before anything is written to run.output_dir.
Under torchrun rank 0 prints it and writes it to its torchelastic error file, so that the launcher's
failure summary names it as the cause (torchrun itself exits 1); the other ranks first wait a few seconds
for the launcher to end them, and report it themselves only where rank 0 did not fail.
A run that training drove to NaN or infinity (every sample of a step, every update skipped, or
train.on_nonfinite stop) ends with one line `error: ...` naming the step, exit status 1, and exports
nothing. Anything else is a bug and keeps its traceback; under torchrun `@record` also puts it in the
launcher's failure summary, so the first failing rank's cause is named there.
"""

import argparse
import contextlib
import gc
import io
import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from omnirl.config import Config, ConfigError
from omnirl.data.prompts import DataError
from omnirl.distributed import exit_now
from omnirl.health import HealthError
from omnirl.recipe import load_config
from omnirl.step import NonFiniteError

USER_ERRORS = (ConfigError, DataError)  # omnirl.checkpoint.CheckpointError is a ConfigError
# Under torchrun, how long a rank other than 0 waits, after a user error, for the launcher to end it (rank 0
# found the same error and exited); a rank still running then reports the error itself.
REPORT_WAIT_S = 5.0


@record
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--recipe")
    args, rest = parser.parse_known_args(argv)
    if args.recipe is None:
        if "-h" in rest or "--help" in rest:
            import tyro

            tyro.cli(Config, args=rest, description="omnirl: pass --recipe NAME plus overrides")
        print("error: --recipe NAME is required (a yaml/NAME.yaml recipe or a path)", file=sys.stderr)
        return 2
    try:
        cfg = parse(args.recipe, rest)
        from omnirl import distributed
        from omnirl.trainer import train

        # What is imported by now (torch, transformers, diffusers, the adapter's module) lives as long as
        # the process: keep it out of the full collections that every phase switch runs
        # (omnirl.memory.empty_cache), each of which would scan it all again. Unfrozen after, for a caller
        # that goes on in this process (a test calling main): what it held is theirs.
        gc.freeze()
        try:
            train(cfg)
        finally:
            gc.unfreeze()
        distributed.barrier()  # no rank tears down while another is still in a collective
        distributed.destroy()  # NCCL warns about a process group that is never destroyed
    except USER_ERRORS as e:
        report("error: " + " ".join(line.strip() for line in str(e).splitlines()))
        return 2
    except (NonFiniteError, HealthError) as e:
        report(f"error: {e}")
        return 1
    return 0


def report(line: str) -> None:
    """Print a user error's line once per job (see the module docstring)."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(REPORT_WAIT_S)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    print(line, file=sys.stderr, flush=True)


def parse(recipe: str, overrides: list[str]) -> Config:
    """`load_config`, with tyro's boxed message for a bad override turned into a one-line ConfigError."""
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            cfg = load_config(recipe, overrides)
    except SystemExit as e:
        if e.code:
            raise ConfigError(first_block(box.getvalue())) from None
        raise  # --help
    sys.stderr.write(box.getvalue())  # warnings printed while parsing
    return cfg


def first_block(box: str) -> str:
    """The text of a tyro error box between its top border and its first rule ("Error parsing --optim.lr:
    could not convert string to float: 'abc'"), or the whole text when it is not a box. tyro draws the
    box in UTF-8 when stdout's encoding is UTF-8 (the title in the top border) and in ASCII dashes
    otherwise (the title on a line above it)."""
    rows, rules = [], 0
    for line in box.splitlines():
        text = line.strip().strip("│").strip()
        if text.startswith("╭") or (text and set(text) <= {"─", "-"}):
            rules += 1
            if rules == 2:
                break
        elif rules == 1 and text:
            rows.append(text)
    return " ".join(rows) or " ".join(box.split())


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
