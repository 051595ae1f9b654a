"""A model family's own settings (`family.*`: the `Settings` of each adapter in omnirl.models) are checked
when the recipe loads, like every other section: a value a run cannot use is one line `error: ...` naming
the field, exit status 2, before any model loads, with nothing written (to run.output_dir or the working
directory). Every number of every family is tried at 0, -1, NaN and (a float) infinity through the entry
point's `main` in-process: it is the code the command line runs, and the refusal comes before anything
heavy."""

import dataclasses
import typing

import pytest

from omnirl.models import ADAPTERS, get_adapter
from tests.test_bad_input import ROOT, load_train_script

# The entry point's @record, under pytest's capture.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

# A tiny recipe of each family whose settings have fields (sd3's and qwen_vl's have none).
RECIPES = {
    "sd3": "sd3_tiny_flowgrpo",
    "qwen_image": "qwen_image_tiny_flowgrpo",
    "qwen_image_edit": "qwen_image_edit_tiny_flowgrpo",
    "wan": "wan22_a14b_tiny_flowgrpo_lora",
    "ltx2": "ltx23_tiny_t2av_flowgrpo",
    "qwen3_omni_thinker": "mmk12_tiny",
    "bagel": "bagel_tiny_flowgrpo",
    "flux": "flux_tiny_flowgrpo",
    "flux2_klein": "flux2_klein_tiny_flowgrpo",
}
NUMBERS = (int, float, float | None, list[int])
# (adapter, field, value) -> why a run can use that value; such a case is left out below. Otherwise each
# family number is a count (frames, rows, tokens, pixels), a frame rate, a shift or a guidance scale, none
# of which may be 0 or negative. NaN is never a value.
LEGITIMATE: dict[tuple[str, str, str], str] = {
    ("ltx2", "guidance_rescale", "0"): "0 turns the rescale off (LTX2Pipeline's guidance_rescale 0)",
    ("ltx2", "audio_guidance_rescale", "0"): "0 turns the audio stream's rescale off",
}


def numeric_fields(adapter: str) -> list[str]:
    settings = get_adapter(adapter).Settings
    hints = typing.get_type_hints(settings)
    return [f.name for f in dataclasses.fields(settings) if hints[f.name] in NUMBERS]


def tried_values(adapter: str, name: str) -> tuple[str, ...]:
    """0, -1 and NaN for every number; infinity too for a float (an integer field does not parse it)."""
    floats = typing.get_type_hints(get_adapter(adapter).Settings)[name] in (float, float | None)
    return ("0", "-1", "nan", "inf") if floats else ("0", "-1", "nan")


NUMERIC = [
    (adapter, name, value)
    for adapter in sorted(ADAPTERS)
    for name in numeric_fields(adapter)
    for value in tried_values(adapter, name)
    if (adapter, name, value) not in LEGITIMATE
]


def refused(adapter: str, overrides: list[str], tmp_path, capsys, monkeypatch) -> str:
    """Run `main` with the family's recipe and `overrides`; assert exit 2, one `error:` line and nothing
    written; return the line."""
    monkeypatch.chdir(tmp_path)  # nothing may appear in the working directory either
    argv = ["--recipe", RECIPES[adapter], *overrides, "--run.output_dir", str(tmp_path / "out")]
    status = load_train_script().main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
    return err


def test_every_family_number_is_tried():
    assert ("bagel", "timestep_shift", "inf") in NUMERIC and ("bagel", "cfg_image_scale", "inf") in NUMERIC
    assert {a for a in ADAPTERS if dataclasses.fields(get_adapter(a).Settings)} == set(RECIPES)
    fields = {(a, name) for a, name, _ in NUMERIC}
    assert ("wan", "fps") in fields and ("qwen_image_edit", "condition_area") in fields
    for adapter in ADAPTERS:  # a family number without a range would pass the check unseen
        settings = get_adapter(adapter).Settings
        assert set(numeric_fields(adapter)) <= set(settings.RANGES), adapter


@pytest.mark.parametrize(("adapter", "name", "value"), NUMERIC)
def test_family_number_at_0_minus_1_nan(adapter, name, value, tmp_path, capsys, monkeypatch):
    err = refused(adapter, [f"--family.{name}", value], tmp_path, capsys, monkeypatch)
    if value == "nan" and typing.get_type_hints(get_adapter(adapter).Settings)[name] in (int, list[int]):
        # Not an integer: tyro's parse error, which names the flag.
        assert err.startswith(f"error: Error parsing --family.{name.replace('_', '-')}: "), err
    else:
        assert err.startswith(f"error: family.{name} must be "), err


