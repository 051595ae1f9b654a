"""scripts/train.py's main on 2 ranks, where rank 1 sees what rank 0 does not: its rollout's recorded
log-probs at timestep index 0 are off by 2e-4 (under the parity tolerance), and its LoRA fingerprint reads
after the first optimizer step as before it (an update that did not reach its module). Each rank prints the
health metrics of every step and the line it stopped with.

torchrun --nproc_per_node 2 -m tests._health_ranks --recipe sd3_tiny_flowgrpo [overrides]   (repository root)
"""

import json
import os
import sys

from omnirl.health import Health, HealthError
from omnirl.health import lora as L
from omnirl.ops.diffusion import DiffusionOps

RANK = int(os.environ["RANK"])

if RANK == 1:
    generate = DiffusionOps.generate

    def perturbed(self, requests, on_done):
        trajs = generate(self, requests, on_done)
        for t in trajs:
            t.logprobs = t.logprobs + 2e-4 * (t.step_indices == 0)
        return trajs

    DiffusionOps.generate = perturbed
    fingerprint = L.fingerprint
    first: list[dict[str, float]] = []

    def stale(trained, full):
        first.append(fingerprint(trained, full))  # the real one: a collective under FSDP2
        return first[0]

    L.fingerprint = stale

after_step = Health.after_step


def say(line: str) -> None:
    """One line in one write: both ranks share the pipe, and print's separate write of its newline lets
    the other rank's line land between the two."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def printed(self, step, logs, *args):
    out = after_step(self, step, logs, *args)
    say(f"rank {RANK} step {step} health {json.dumps(out, sort_keys=True)}")
    return out


stop_if_needed = Health.stop_if_needed


def stopped(self, save):
    try:
        stop_if_needed(self, save)
    except HealthError as e:
        say(f"rank {RANK} stopped: {e}")
        raise


Health.after_step = printed
Health.stop_if_needed = stopped

from scripts.train import exit_now, main  # noqa: E402  (after the patches above)

if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
