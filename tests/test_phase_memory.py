"""scripts.gpu.phase_memory: its dry mode (--tiny) end to end on CPU, its plan of a real recipe (--check,
full-size models on the meta device), and its table of a GPU run's metrics row (CPU runs log no peaks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = "scripts.gpu.phase_memory"


def phase_memory():
    from scripts.gpu import phase_memory

    return phase_memory


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(
        [sys.executable, "-m", MODULE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


@pytest.mark.slow
def test_tiny_run_reports_rollout_and_train_phases(tmp_path):
    """The SD3.5 recipe's dry mode: the tiny SD3 recipe through the same data generator, random-init loader
    and trainer entry, 2 prompts x max_num_seqs / 2 images per step, two steps; the table and the JSON."""
    r = run("--recipe", "yaml/sd35_flowgrpo_ocr", "--tiny", "--steps", "2", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "sd35_flowgrpo_ocr_tiny.json").read_text())
    table = (tmp_path / "sd35_flowgrpo_ocr_tiny.md").read_text()
    assert summary["rc"] == 0 and summary["problems"] == []
    assert summary["source_recipe"] == "yaml/sd3_tiny_flowgrpo.yaml"
    s = summary["settings"]
    assert (s["prompts_per_step"], s["group_size"], s["max_num_seqs"]) == (2, 16, 32)
    assert (s["micro_batch_size"], s["sleep"], s["lora_rank"]) == (64, "auto", 8)  # the recipe's
    assert s["reward_weights"] == {"jpeg_compressibility": 1.0, "uniform_noise": 0.001}
    assert [x["subfolder"] for x in summary["device"]["loads"]][:2] == ["transformer", "vae"]

    steps = summary["per_step"]
    assert [x["step"] for x in steps] == [0, 1]
    for x in steps:
        assert list(x["phases"]) == ["rollout", "train"] and x["optimizer_steps"] == 1
    # Step 1: rollout sleeps the optimizer state that training wakes, and wakes the text encoders and
    # VAE that training put to sleep; step 0's rollout has no optimizer state to sleep yet.
    rollout, train = steps[1]["phases"]["rollout"], steps[1]["phases"]["train"]
    assert rollout["sleep_gib"] == train["wake_gib"] > 0
    assert rollout["wake_gib"] == train["sleep_gib"] > rollout["sleep_gib"]
    assert steps[0]["phases"]["rollout"]["sleep_gib"] == 0
    for text in (table, r.stdout, summary["table"]):
        assert "**sd35_flowgrpo_ocr_tiny, step 1**" in text
        assert "| rollout | " in text and "| train | " in text


@pytest.mark.slow
def test_check_plans_the_edit_recipe_on_full_size_models(tmp_path):
    """--check for Qwen-Image-Edit: the config-only checkpoint (random_init's Qwen-Image-Edit layout) builds
    the full-size models on the meta device, and every step's 32 requests (512 px sign sources from
    make_edit_data) are one packed batch padded to the 384-token text bucket: the tokenizer's template
    prefix is the 64 tokens the pipeline drops, and a 512 px condition image is 324 vision tokens."""
    r = run("--recipe", "qwen_image_edit_flowgrpo", "--check", "--out", str(tmp_path))
    plan = json.loads(r.stdout[r.stdout.index("{") :])
    models = plan["models"]
    assert 20 < models["transformer"]["params_b"] < 21 and 8 < models["text_encoder"]["params_b"] < 9
    assert 400 < models["transformer"]["lora_params_m"] < 450  # rank 64 on the 12 target modules
    for step in plan["steps"]:
        (batch,) = step["batches"]
        assert batch["requests"] == step["requests"] == 32
        assert batch["key_tail"] == "((512, 512), 0)"  # condition size; no negative length (fused CFG)
        # Both CFG rows of 1,024 generated + 1,024 condition image tokens + the text padded to its bucket.
        assert batch["tokens_per_request"] == 2 * (1024 + 1024 + 384)
        assert (step["train_rows"], step["micro_batches"]) == (64, 32)  # SDE window 2, micro-batch 2


@pytest.mark.slow
def test_check_plans_a_wan_recipe_with_its_reward_replaced(tmp_path):
    """--reward replaces the recipe's rewards and drops their reward.paths (the Wan recipe's HPSv3): the
    worker's reward check runs before torchrun, so the derived recipe must pass it. Wan2.2 TI2V-5B at
    704x1280 and 9 frames packs 16 videos of 3 x 22 x 40 = 2,640 tokens; 5 trained steps a video in
    micro-batches of 4."""
    r = run(
        *("--recipe", "wan22_ti2v_dancegrpo", "--check", "--out", str(tmp_path), "--model.finetune", "lora"),
        *("--rollout.prompts_per_step", "2", "--rollout.group_size", "8", "--reward", "video_brightness=1"),
    )
    plan = json.loads(r.stdout[r.stdout.index("{") :])
    for step in plan["steps"]:
        (batch,) = step["batches"]
        assert batch["requests"] == 16 and batch["tokens_per_request"] == 2640
        assert (step["train_rows"], step["micro_batches"]) == (80, 20)


def test_table_of_a_gpu_row():
    """Per-rank peaks, sleep/wake traffic and a phase beyond rollout and train, in the order logged."""
    from scripts.gpu import step_report as pm

    row = {
        "step": 1, "time/step_s": 61.25, "time/generate_s": 30.5, "time/score_wait_s": 0.25,
        "mem/host_gib": 21.0, "train/updates": 2.0,
        "time/rollout_s": 31.0, "mem/rollout_peak_gib": 88.75, "mem/rollout_peak_gib/rank0": 88.75,
        "mem/rollout_peak_gib/rank1": 87.5, "mem/rollout_sleep_gib": 3.25, "time/rollout_sleep_s": 0.08,
        "mem/rollout_wake_gib": 16.5, "time/rollout_wake_s": 0.375,
        "time/train_s": 25.0, "mem/train_peak_gib": 94.25, "mem/train_peak_gib/rank0": 94.25,
        "mem/train_peak_gib/rank1": 93.0, "mem/train_sleep_gib": 16.5, "time/train_sleep_s": 0.34,
        "mem/train_wake_gib": 3.25, "time/train_wake_s": 0.07,
        "time/validate_s": 12.0, "mem/validate_peak_gib": 70.0, "mem/validate_peak_gib/rank0": 70.0,
        "mem/validate_peak_gib/rank1": 69.0, "mem/validate_wake_gib": 0.0, "time/validate_wake_s": 0.0,
        "mem/validate_sleep_gib": 0.0, "time/validate_sleep_s": 0.0,
        "time/generate_s/rank0": 30.5, "time/generate_s/rank1": 29.0, "reward/mean": 0.5,
    }  # fmt: skip
    lines = pm.step_table(row, "qwen_image_flowgrpo_ocr, ").splitlines()
    assert lines[0] == (
        "**qwen_image_flowgrpo_ocr, step 1** (step 61.2 s; generation 30.5 s, scoring wait 0.25 s; "
        "host buffers 21.0 GiB; optimizer steps 2)"
    )
    assert lines[2].startswith("| phase | work s | peak GiB | to host GiB |")
    assert lines[4:] == [
        "| rollout | 31.0 | 88.8 (88.8 / 87.5) | 3.25 | 0.08 | 16.50 | 0.38 |",
        "| train | 25.0 | 94.2 (94.2 / 93.0) | 16.50 | 0.34 | 3.25 | 0.07 |",
        "| validate | 12.0 | 70.0 (70.0 / 69.0) | 0.00 | 0.00 | 0.00 | 0.00 |",
    ]
    stats = pm.summarise_steps([row])[0]
    assert stats["phases"]["train"]["peak_gib_per_rank"] == [94.25, 93.0]
    assert stats["phases"]["train"]["sleep_gib_per_s"] == 16.5 / 0.34
    assert stats["phases"]["validate"]["sleep_gib_per_s"] is None
    # One rank: the peak alone; a CPU row (no peaks, no sleeper): "-".
    one = {k: v for k, v in row.items() if "/rank1" not in k}
    assert "| rollout | 31.0 | 88.8 | 3.25 |" in pm.step_table(one)
    # Sol-RL (rollout.fp8.select): the bf16 regeneration of the chosen samples, in the line and the JSON.
    sol = {**one, "time/regenerate_s": 7.25}
    assert "scoring wait 0.25 s; bf16 regeneration 7.2 s; host" in pm.step_table(sol).splitlines()[0]
    assert pm.summarise_steps([sol])[0]["regenerate_s"] == 7.25
    decoded = {**one, "time/vae_decode_s": 4.5}
    assert "generation 30.5 s (VAE decode 4.50 s), scoring" in pm.step_table(decoded).splitlines()[0]
    assert pm.summarise_steps([decoded])[0]["vae_decode_s"] == 4.5
    cpu = {"step": 0, "time/rollout_s": 1.0, "time/train_s": 2.0}
    assert pm.step_table(cpu).splitlines()[4:] == [
        "| rollout | 1.0 | - | - | - | - | - |",
        "| train | 2.0 | - | - | - | - | - |",
    ]


@pytest.mark.slow
def test_tiny_run_of_a_wan_recipe(tmp_path):
    """The Wan2.2 A14B recipe's dry mode: its tiny two-expert recipe through the random-init loader
    (both experts, the VAE and UMT5 built by it) and the trainer, one step with an update."""
    run("--recipe", "wan22_a14b_flowgrpo_lora", "--tiny", "--steps", "1", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "wan22_a14b_flowgrpo_lora_tiny.json").read_text())
    assert summary["rc"] == 0 and summary["problems"] == []
    assert summary["source_recipe"] == "yaml/wan22_a14b_tiny_flowgrpo_lora.yaml"
    assert " videos per step" in summary["table"] and " videos/s per GPU" in summary["table"]
    loads = [x["subfolder"] for x in summary["device"]["loads"]]
    assert loads == ["transformer", "transformer_2", "vae", "text_encoder"]
    (step,) = summary["per_step"]
    assert list(step["phases"]) == ["rollout", "train"] and step["optimizer_steps"] == 1
    # each phase traced as it starts and ends (what a run stopped mid-step reports)
    traced = summary["device"]["phases"]
    assert [p["phase"] for p in traced] == ["rollout", "train"], traced
    assert 0 < traced[0]["start_s"] < traced[0]["end_s"] <= traced[1]["start_s"] < traced[1]["end_s"]


def test_a_run_stopped_mid_step_names_its_phase():
    pm = phase_memory()
    phases = [
        {"phase": "rollout", "start_s": 150.0, "end_s": 210.0},
        {"phase": "train", "start_s": 211.0, "end_s": None},
    ]
    assert pm.last_phase({"phases": phases}, 440) == (
        "in train phase number 1, started 211 s after the trainer did, still running at the end (440 s into "
        "the run)"
    )
    assert pm.last_phase({"phases": phases[:1]}, 440).endswith("started 150 s after the trainer did, ended")
    assert pm.last_phase({}, 10) is None and pm.last_phase({"phases": []}, 10) is None


def test_rewards_without_their_weights_are_left_out(tmp_path):
    """A reward whose local checkpoint (reward.paths) is not on the machine is left out, as one whose
    packages are missing is: the Wan recipes' HPSv3; uniform_noise then gives the groups their spread."""
    pm = phase_memory()
    weights, dropped = pm.reward_weights({"hpsv3": 1.0}, 1e-3, {"hpsv3": "checkpoints/no_such_hpsv3"})
    assert (weights, dropped) == ({"uniform_noise": 1.0}, ["hpsv3"])
    kept = {"video_brightness": 1.0, "hpsv3": 0.5}
    weights, dropped = pm.reward_weights(kept, 1e-3, {"hpsv3": str(tmp_path)})  # an existing folder
    assert (weights, dropped) == ({**kept, "uniform_noise": 1e-3}, [])


