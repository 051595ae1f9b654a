"""Bad input is one clear line `error: ...` with exit status 2 and nothing written to run.output_dir (nor to
the working directory): a model path, data file, row, reward, adapter, override or checkpoint that is wrong,
an impossible value (found when the recipe loads, before anything else is loaded), and values that only
the launch decides."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from omnirl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def load_train_script():
    spec = importlib.util.spec_from_file_location("omnirl_train_script", ROOT / "scripts/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_one_error_line(status: int, capsys, expected: str) -> None:
    """The run ended with exit status 2 and one line on stderr, `error: ...`, that holds `expected`."""
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err


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
        "misspelt flag": (
            ["sd3_tiny_flowgrpo", "--optim.lrr", "1e-4"],
            "error: unrecognized option --optim.lrr (did you mean --optim.lr?)\n",  # the flag alone
        ),
        "missing data file": (
            [
                "sd3_tiny_flowgrpo",
                "--model.path",
                str(tiny_sd3),
                "--data.train_path",
                str(tmp_path / "nope.jsonl"),
            ],
            f"data.train_path: prompt file not found: {tmp_path / 'nope.jsonl'}",
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
    "misspelt flag",
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
    assert_one_error_line(status, capsys, expected)
    assert not out_dir.exists()


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_launcher_keeps_the_one_line_contract(tiny_sd3, tmp_path):
    """`python scripts/train.py --nproc_per_node 2 ...`, README's launch: a mistake the config check finds
    is refused before any rank starts, one which only a rank finds (the data file is read there) is that
    rank's line; the launcher adds nothing (no torchrun banner, no failure summary) and exits 2."""
    launch = [sys.executable, "scripts/train.py", "--nproc_per_node", "2", "--recipe", "sd3_tiny_flowgrpo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = {
        "error: unrecognized option --optim.lrr (did you mean --optim.lr?)\n": ["--optim.lrr", "1e-4"],
        f"error: data.train_path: prompt file not found: {tmp_path / 'nope.jsonl'}\n": [
            "--model.path", str(tiny_sd3), "--data.train_path", str(tmp_path / "nope.jsonl"),
            "--run.output_dir", str(tmp_path / "out"),
        ],
    }  # fmt: skip
    for expected, args in cases.items():
        r = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert (r.returncode, r.stderr) == (2, expected), r.stdout[-2000:]
    assert not (tmp_path / "out").exists()


