"""Run scripts/train.py's main with extra test rewards registered (REWARDS is the one extension dict),
and, when OMNIRL_TEST_HOLD_COMMIT is set, rank 0 held before committing that checkpoint.

[torchrun ...] python -m tests._train_entry --recipe PATH [overrides]   (from the repository root)
"""

import os
import sys
import time

from omnirl.rewards import REWARDS

REWARDS["constant_on_flagged_rows"] = "tests.support_rewards:ConstantOnFlaggedRows"
REWARDS["mmk12_zero_on_flagged_rows"] = "tests.support_rewards:Mmk12ZeroOnFlaggedRows"
REWARDS["raises_on_rank1"] = "tests.support_failures:RaisesOnRank1"
REWARDS["killed_on_rank1"] = "tests.support_failures:KilledOnRank1"
REWARDS["hangs_on_rank1"] = "tests.support_failures:HangsOnRank1"

if hold := os.environ.get("OMNIRL_TEST_HOLD_COMMIT"):
    # test_checkpoint_resume.py kills the job while the checkpoint `hold` (e.g. step_000004) is written but
    # not yet renamed into place: rank 0 waits here, before the rename, until it is killed.
    from omnirl import checkpoint

    commit = checkpoint.commit

    def held_commit(tmp, final, keep):
        while final.name == hold:
            time.sleep(1)
        commit(tmp, final, keep)

    checkpoint.commit = held_commit

from scripts.train import exit_now, main  # noqa: E402  (after the patches above)

if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
