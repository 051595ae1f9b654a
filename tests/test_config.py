"""Recipes parse strictly; bad keys, types and missing values are errors that name key and file."""

import subprocess
import sys
from pathlib import Path

import pytest

from omnirl.config import RECIPE_DIR
from omnirl.errors import ConfigError
from omnirl.recipe import check_required, config_for, config_from_dict, load_config, load_recipe

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def test_there_are_recipes():
    assert "sd3_tiny_flowgrpo" in RECIPES and "sd35_flowgrpo_ocr" in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_parses(name):
    cfg, path = load_recipe(name)
    check_required(cfg, str(path))
    assert path.read_text().startswith("#"), "each recipe opens with its launch command"
    assert f"--recipe {name}" in path.read_text().splitlines()[0] + path.read_text().splitlines()[1]


def test_unknown_key_names_key_and_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"r\.yaml.*unknown key 'optim\.lrr'"):
        load_recipe(str(f))
    f.write_text("optimizer:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="unknown key 'optimizer'"):
        load_recipe(str(f))


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"x\.yaml: optim\.micro_batch_size: expected an integer"):
        config_from_dict({"optim": {"micro_batch_size": "eight"}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"sampling\.sde_type: expected one of"):
        config_from_dict({"sampling": {"sde_type": "euler"}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"sampling\.sde_window_range: expected a list of 2"):
        config_from_dict({"sampling": {"sde_window_range": [1, 2, 3]}}, "x.yaml")


def test_yaml_exponent_without_dot_is_a_float():
    cfg = config_from_dict({"optim": {"lr": "3e-4"}, "reward": {"weights": {"ocr": 1}}})
    assert cfg.optim.lr == 3e-4 and cfg.reward.weights == {"ocr": 1.0}


def test_missing_required_value(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("data:\n  train_path: p.jsonl\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: missing required value 'model\.path'"):
        load_config(str(f), [])


def test_unknown_recipe_lists_known():
    with pytest.raises(ConfigError, match="unknown recipe 'nope'.*sd3_tiny_flowgrpo"):
        load_config("nope", [])


def test_cli_overrides(tmp_path):
    args = ["--model.path", str(tmp_path), "--optim.lr", "1e-4", "--sampling.sde_window_range", "1", "3"]
    cfg = load_config("sd3_tiny_flowgrpo", args)
    assert cfg.optim.lr == 1e-4 and cfg.sampling.sde_window_range == (1, 3)


@pytest.mark.slow
def test_train_script_errors_are_one_line():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [sys.executable, "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo", "--optim.nope", "1"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "optim.nope" in r.stderr
    r = subprocess.run(
        [sys.executable, "scripts/train.py", "--recipe", "missing_recipe"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "unknown recipe" in r.stderr


@pytest.mark.slow
def test_help_documents_every_field():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [sys.executable, "scripts/train.py", "--recipe", "sd3_tiny_flowgrpo", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0
    assert "--optim.lr" in r.stdout and "AdamW learning rate" in r.stdout
    assert "--sampling.noise-level" in r.stdout or "--sampling.noise_level" in r.stdout


def test_family_settings_are_the_adapters_and_strict(tmp_path):
    # The tiny recipes' model.path names a folder under tiny_models/, which this check never reads: a folder
    # that exists, whatever tiny models the working tree holds.
    path = ["--model.path", str(tmp_path)]
    cfg = load_config("qwen_image_tiny_flowgrpo", [*path, "--family.prompt_length_buckets", "16", "48"])
    assert type(cfg.family).__name__ == "QwenImageSettings" and cfg.family.prompt_length_buckets == [16, 48]
    assert load_config("sd3_tiny_flowgrpo", path).family == config_for("sd3").family
    with pytest.raises(ConfigError, match="unknown key 'family.condition_area'"):
        config_from_dict({"model": {"adapter": "qwen_image"}, "family": {"condition_area": 4}})
    with pytest.raises(ConfigError, match="family.prompt_length_buckets: expected a list"):
        config_from_dict({"model": {"adapter": "qwen_image"}, "family": {"prompt_length_buckets": 64}})
    with pytest.raises(ConfigError, match="family.prompt_length_buckets must be distinct ascending"):
        load_config("qwen_image_tiny_flowgrpo", [*path, "--family.prompt_length_buckets", "64", "32"])
    with pytest.raises(ConfigError, match="unknown adapter 'nope'"):
        config_from_dict({"model": {"adapter": "nope"}})
    # --model.adapter decides which family section the recipe's keys are checked against.
    with pytest.raises(ConfigError, match="unknown key 'family.prompt_length_buckets'"):
        load_config("qwen_image_tiny_flowgrpo", [*path, "--model.adapter", "sd3"])


@pytest.mark.slow
def test_reward_of_another_modality_fails_before_loading(tmp_path):
    """An image model paired with a text reward: one error line naming both, before any model loads."""
    root = Path(__file__).resolve().parent.parent
    recipe = tmp_path / "bad.yaml"
    out = tmp_path / "out"
    text = (RECIPE_DIR / "sd3_tiny_flowgrpo.yaml").read_text()
    text = text.replace(
        "weights: {jpeg_compressibility: 1.0}", "weights: {jpeg_compressibility: 1.0, mmk12: 1.0}"
    )
    recipe.write_text(text.replace("output_dir: outputs/sd3_tiny_flowgrpo", f"output_dir: {out}"))
    cmd = [
        sys.executable,
        "scripts/train.py",
        "--recipe",
        str(recipe),
        "--model.path",
        str(tmp_path),  # no model there: loading one would fail, and the check comes first
    ]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    line = "error: reward 'mmk12' reads text outputs, but model.adapter 'sd3' produces image, latent"
    assert r.stderr.strip().splitlines()[-1] == line and "Traceback" not in r.stderr
    assert not out.exists()


def test_booleans_take_true_and_false_as_well_as_the_no_form(tmp_path):
    path = ["--model.path", str(tmp_path)]
    cfg = load_config("sd3_tiny_flowgrpo", [*path, "--log.tensorboard", "false", "--rollout.fused_cfg=False"])
    assert cfg.log.tensorboard is False and cfg.rollout.fused_cfg is False
    cfg = load_config(
        "sd3_tiny_flowgrpo", [*path, "--log.no-tensorboard", "--model.gradient-checkpointing", "TRUE"]
    )
    assert cfg.log.tensorboard is False and cfg.model.gradient_checkpointing is True
    cfg = load_config("sd3_tiny_flowgrpo", [*path, "--model.gradient_checkpointing", "--run.name", "false"])
    assert cfg.model.gradient_checkpointing is True and cfg.run.name == "false"  # a string stays a string


@pytest.mark.parametrize("path", ["/no/such/model", "./nope", "~/nope", "a/b/c", "tests/no_such_model"])
def test_missing_local_model_path_fails_without_a_hub_lookup(path, monkeypatch):
    """A path no hub id looks like fails when the recipe loads; `org/name` (or a name) may be a hub id."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # tests/ exists: tests/x is local
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError, match=rf"model\.path '{path}' does not exist \(a local path: it is not looked"
    ):
        load_config("sd3_tiny_flowgrpo", ["--model.path", path])
    assert load_config("sd3_tiny_flowgrpo", ["--model.path", "org/model"]).model.path == "org/model"


def test_quickstart_rendezvous_takes_a_free_port():
    """The quickstart launches through scripts/train.py, whose launcher starts the ranks as `torchrun
    --standalone` does: a rendezvous on a free local port."""
    root = Path(__file__).resolve().parent.parent
    script = (root / "scripts/quickstart.sh").read_text()
    assert "python scripts/train.py --nproc_per_node 2" in script and "master_port" not in script
    assert '["--standalone", "--nproc_per_node", nproc' in (root / "scripts/train.py").read_text()


def test_sd35_recipe_uses_flow_grpos_advantages_and_kl():
    """flow_grpo's SD3 configs normalise advantages by the std of all the step's rewards (global_std) and
    weigh its KL form (kl_beta 0.04 with s_t before sqrt(|dt|))."""
    cfg, _ = load_recipe("sd35_flowgrpo_ocr")
    assert cfg.algo.global_std and cfg.algo.kl_beta == 0.04 and cfg.algo.kl_form == "flow_grpo"


def test_help_is_the_recipes_sections_and_help_all_every_field():
    """--help: the recipe's header, the fields it sets with their values and documentation, the rest of
    those sections by name, every recipe, and where the rest is; --help-all: every field of every section.
    Both wrap whole paragraphs to the width (no docstring's source line break inside them)."""
    import dataclasses
    import typing

    from omnirl.cli_help import help_text
    from omnirl.config_checks import sections

    cfg, source = load_recipe("sd3_tiny_flowgrpo")
    short = help_text(cfg, source, full=False, width=80)
    assert "\n\nyaml/sd3_tiny_flowgrpo.yaml: The quickstart: Flow-GRPO" in short
    assert "  --optim.lr float = 0.01\n      AdamW learning rate.\n" in short
    assert "--generation." not in short  # an omni section the recipe does not set
    assert "--rollout.vllm." not in short and "--rollout.vllm." in help_text(cfg, source, full=True)
    assert "also: " in short and all(name in short for name in RECIPES) and "--help-all" in short
    full = help_text(cfg, source, full=True, width=80)
    for name, cls in sections(type(cfg)):  # a component's section inside its parent's too (algo.dgpo)
        leaves = [
            f
            for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
        ]
        assert leaves and all(f"  --{name}.{f.name} " in full for f in leaves), name
    # A docstring written over two source lines is one paragraph, wrapped only at the width.
    wide = help_text(cfg, source, full=True, width=200)
    doc = (
        "Rows per training forward/backward: (sample, trained step) pairs of a diffusion model, responses of"
    )
    assert f"\n      {doc} an omni model.\n" in wide
    for text in (short, full, help_text(None, None, full=False, width=80)):
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "{None}" not in text
    no_recipe = help_text(None, None, full=False, width=80)
    assert "--recipe NAME --help" in no_recipe and "mmk12_tiny" in no_recipe