# Impossible values: found when the recipe loads, before the model (or anything else) is loaded.
IMPOSSIBLE = {
    "no steps": (["--run.steps", "0"], "run.steps must be an integer >= 1, got 0"),
    "negative steps": (["--run.steps", "-1"], "run.steps must be an integer >= 1, got -1"),
    "unknown model weights": (
        ["--model.weights", "random_init"],
        "invalid choice 'random_init' for argument '--model.weights'. Expected one of ('pretrained', "
        "'random')",
    ),
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
    "DPPO tau 0": (["--algo.flow_dppo.tau", "0"], "algo.flow_dppo.tau must be a finite number > 0, got 0.0"),
    "NFT beta 0": (
        ["--algo.diffusion_nft.beta", "0"],
        "algo.diffusion_nft.beta must be a finite number > 0, got 0.0",
    ),
    "NFT old policy decay 1": (
        ["--algo.diffusion_nft.old_decay_max", "1"],
        "algo.diffusion_nft.old_decay_max must be a number in [0, 1), got 1.0",
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
    "no KV window": (
        ["--generation.kv_windows", "0"],
        "generation.kv_windows must be an integer >= 1, got 0",
    ),
    "no slot count": (
        ["--generation.row_buckets", "0"],
        "generation.row_buckets must be an integer >= 1, got 0",
    ),
    "whole layers and parts compiled": (
        ["--generation.compile", "true", "--generation.compile_modules", "RMSNorm"],
        "generation.compile compiles whole decoder layers and generation.compile_modules ['RMSNorm'] parts",
    ),
    "negative KL": (["--algo.kl_beta", "-0.1"], "algo.kl_beta must be a finite number >= 0, got -0.1"),
    "adv_clip 0": (
        ["--algo.adv_clip", "0"],
        "algo.adv_clip must be a finite number > 0, or null (unclamped), got 0.0",
    ),
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
    assert_one_error_line(status, capsys, expected)
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


# A run that training drives to NaN or infinity ends with one line and exit status 1, and exports nothing.
SMALL_RUN = [
    "--rollout.prompts_per_step", "1", "--rollout.group_size", "2", "--sampling.num_steps", "2",
    "--log.image_every", "0", "--log.no-tensorboard", "--checkpoint.every", "0",
    "--export.lora_at_end", "true",
]  # fmt: skip


def assert_nonfinite_run(status: int, err: str, expected: str, out_dir: Path) -> None:
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1, err  # returned: no exception escaped `main` (see `refused_run`)
    assert len(errors) == 1 and errors[0].startswith("error: " + expected), err
    assert (out_dir / "metrics.jsonl").exists() and not (out_dir / "lora").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, under pytest's capture
def test_a_run_that_makes_only_nan_samples_stops(tiny_sd3, tmp_path, capsys, monkeypatch):
    """lr 1e30: step 0's update makes every sample of step 1 NaN. The run stops there, train.on_nonfinite
    skip (the default) or not: the policy is not updated, so it would make NaN samples again."""
    monkeypatch.chdir(ROOT)
    out_dir = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out_dir), "--run.steps", "3", *SMALL_RUN]
    status = load_train_script().main(["--recipe", "sd3_tiny_flowgrpo", *args, "--optim.lr", "1e30"])
    expected = "step 1: all 2 samples hold NaN or infinity; on this rank request 0: "
    assert_nonfinite_run(status, capsys.readouterr().err, expected, out_dir)
    rows = read_metrics(out_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and rows[0]["train/updates"] == 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_run_that_skips_every_update_stops(tiny_sd3, tmp_path, capsys, monkeypatch):
    """Finite samples but a NaN loss in every step (the flow_grpo loss times NaN): every update is skipped,
    so the run has learned nothing and exports nothing."""
    from omnirl.ops.diffusion import DiffusionOps

    loss = DiffusionOps.loss

    def nan_loss(self, *args):
        value, metrics = loss(self, *args)
        return value * float("nan"), metrics

    monkeypatch.setattr(DiffusionOps, "loss", nan_loss)
    monkeypatch.chdir(ROOT)
    out_dir = tmp_path / "out"
    args = ["--model.path", str(tiny_sd3), "--run.output_dir", str(out_dir), "--run.steps", "2", *SMALL_RUN]
    status = load_train_script().main(["--recipe", "sd3_tiny_flowgrpo", *args])
    expected = "every update of the run's 2 steps was skipped (2 for NaN or infinity in samples, a loss or"
    assert_nonfinite_run(status, capsys.readouterr().err, expected, out_dir)


# Data rows the model cannot run: found at the data check (images decoded whole) or, for a prompt's length,
# once the model's tokenizer is loaded and before anything is written.
def noise_png(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def refused_run(args: list[str], tmp_path, capsys, expected: str) -> str:
    """Run `main`: exit 2 (so no exception escaped: in this process it would fail the test), one `error:`
    line starting with `expected` (returned), nothing written. A model's loading progress (and, in a
    pytest session, the logging errors of a library whose handler holds an earlier test's closed stderr)
    may come before it on stderr."""
    out_dir = tmp_path / "out"
    status = load_train_script().main([*args, "--run.output_dir", str(out_dir)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: " + expected), err
    assert not out_dir.exists()
    return errors[0]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_truncated_edit_image_is_refused_at_the_data_check(tmp_path, capsys, monkeypatch):
    """Its header reads, its pixels do not: the data check decodes the image, so the run stops before the
    model loads (here a hub id that is never fetched) instead of at step 0."""
    monkeypatch.chdir(ROOT)  # the recipe's validation rows are relative to the repository root
    whole = noise_png(tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    rows = tmp_path / "edit.jsonl"
    rows.write_text('{"image": "cut.png", "prompt": "Make the sign read \\"OPEN\\""}\n')
    args = ["--recipe", "qwen_image_edit_tiny_flowgrpo", "--model.path", "Qwen/Qwen-Image-Edit"]
    expected = f'{rows}:1: "image" {tmp_path / "cut.png"} is not a readable image (image file is truncated'
    refused_run([*args, "--data.train_path", str(rows)], tmp_path, capsys, expected)


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_overlong_edit_instruction_is_refused_by_row(tiny_qwen_image_edit, tmp_path, capsys, monkeypatch):
    """The edit pipeline does not truncate: an instruction longer than the largest prompt-length bucket is
    refused by file:row once the tokenizer is loaded, not at step 0 with the whole instruction in the
    message."""
    monkeypatch.chdir(ROOT)
    noise_png(tmp_path / "a.png")
    rows = tmp_path / "edit.jsonl"
    instruction = "Make the sign read OPEN. " * 400  # 10 kB
    rows.write_text(json.dumps({"image": "a.png", "prompt": "Make it red"}) + "\n")
    rows.write_text(rows.read_text() + json.dumps({"image": "a.png", "prompt": instruction}) + "\n")
    args = ["--recipe", "qwen_image_edit_tiny_flowgrpo", "--model.path", str(tiny_qwen_image_edit)]
    expected = f"{rows}:2: the instruction ({len(instruction)} characters) with its "
    err = refused_run([*args, "--data.train_path", str(rows)], tmp_path, capsys, expected)
    assert "text tokens, more than the largest of family.prompt_length_buckets (" in err and len(err) < 400


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_mmk12_question_longer_than_the_context_is_refused_by_row(
    tiny_qwen3_omni_thinker, tmp_path, capsys, monkeypatch
):
    """A prompt that cannot fit the model's context with generation.max_new_tokens is refused by file:row
    (as vLLM refuses such a request), not trained on silently or prefilled for minutes."""
    monkeypatch.chdir(ROOT)
    noise_png(tmp_path / "a.png")
    question = "What is 1 + 1? " * 350  # 5 kB
    rows = tmp_path / "mmk12.jsonl"
    rows.write_text(
        json.dumps({"image": "a.png", "question": "What is 1 + 1?", "answer": "2"})
        + "\n"
        + json.dumps({"image": "a.png", "question": question, "answer": "2"})
        + "\n"
    )
    args = [
        "--recipe",
        "mmk12_tiny",
        "--model.path",
        str(tiny_qwen3_omni_thinker),
        "--data.train_path",
        str(rows),
    ]
    expected = f"{rows}:2: the prompt ("
    err = refused_run(args, tmp_path, capsys, expected)
    assert "tokens, which with generation.max_new_tokens 48 is more than the model's context of 1024" in err
