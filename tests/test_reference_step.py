"""benchmarks.reference_step: its mapping of the comparison's settings onto the reference Flow-GRPO trainer's
config, its phase clock, and (where a checkout of the reference and its runtime are at hand) the CPU
rehearsal end to end."""

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import pytest

from benchmarks import reference_step as R
from tests.test_benchmarks import run
from tests.test_train import ROOT


def test_overrides_give_the_comparison_step():
    """The reference's own arithmetic on the overrides: 4 prompts x 8 images, 9 of 10 timesteps trained,
    micro-batches of 8 rows, 2 optimizer steps; the tiny rehearsal keeps 2 optimizer steps."""
    assert R.derived(R.OVERRIDES) == {
        "prompts_per_epoch": 4,
        "images_per_epoch": 32,
        "trained_timesteps": 9,
        "rows_per_micro_batch": 8,
        "optimizer_steps": 2,
    }
    assert R.OVERRIDES["train.batch_size"] == R.derived(R.OVERRIDES)["rows_per_micro_batch"]
    assert R.derived(R.TINY_OVERRIDES)["optimizer_steps"] == 2


def test_never_skips_the_epoch_zero_eval():
    """`epoch % eval_freq == 0` is the reference's eval test: NEVER fails it at every epoch, 0 included."""
    assert isinstance(R.NEVER, int)
    assert all(epoch % R.NEVER != 0 for epoch in range(5))


def test_prompts_and_imp_shim(tmp_path):
    """The prompt files are one plain prompt a line; the `imp` stand-in loads a config file as
    config/grpo.py loads config/base.py."""
    out = R.write_prompts(tmp_path / "p", train=5, test=2)
    assert len((out / "train.txt").read_text().splitlines()) == 5
    assert all('"' in line for line in (out / "test.txt").read_text().splitlines())
    (tmp_path / "base.py").write_text("def get_config():\n    return {'seed': 42}\n")
    assert R.IMP_SHIM.load_source("base_cfg", str(tmp_path / "base.py")).get_config() == {"seed": 42}


def test_phase_clock_reads_the_progress_bars():
    """The bars the reference opens, in its order, make one row per finished epoch and stop the loop
    when epoch N's sampling bar opens."""
    written = []
    clock = R.PhaseClock(epochs=2, budget_s=0.0, on_epoch=lambda: written.append(1))
    bar = clock.wrap(lambda it, *a, **k: it)
    with pytest.raises(R.Stop):
        for epoch in range(3):
            list(bar(range(2), desc=f"Epoch {epoch}: sampling"))
            list(bar(range(2), desc="Waiting for rewards"))
            list(bar(range(2), desc=f"Epoch {epoch}.0: training"))
    rows = clock.epochs_done()
    assert [r["epoch"] for r in rows] == [0, 1] and len(written) == 2
    for r in rows:
        assert r["epoch_s"] == pytest.approx(r["sampling_s"] + r["training_s"])
        assert r["sampling_s"] >= r["generation_s"] + r["reward_wait_s"] - 1e-9
    assert set(R.steady(rows)) == set(R.PHASES)


def reference_checkout() -> Path | None:
    ref = Path(os.environ.get("FLOW_GRPO_DIR", ROOT / ".ref" / "flow_grpo"))
    return ref if (ref / "scripts" / "train_sd3.py").is_file() else None


def missing_runtime() -> str:
    """Why the reference cannot run in this environment, or ''."""
    if reference_checkout() is None:
        return "no flow_grpo checkout (FLOW_GRPO_DIR or .ref/flow_grpo): CI cannot fetch it"
    for module in ("ml_collections", "absl", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (benchmarks/reference_bundle.sh carries it)"
    if tuple(int(x) for x in importlib.metadata.version("accelerate").split(".")[:2]) > (1, 4):
        return "the reference needs accelerate <= 1.4 (its one-process DDP wrapper); see reference_bundle.sh"
    return ""


@pytest.mark.skipif(bool(missing_runtime()), reason=missing_runtime() or "runs")
@pytest.mark.parametrize("weights", [True, False], ids=["saved", "config_only"])
def test_tiny_rehearsal_runs_the_reference(tmp_path, weights):
    """The reference's train_sd3.py, unmodified, for 2 epochs on the tiny SD3 on the CPU: a row per
    epoch with every phase timed, and the reference's commit recorded; from the saved tiny checkpoint
    (the real `from_pretrained`) and from a config-only copy of it (the random-init builder, which the
    GPU runs take)."""
    from omnirl.models import tiny_models

    model = tiny_models()["sd3"](tmp_path / "sd3")
    if not weights:
        for f in model.rglob("*.safetensors"):
            f.unlink()
    out = tmp_path / "ref.json"
    args = ["--ref-dir", str(reference_checkout()), "--tiny", "--model", str(model), "--epochs", "2"]
    run(["python", "-m", "benchmarks.reference_step", *args, "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["epoch"] for r in result["epochs"]] == [0, 1]
    assert all(r[k] > 0 for r in result["epochs"] for k in ("sampling_s", "training_s", "epoch_s"))
    assert result["eval_s"] == [] and result["config"]["train"]["beta"] == 0.04
    assert result["versions"]["accelerate"] == "1.4.0"
