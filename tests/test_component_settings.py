"""A component's own settings are a section inside its parent's: each loss's (`algo.<loss>.*`, named as in
LOSSES), the vLLM backend's (`rollout.vllm.*`) and FP8's (`rollout.fp8.*`). They are typed, parsed,
range-checked and shown in --help as the family's section is; their old flat names (`algo.nft_beta`,
`rollout.fp8_select`, ...) are refused with one line naming the new one, exit status 2, nothing written."""

import dataclasses
import typing

import pytest
import yaml

from omnirl.algos.losses import LOSSES
from omnirl.config import Config
from omnirl.config_checks import subsections
from omnirl.errors import ConfigError
from omnirl.recipe import RENAMED, config_from_dict, load_config
from tests.test_bad_input import ROOT, assert_one_error_line, load_train_script

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

NUMBERS = (int, float, float | None)


def test_every_component_section_has_its_ranges_and_a_loss_section_its_loss():
    sections = dict(subsections(Config))
    assert {"algo.flow_dppo", "algo.diffusion_nft", "algo.dgpo", "rollout.vllm", "rollout.fp8"} == set(
        sections
    )
    for name, cls in sections.items():  # a number without a range would pass the check unseen
        hints = typing.get_type_hints(cls)
        numbers = {f.name for f in dataclasses.fields(cls) if hints[f.name] in NUMBERS}
        assert numbers <= set(cls.RANGES), name
    assert {name.removeprefix("algo.") for name in sections if name.startswith("algo.")} <= set(LOSSES)
    # Every old name points at a field that exists.
    for new in RENAMED.values():
        section, _, field = new.rpartition(".")
        assert field in {f.name for f in dataclasses.fields(sections[section])}, new


def test_a_recipe_sets_a_component_section_strictly(tmp_path):
    path = ["--model.path", str(tmp_path)]
    cfg = load_config("sd3_tiny_nft", [*path, "--algo.diffusion_nft.beta", "0.25"])
    assert cfg.algo.diffusion_nft.beta == 0.25 and cfg.algo.diffusion_nft.old_decay_max == 0.5  # the recipe's
    cfg = load_config("sd3_tiny_flowgrpo", [*path, "--rollout.precision", "fp8", "--rollout.fp8.select", "1"])
    assert cfg.rollout.fp8.select == 1 and cfg.rollout.fp8.steps == "all"  # Sol-RL explores at every step
    cfg = load_config("sd3_tiny_flowgrpo", [*path, "--rollout.fp8.fast_accum", "false"])
    assert cfg.rollout.fp8.fast_accum is False
    cfg = load_config("sd3_tiny_flowgrpo", [*path, "--rollout.vllm.no-request-seeds"])
    assert cfg.rollout.vllm.request_seeds is False
    with pytest.raises(ConfigError, match="unknown key 'algo.dgpo.tau'"):
        config_from_dict({"model": {"adapter": "sd3"}, "algo": {"dgpo": {"tau": 1.0}}})
    with pytest.raises(ConfigError, match="algo.dgpo.timesteps: expected an integer"):
        config_from_dict({"model": {"adapter": "sd3"}, "algo": {"dgpo": {"timesteps": 1.5}}})


def test_help_shows_the_sections_the_recipe_runs():
    from omnirl.cli_help import help_text
    from omnirl.recipe import load_recipe

    cfg, source = load_recipe("sd3_tiny_nft")
    short = help_text(cfg, source, full=False, width=100)
    assert "\nalgo.diffusion_nft\n  --algo.diffusion_nft.beta float = 1.0\n" in short  # the recipe sets it
    assert "--algo.dgpo" not in short and "--rollout.vllm" not in short and "--rollout.fp8" not in short
    cfg, source = load_recipe("sd3_tiny_flowgrpo")
    cfg.rollout.precision = "fp8"
    assert "--rollout.fp8.*" in help_text(cfg, source, full=False, width=100)