def test_the_step_split_takes_the_vae_decode_out_of_the_generation():
    """The split's parts add up to the step: the VAE decode, timed inside the generation, is its own part,
    the generation keeps the rest, and what no part names is "other"."""
    from scripts.gpu import step_report as pm

    def row(step: int, scale: float) -> dict:
        return {
            "step": step, "time/step_s": 20.0 * scale, "time/generate_s": 6.0 * scale,
            "time/vae_decode_s": 1.5 * scale, "time/score_wait_s": 0.5 * scale, "time/train_forward_s": 4.0,
            "time/train_backward_s": 5.0, "time/train_optimizer_s": 0.25, "time/rollout_sleep_s": 0.25,
            "time/train_wake_s": 0.25, "time/rollout_s": 6.5 * scale, "time/train_s": 9.5,
        }  # fmt: skip

    split = pm.step_split([row(0, 3.0), row(1, 1.0), row(2, 1.0)], None)
    parts = {name: v["median"] for name, v in split["parts"].items()}
    assert parts["generation"] == 4.5 and parts["vae decode"] == 1.5 and parts["scoring wait"] == 0.5
    assert parts["sleep/wake"] == 0.5 and parts["update forward"] == 4.0
    named = sum(v for k, v in parts.items() if k not in ("other", "step", "rollout", "update"))
    assert parts["other"] == pytest.approx(20.0 - named) and parts["step"] == 20.0
    assert split["step0"]["vae decode"] == 4.5 and split["steady_steps"] == [1, 2]
    assert "| vae decode | 1.50 (1.50-1.50) | 4.50 |" in pm.split_table(split, None)
    assert "images_per_s" not in split and "compile" not in split
    # Images per second per GPU with no FLOP count (a family whose prompts have their own lengths); the
    # compile time and graphs each step logs, inside the parts.
    rows = [
        {**row(s, k), "time/compile_s": c, "compile/graphs": g}
        for s, k, c, g in ((0, 3.0, 30.0, 4), (1, 1, 0, 0))
    ]
    split = pm.step_split(rows, None, 32 / 2)
    assert split["images_per_s"] == 16 / 20.0
    assert split["compile"] == {
        "step0_s": 30.0, "step0_rollout_s": None, "step0_graphs": 4, "steady_s": 0.0, "steady_graphs": 0.0
    }  # fmt: skip
    assert "compiling: step 0 30.0 s for 4 graphs, the steady steps 0.0 s for 0" in pm.split_table(
        split, None
    )


