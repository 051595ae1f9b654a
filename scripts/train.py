"""omnirl's entry point.

    python scripts/train.py --nproc_per_node N --recipe NAME [--section.field value ...]   # one node
    torchrun [torchrun's options] scripts/train.py --recipe NAME [--section.field value ...]

`--recipe NAME` is yaml/NAME.yaml or a path to a YAML file; every other flag overrides one config field
(`--help`: what the recipe sets and the recipes; `--help-all`: every field with its documentation).
With `--nproc_per_node N` this process is the launcher: it checks the config, then starts N ranks on
this node through torchrun's own API (`torch.distributed.run`, as `torchrun --standalone
--nproc_per_node N`). Without it, it is one rank (torchrun started it, or it runs alone).

A mistake in the input (recipe, override, value out of range, model path, adapter / reward / loss name,
data file or row, a checkpoint that does not fit or is damaged, an output directory another run holds) is
one line `error: ...` on stderr and exit status 2, raised before anything is written to run.output_dir.
The launcher finds what the config check finds before any rank starts; a rank that finds the rest prints
its line and the launcher exits with its status, adding nothing. Under torchrun rank 0 prints it and
writes it to its torchelastic error file, so that torchrun's failure summary names it as the cause
(torchrun itself exits 1); the other ranks first wait a few seconds for the launcher to end them, and
report it themselves only where rank 0 did not fail.
A run that training drove to NaN or infinity (every sample of a step, every update skipped, or
train.on_nonfinite stop) ends with one line `error: ...` naming the step, exit status 1, and exports
nothing. Ctrl-C ends the run with one line (exit status 130), and so does a full disk (naming the file
being written; exit status 1); the complete checkpoints are kept. Anything else is a bug and keeps its
traceback; under torchrun `@record` also puts it in the launcher's failure summary, so the first failing
rank's cause is named there.
"""

import argparse
import contextlib
import errno
import gc
import io
import json
import logging
import os
import sys
import time

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.elastic.multiprocessing.errors import record

from omnirl.config import Config
from omnirl.distributed import exit_now
from omnirl.errors import ConfigError, DataError
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
    parser.add_argument("--nproc_per_node", "--nproc-per-node")
    args, rest = parser.parse_known_args(argv)
    if {"-h", "--help", "--help-all"} & set(rest):
        return show_help(args.recipe, rest)
    if args.nproc_per_node is not None:
        return launch(args.recipe, rest, args.nproc_per_node)
    if args.recipe is None:
        return error("--recipe NAME is required (a yaml/NAME.yaml recipe or a path)")
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
    except KeyboardInterrupt:
        where = f" in {cfg.run.output_dir}/checkpoints" if cfg is not None else ""
        report(
            f"error: interrupted (Ctrl-C): the complete checkpoints{where} are kept (one being written is "
            "not), and the same command continues from the newest (checkpoint.resume auto)"
        )
        return 130
    except BaseException as e:
        full = disk_full(e)
        if full is None:
            raise
        report(
            f"error: no space left on the device writing {full.filename or 'a file'}: the complete "
            "checkpoints are kept (one being written is not); free space and the same command continues from "
            "the newest"
        )
        return 1
    return 0


def disk_full(e: BaseException) -> OSError | None:
    """The OSError of a full disk (ENOSPC) or quota (EDQUOT) behind `e`: itself, its cause or context, or
    one rank's failure in a checkpoint write (DCP's CheckpointException holds each rank's), else None."""
    seen = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
        if isinstance(x, CheckpointException):  # its failures: {rank: (exception, traceback)}
            todo += [failure for failure, _ in x.failures.values()]
        todo += [x.__cause__, x.__context__]
    return None


def launch(recipe: str | None, overrides: list[str], nproc: str) -> int:
    """Check the config, then run `nproc` ranks of this script on this node, as `torchrun --standalone
    --nproc_per_node N` does (its API: the same rendezvous, environment and restarts). A rank that ends
    with a user error has printed its `error:` line: the launcher exits with that rank's status and prints
    nothing more; any other failure keeps torchrun's summary."""
    if "LOCAL_RANK" in os.environ:
        return error("--nproc_per_node is the launcher's flag: under torchrun, leave it out")
    if not nproc.isdigit() or int(nproc) < 1:
        return error(f"--nproc_per_node must be a whole number >= 1, got {nproc!r}")
    if recipe is None:
        return error("--recipe NAME is required (a yaml/NAME.yaml recipe or a path)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from omnirl.ops import check_before_loading

    os.environ["WORLD_SIZE"] = nproc  # what the checks of several ranks read; each rank gets its own
    printed = io.StringIO()  # the ranks print the config's warnings: shown here only with an error
    try:
        with contextlib.redirect_stderr(printed):
            check_before_loading(parse(recipe, overrides))
    except USER_ERRORS as e:
        sys.stderr.write(printed.getvalue())
        return error(" ".join(line.strip() for line in str(e).splitlines()))
    # torchrun's agent logs its banner, rendezvous and each failed rank to stderr: the ranks' own output
    # says it all, and a failure that is not a user error re-raises with torchrun's summary below.
    quiet = logging.getLogger("torch.distributed")  # torch gives it a stderr handler and no propagation
    quiet.handlers, quiet.propagate = [logging.NullHandler()], False
    cmd = ["--standalone", "--nproc_per_node", nproc, os.path.abspath(__file__), "--recipe", recipe]
    try:
        run(get_args_parser().parse_args([*cmd, *overrides]))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if isinstance(failure.message, str) and failure.message.startswith("error: "):
            return failure.exitcode  # report() wrote it: the rank printed its line
        raise
    return 0


def show_help(recipe: str | None, rest: list[str]) -> int:
    """`--help`: the recipe's sections and the recipes; `--help-all`: every field (omnirl.cli_help)."""
    from omnirl.cli_help import help_text
    from omnirl.recipe import load_recipe, override_adapter

    cfg, source = None, None
    if recipe is not None:
        try:
            cfg, source = load_recipe(recipe, override_adapter(rest))
        except ConfigError as e:
            return error(" ".join(line.strip() for line in str(e).splitlines()))
    print(help_text(cfg, source, full="--help-all" in rest))
    return 0


def error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


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
