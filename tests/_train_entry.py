"""Run scripts/train.py's main with extra test rewards registered (REWARDS is the one extension dict).

[torchrun ...] python tests/_train_entry.py --recipe PATH [overrides]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from omnirl.rewards import REWARDS  # noqa: E402

REWARDS["constant_on_flagged_rows"] = "tests.support_rewards:ConstantOnFlaggedRows"

from train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