def test_step_0s_memory_probes_compiling_and_pinning_are_split_out():
    """Step 0's first-touch costs apart: the rollout's memory probes (timed inside the generation) and
    the update's checkpointing probe are parts of their own, the compile time says the rollout's share,
    and the host chunks pinned beside the rollout are named, not counted in the step's parts."""
    from scripts.gpu import step_report as pm

    first = {
        "step": 0, "time/step_s": 40.0, "time/generate_s": 15.0, "time/vae_decode_s": 0.5,
        "time/memory_probe_s": 2.5, "time/train_memory_probe_s": 1.5, "time/train_forward_s": 8.0,
        "time/compile_s": 9.0, "time/rollout_compile_s": 5.0, "compile/graphs": 10.0,
        "time/host_pin_s": 3.25,
    }  # fmt: skip
    steady = {"step": 1, "time/step_s": 17.0, "time/generate_s": 4.0, "time/train_forward_s": 4.0}
    split = pm.step_split([first, steady], None)
    zero = split["step0"]
    assert zero["generation"] == 12.0 and zero["rollout memory probe"] == 2.5
    assert zero["update memory probe"] == 1.5 and zero["other"] == pytest.approx(
        40.0 - 12.0 - 0.5 - 2.5 - 9.5
    )
    assert split["parts"]["rollout memory probe"]["median"] == 0.0
    table = pm.split_table(split, None)
    assert "| rollout memory probe | 0.00 (0.00-0.00) | 2.50 |" in table
    assert "step 0 9.0 s for 10 graphs, 5.0 s of it in the rollout" in table
    assert "step 0 pinned the host chunks in 3.25 s beside its rollout" in table
