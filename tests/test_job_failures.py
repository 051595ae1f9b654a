"""How a 2-rank job fails: a rank that raises, dies or hangs ends the job promptly with the cause in the
log, torchrun killed takes its ranks with it, and a run holds its output directory. Bad input:
test_bad_input.py."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


# --- a failing rank ends the job ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_recipe(tiny_sd3, tmp_path, steps: int, **sections: dict) -> Path:
    """The tiny SD3 recipe for a 2-rank run of `steps` steps into tmp_path/out: one reward batch per rank
    and step, 4 denoising steps, no sample images; `sections` update the recipe's sections. Written to
    tmp_path/recipe.yaml, whose path is returned."""
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["model"]["path"] = str(tiny_sd3)
    recipe["run"].update(steps=steps, output_dir=str(tmp_path / "out"))
    recipe["rollout"].update(prompts_per_step=2, group_size=4)  # one reward batch per rank and step
    recipe["sampling"]["num_steps"] = 4
    recipe["log"]["image_every"] = 0
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, *overrides: str, stdout) -> subprocess.Popen:
    """tests._train_entry on 2 ranks under torchrun, on a free port, its output (stderr too) to `stdout`.
    torchrun starts in a session of its own, so that a test can kill it with its ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    cmd += [str(free_port()), "-m", "tests._train_entry", "--recipe", str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def run_two_ranks(tiny_sd3, tmp_path, reward: str, *overrides: str, timeout: float = 240):
    """A 2-rank tiny SD3 run whose rank 1 fails at step 1 (tests/support_failures.py). Returns the exit
    status, torchrun's whole output and the seconds it took. A run still going after `timeout` is a hang:
    its process group (torchrun and the ranks) is killed and the test fails."""
    recipe = two_rank_recipe(tiny_sd3, tmp_path, 3, reward={"weights": {reward: 1.0}})
    start = time.monotonic()
    proc = launch(recipe, *overrides, stdout=subprocess.PIPE)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the job hung: still running after {timeout} s\n{out[-5000:]}")
    elapsed = time.monotonic() - start
    print(f"{reward}: exit status {proc.returncode} after {elapsed:.1f} s")
    return proc.returncode, out, elapsed


def root_cause(out: str) -> str:
    """torchrun's summary of the first failed rank."""
    assert "Root Cause (first observed failure)" in out, out[-5000:]
    return out.split("Root Cause (first observed failure)")[1]


def failure_of(status: int, out: str, rank: int) -> str:
    """torchrun's summary of `rank`'s failure, checked to be a failed job's. torchrun names as root cause
    the failure with the smallest timestamp in whole seconds; a peer that sees the lost connection within
    the same second, or a second earlier than torchrun polls, can take that place, so the failed rank is
    looked up among all the summary's failures."""
    assert status != 0
    assert "Failures:" in out, out[-5000:]
    summary = out[out.rindex("Failures:") :]
    for block in re.split(r"\n\s*\[\d+\]:\n", summary)[1:]:
        block = re.split(r"\n[-=]{20,}\n", block)[0]
        if re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)", block):
            return block
    raise AssertionError(f"no failure of rank {rank} in torchrun's summary:\n{summary}")


def first_failure(status: int, out: str, rank: int) -> str:
    """The summary of the job's first failure, checked to be a failed job's and to name `rank`."""
    assert status != 0
    cause = root_cause(out)
    assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)", cause), cause
    return cause


