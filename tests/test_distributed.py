"""omnirl.distributed and the trainer's cross-rank metrics on 2 ranks (torchrun, gloo)."""

import os
import subprocess
import sys

import pytest

from tests.test_train import ROOT


def two_ranks(script: str, *args: str) -> str:
    """stdout of `script` run by torchrun on 2 ranks (gloo); a failure shows its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run([*cmd, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


@pytest.mark.slow
def test_bf16_load_pretrained_and_per_rank_metrics_on_two_ranks(tiny_qwen_image, tiny_qwen3_omni_thinker):
    out = two_ranks("tests/_dist_checks.py", str(tiny_qwen_image), str(tiny_qwen3_omni_thinker))
    assert out.count("dist checks OK") == 2


@pytest.mark.slow
def test_fsdp_bf16_keeps_omni_rollout_and_trainer_logprobs(tiny_qwen3_omni_thinker):
    """FSDP2 with bf16 compute gives the plain bf16 model's samples and log-probs (rollout and trainer) on
    prompts whose M-RoPE positions bf16 cannot hold (tests/_fsdp_bf16_omni.py)."""
    assert (
        two_ranks("tests/_fsdp_bf16_omni.py", str(tiny_qwen3_omni_thinker)).count("fsdp bf16 checks OK") == 2
    )