# Values other than 0, -1 and NaN a run cannot use either, and the line each is refused with.
FAMILY_VALUES = {
    "Wan frames off the VAE's temporal factor": (
        "wan",
        ["--family.num_frames", "10"],
        "family.num_frames must be an integer in [1, 4093] with num_frames - 1 divisible by 4 (the VAE's "
        "temporal factor; at most 1024 latent frames, the transformer's rotary table), got 10",
    ),
    "Wan guidance below 1": (
        "wan",
        ["--family.guidance_scale_2", "0.5"],
        "family.guidance_scale_2 must be null (= sampling.guidance_scale) or a finite number >= 1",
    ),
    "Qwen3-Omni talker stage": (
        "qwen3_omni_thinker",
        ["--family.stage", "talker"],
        "family.stage must be 'thinker' (the talker (speech) and 'all' are not implemented), got 'talker'",
    ),
    "Qwen3-Omni all stages": (
        "qwen3_omni_thinker",
        ["--family.stage", "all"],
        "family.stage must be 'thinker'",
    ),
    "Qwen-Image bucket past the pipeline's limit": (
        "qwen_image",
        ["--family.prompt_length_buckets", "64", "2048"],
        "family.prompt_length_buckets must be distinct ascending lengths in [1, 1024], got [64, 2048]",
    ),
    "LTX-2 frames off the video VAE's temporal factor": (
        "ltx2",
        ["--family.num_frames", "12"],
        "family.num_frames must be an integer >= 1 with num_frames - 1 divisible by 8 (the video VAE's "
        "temporal factor), got 12",
    ),
    "LTX-2 size off the video VAE's grid": (
        "ltx2",
        ["--sampling.height", "48"],
        "sampling.height must be a multiple of 32 for model.adapter 'ltx2'",
    ),
    "LTX-2 pooling by an unknown rule": (
        "ltx2",
        ["--family.logprob_pooling", "sum"],
        "family.logprob_pooling must be one of joint, equal, got 'sum'",
    ),
    "Wan frames past the transformer's rotary table": (
        "wan",
        ["--family.num_frames", "100000001"],
        "family.num_frames must be an integer in [1, 4093] with num_frames - 1 divisible by 4",
    ),
    "edit buckets out of order": (
        "qwen_image_edit",
        ["--family.prompt_length_buckets", "128", "64"],
        "family.prompt_length_buckets must be distinct ascending lengths positive, got [128, 64]",
    ),
}


@pytest.mark.parametrize("case", sorted(FAMILY_VALUES))
def test_family_value_is_one_line(case, tmp_path, capsys, monkeypatch):
    adapter, overrides, expected = FAMILY_VALUES[case]
    assert expected in refused(adapter, overrides, tmp_path, capsys, monkeypatch)


# A video's length against the checkpoint's own configs (its audio rate, its positional range): read before
# any weights, so the line still comes before the model loads.
LTX2_DURATIONS = {
    "frame rate leaving no audio": (
        ["--family.frame_rate", "1e12"],
        "family.num_frames 9 at family.frame_rate 1e+12 is 9e-12 s of video; model.path {path!r} needs at "
        "least 0.02 s (one latent frame of audio) and at most 20 s (the transformer's positional range)",
    ),
    "video past the positional range": (
        ["--family.num_frames", "100000001"],
        "family.num_frames 100000001 at family.frame_rate 24 is 4.17e+06 s of video",
    ),
}


@pytest.mark.parametrize("case", sorted(LTX2_DURATIONS))
def test_ltx2_duration_is_refused_before_any_weights_load(case, tiny_ltx2, tmp_path, capsys, monkeypatch):
    import omnirl.models.ltx2.adapter as ltx2

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded before the duration was checked")

    monkeypatch.setattr(ltx2, "load_pretrained", no_loading)
    overrides, expected = LTX2_DURATIONS[case]
    data = ["--data.train_path", str(ROOT / "data/sd3_tiny_prompts.jsonl")]  # refused() leaves the root
    err = refused("ltx2", [*overrides, "--model.path", str(tiny_ltx2), *data], tmp_path, capsys, monkeypatch)
    assert expected.format(path=str(tiny_ltx2)) in err
