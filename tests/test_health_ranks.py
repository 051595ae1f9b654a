"""The run's self-checks on 2 ranks (torchrun, gloo): the monitors and the parity gate read the same
all-reduced numbers on every rank, and a check that fails on one rank only stops every rank at the same
step, with one `error:` line."""

import json
import os
import subprocess
import sys

import pytest

from omnirl.metrics import read_metrics
from tests.test_health import ROOT


@pytest.mark.slow
def test_two_ranks_decide_together(tiny_sd3, tmp_path):
    """Rank 1 alone has a perturbed rollout (2e-4 at timestep index 0) and an update that did not reach
    its module (tests/_health_ranks.py): both ranks log the same health metrics, parity gap included, and
    both stop after step 0 with rank 1's line, printed once."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(29300 + os.getpid() % 300), "-m", "tests._health_ranks",
        "--recipe", "sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--run.output_dir", str(out),
        "--run.steps", "3", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--sampling.num_steps", "2", "--log.image_every", "0", "--log.no-tensorboard",
        "--checkpoint.every", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    health = {}
    for line in r.stdout.splitlines():
        if " health {" in line:
            rank, step = int(line.split()[1]), int(line.split()[3])
            health[rank, step] = json.loads(line.split(" health ", 1)[1])
    assert set(health) == {(0, 0), (1, 0)}, r.stdout[-3000:]
    assert health[0, 0] == health[1, 0]  # the same decisions' inputs on both ranks
    assert 1e-5 < health[0, 0]["health/parity_gap"] < 1e-3  # rank 0 sees rank 1's gap, under the tolerance
    assert "health/diversity" in health[0, 0]
    stops = sorted(line for line in r.stdout.splitlines() if " stopped: " in line)
    expected = "stopped: step 0: the first optimizer step left the rollout's module unchanged"
    assert len(stops) == 2 and all(expected in s for s in stops), r.stdout[-3000:]
    assert stops[0].split(" stopped: ")[1] == stops[1].split(" stopped: ")[1]  # rank 1's line on both
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected.removeprefix("stopped: ") in errors[0], r.stderr[-3000:]
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [0]