def run_main(argv: list[str], tmp_path, capsys, monkeypatch, expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may appear in the working directory either
    status = load_train_script().main([*argv, "--run.output_dir", str(tmp_path / "out")])
    assert_one_error_line(status, capsys, expected)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (["--algo.nft_beta", "0.5"], "error: --algo.nft_beta is now --algo.diffusion_nft.beta\n"),
        (["--algo.dppo-tau", "1e-5"], "error: --algo.dppo-tau is now --algo.flow_dppo.tau\n"),
        (["--rollout.fp8_select=1"], "error: --rollout.fp8_select is now --rollout.fp8.select\n"),
        (
            ["--rollout.no-vllm-logprobs"],
            "error: --rollout.no-vllm-logprobs is now --rollout.vllm.no_logprobs\n",
        ),
    ],
)
def test_an_old_flag_is_one_line_naming_the_new_one(flag, expected, tmp_path, capsys, monkeypatch):
    run_main(["--recipe", "sd3_tiny_flowgrpo", *flag], tmp_path, capsys, monkeypatch, expected)


def test_an_old_recipe_key_is_one_line_naming_the_new_one(tmp_path, capsys, monkeypatch):
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_nft.yaml").read_text())
    recipe["algo"]["nft_beta"] = recipe["algo"].pop("diffusion_nft")["beta"]
    path = tmp_path / "old" / "recipe.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    status = load_train_script().main(["--recipe", str(path), "--run.output_dir", str(tmp_path / "out")])
    assert_one_error_line(status, capsys, f"error: {path}: algo.nft_beta is now algo.diffusion_nft.beta\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--rollout.vllm.sleep_level", "3"], "error: rollout.vllm.sleep_level must be 1 or 2, got 3\n"),
        (
            ["--rollout.vllm.push_bucket_mib", "0"],
            "rollout.vllm.push_bucket_mib must be an integer >= 1, got 0",
        ),
        (["--rollout.fp8.select", "-1"], "rollout.fp8.select must be an integer >= 0, got -1"),
        (["--algo.dgpo.timesteps", "0"], "algo.dgpo.timesteps must be an integer >= 1, got 0"),
        (["--algo.flow_dppo.tau", "nan"], "algo.flow_dppo.tau must be a finite number > 0, got nan"),
    ],
)
def test_a_component_value_out_of_range_is_one_line(overrides, expected, tmp_path, capsys, monkeypatch):
    run_main(["--recipe", "sd3_tiny_flowgrpo", *overrides], tmp_path, capsys, monkeypatch, expected)


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (
            ["--sampling.sde_window_random"],
            "--sampling.sde_window_random is now --sampling.sde_window_schedule dance",
        ),
        (
            ["--sampling.no-sde-window-random"],
            "--sampling.no-sde-window-random is now --sampling.sde_window_schedule dance",
        ),
        (
            ["--sampling.sde_window_random=false"],
            "--sampling.sde_window_random is now --sampling.sde_window_schedule dance",
        ),
        (
            ["--sampling.sde_window_schedule", "random"],
            "--sampling.sde_window_schedule random is now --sampling.sde_window_schedule contiguous",
        ),
        (
            ["--sampling.ode_compress_ratio", "0.4"],
            "sampling.ode_compress_ratio needs sampling.sde_window_schedule sliding_compressed",
        ),
        (
            ["--sampling.sde_window_schedule", "sliding_compressed", "--sampling.sde_window_size", "1"],
            "sampling.sde_window_schedule sliding_compressed needs sampling.ode_compress_ratio > 0",
        ),
    ],
)
def test_an_old_schedule_flag_is_one_line_naming_the_new_value(flag, expected, tmp_path, capsys, monkeypatch):
    """A setting that became a value of sampling.sde_window_schedule, an old value, and MixGRPO-Flash's
    ratio with another schedule (or that schedule without it)."""
    run_main(["--recipe", "sd3_tiny_flowgrpo", *flag], tmp_path, capsys, monkeypatch, f"error: {expected}")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("sde_window_random", True, "sampling.sde_window_random is now sampling.sde_window_schedule dance"),
        ("sde_window_random", False, "sampling.sde_window_random is now sampling.sde_window_schedule dance"),
        (
            "sde_window_schedule",
            "random",
            "sampling.sde_window_schedule random is now sampling.sde_window_schedule contiguous",
        ),
    ],
)
def test_an_old_schedule_key_is_one_line_naming_the_new_value(
    key, value, expected, tmp_path, capsys, monkeypatch
):
    recipe = yaml.safe_load((ROOT / "yaml/flux_tiny_dancegrpo.yaml").read_text())
    del recipe["sampling"]["sde_window_schedule"]
    recipe["sampling"][key] = value
    path = tmp_path / "old" / "recipe.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    status = load_train_script().main(["--recipe", str(path), "--run.output_dir", str(tmp_path / "out")])
    assert_one_error_line(status, capsys, f"error: {path}: {expected}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
