"""What the tests, the tiny recipes and the measuring scripts build, and nothing in the training path
imports: the tiny reward models (`rewards`), the tiny Qwen3-Omni taught the MMK12 answer format (`k12`),
and `TINY_MODELS`, every tiny checkpoint by the name `scripts/make_tiny_models.py --only` takes (the
families' own, read off the registry: `omnirl.models.tiny_models`). The top floor of the package: it may
import any module of omnirl, and no module of omnirl imports it."""

from __future__ import annotations

from omnirl.models import tiny_models
from omnirl.testing.k12 import make_tiny_qwen3_omni_k12
from omnirl.testing.rewards import make_tiny_clap, make_tiny_dina_lrm, make_tiny_pickscore

# The reward models by their REWARDS name; the taught thinker by its family's name and what it learned.
FIXTURES = {
    "qwen3_omni_thinker_k12": make_tiny_qwen3_omni_k12,
    "pickscore": make_tiny_pickscore,
    "dina_lrm": make_tiny_dina_lrm,
    "clap": make_tiny_clap,
}
TINY_MODELS = {**tiny_models(), **FIXTURES}