@pytest.mark.slow
def test_rank_that_raises_ends_the_job_with_its_error(tiny_sd3, tmp_path):
    status, out, _ = run_two_ranks(tiny_sd3, tmp_path, "raises_on_rank1")
    # @record on scripts/train.py's main puts rank 1's exception into torchrun's summary.
    cause = failure_of(status, out, rank=1)
    assert "RewardError: reward 'raises_on_rank1' raised" in cause
    assert "injected failure: the reward raised on rank 1 at step 1" in cause
    metrics = [json.loads(line) for line in open(tmp_path / "out/metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0]  # step 0 completed; nothing after the failure


@pytest.mark.slow
def test_killed_rank_ends_the_job(tiny_sd3, tmp_path):
    status, out, _ = run_two_ranks(tiny_sd3, tmp_path, "killed_on_rank1")
    cause = failure_of(status, out, rank=1)
    assert "Signal 9 (SIGKILL)" in cause


@pytest.mark.slow
def test_hung_rank_ends_the_job_after_the_collective_timeout(tiny_sd3, tmp_path):
    """Rank 1 stops answering (its reward never returns); rank 0 waits in the next collective for
    distributed.timeout_s, fails naming the timeout, and torchrun stops rank 1. The test's own limit (240 s)
    is far below the default timeout (600 s): the recipe's timeout must reach the process group."""
    status, out, _ = run_two_ranks(
        tiny_sd3, tmp_path, "hangs_on_rank1", "--distributed.timeout_s", "15", "--reward.timeout_s", "600"
    )
    cause = first_failure(status, out, rank=0)
    assert "Timed out waiting 15000ms" in cause


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def free(lock_file) -> bool:
    """Whether an exclusive flock on the open `lock_file` can be taken now (it is kept if so)."""
    import fcntl

    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@pytest.mark.slow
def test_second_run_on_a_held_directory_and_a_killed_launcher(tiny_sd3, tmp_path):
    """A run holds its output directory: a second torchrun on it fails at once with one error line naming
    the holder (and writes nothing there). SIGKILL of the first run's torchrun (not of its ranks) then
    ends its ranks within seconds, which releases the directory."""
    path = two_rank_recipe(tiny_sd3, tmp_path, 10_000, log={"tensorboard": False}, checkpoint={"every": 2})
    metrics, lock = tmp_path / "out/metrics.jsonl", tmp_path / "out/.lock"
    with open(tmp_path / "first.log", "w") as log:
        first = launch(path, stdout=log)
    workers: list[int] = []
    try:
        end = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < end, "the first run made no progress"
            time.sleep(0.2)
        workers = children(first.pid)
        assert len(workers) == 2
        holder = lock.read_text().strip()
        assert re.fullmatch(rf"pid ({'|'.join(map(str, workers))}) on \S+, since [-\d]+ [:\d]+", holder), (
            holder
        )

        start = time.monotonic()
        second = launch(path, stdout=subprocess.PIPE)
        out, _ = second.communicate(timeout=120)
        print(f"second run: exit {second.returncode} after {time.monotonic() - start:.1f} s")
        assert second.returncode != 0
        lines = [line for line in out.splitlines() if line.startswith("error: ")]
        assert lines == [
            f"error: run.output_dir '{tmp_path / 'out'}' is in use by another run ({holder}): wait for it to "
            "end, stop it, or choose another run.output_dir"
        ], out[-3000:]
        assert f"traceback : {lines[0]}" in root_cause(out)  # torchrun's summary names it too
        for ours in (
            "omnirl",
            "scripts",
            "tests",
        ):  # no traceback through omnirl's code (torchrun prints its own)
            assert f'File "{ROOT / ours}' not in out

        os.kill(first.pid, signal.SIGKILL)  # the launcher only, as a node agent's OOM kill would
        killed = time.monotonic()
        with open(lock) as f:
            # Gone: every rank's main thread exited, and the lock released (by the last of its threads).
            while any(alive(w) for w in workers) or not free(f):
                assert time.monotonic() - killed < 10, "the ranks outlived their launcher by 10 s"
                time.sleep(0.05)
        print(f"ranks gone {time.monotonic() - killed:.2f} s after the launcher was killed")
    finally:  # the ranks run in sessions of their own: a failed test kills them one by one
        for pid in [first.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.wait()


# A run stopped by its environment: one line naming the cause, the complete checkpoints kept.

SMALL = ["--run.steps", "3", "--checkpoint.every", "1", "--rollout.prompts_per_step", "2",
         "--rollout.group_size", "2", "--sampling.num_steps", "2", "--sampling.sde_window_size", "0",
         "--log.tensorboard", "false", "--validation.every", "0"]  # fmt: skip


def stopped_run(tiny_sd3, tmp_path, capsys, monkeypatch) -> tuple[int, str, Path]:
    from tests.test_bad_input import load_train_script

    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = [
        "--recipe",
        "sd3_tiny_flowgrpo",
        "--model.path",
        str(tiny_sd3),
        *SMALL,
        "--run.output_dir",
        str(out),
    ]
    status = load_train_script().main(args)
    err = capsys.readouterr().err
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return status, errors[0], out


def second_call_raises(monkeypatch, module, name: str, exc: BaseException) -> None:
    """`module.name` runs as before on its first call and raises `exc` on its second."""
    original, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.slow  # a tiny run of a few steps in this process
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_ctrl_c_is_one_line_and_keeps_the_checkpoints(tiny_sd3, tmp_path, capsys, monkeypatch):
    import omnirl.trainer

    second_call_raises(monkeypatch, omnirl.trainer, "rollout_step", KeyboardInterrupt())
    status, line, out = stopped_run(tiny_sd3, tmp_path, capsys, monkeypatch)
    assert status == 130
    assert line.startswith(
        f"error: interrupted (Ctrl-C): the complete checkpoints in {out}/checkpoints are kept"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    assert not (out / ".lock").exists()


@pytest.mark.slow  # a tiny run of a few steps in this process
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_disk_full_is_one_line_and_keeps_the_checkpoints(tiny_sd3, tmp_path, capsys, monkeypatch):
    """A full disk while a checkpoint is written (DCP reports each rank's failure in a CheckpointException)
    is one line naming the file; the checkpoint written before it stays whole, the partial one is not one."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    import omnirl.checkpoint

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model_optim/__0_0.distcp")
    second_call_raises(
        monkeypatch, omnirl.checkpoint.dcp, "save", CheckpointException("save", {0: (full, None)})
    )
    status, line, out = stopped_run(tiny_sd3, tmp_path, capsys, monkeypatch)
    assert status == 1
    assert line.startswith(
        "error: no space left on the device writing model_optim/__0_0.distcp: the complete"
    )
    complete = [p.name for p in (out / "checkpoints").iterdir() if not p.name.endswith(".tmp")]
    assert complete == ["step_000001"]
    omnirl.checkpoint.verify(out / "checkpoints/step_000001")  # whole: its manifest holds
