"""Rewards that make rank 1 fail at step 1, for the failure-behaviour tests in test_job_failures.py.

Each scores JPEG compressibility, except on rank 1 (RANK from torchrun), where its second call (step 1 of
a run that scores one batch per rank and step) raises, kills its own process or hangs.
"""

import os
import signal
import time

from omnirl.rewards.jpeg import JpegCompressibility


class _FailsOnRank1:
    modality = "image"

    def __init__(self):
        self.jpeg = JpegCompressibility()
        self.calls = 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 2:
            self.fail()
        return self.jpeg(images, prompts, metadata)


class RaisesOnRank1(_FailsOnRank1):
    def fail(self):
        raise RuntimeError("injected failure: the reward raised on rank 1 at step 1")


class KilledOnRank1(_FailsOnRank1):
    def fail(self):
        print("injected failure: rank 1 kills itself with SIGKILL at step 1", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class HangsOnRank1(_FailsOnRank1):
    def fail(self):
        time.sleep(3600)  # rank 0 then waits in a collective until distributed.timeout_s
