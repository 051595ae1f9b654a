"""A damaged weight file (cut short, or random bytes in its place) is one line `error: FILE: ...` naming the
file and what is wrong with it, exit status 2, nothing written, and never torch's advice to load it with
`weights_only=False`: every weight file omnirl opens goes through `omnirl.weights`. The files of a model or
reward directory are checked (their headers, a few kilobytes each) before any of them loads."""

import random
import shutil

import pytest
import torch
import yaml

from omnirl.testing.rewards import make_tiny_clap, make_tiny_dina_lrm, make_tiny_pickscore
from omnirl.weights import WeightFileError, check_weight_file, load_safetensors, torch_load
from tests.test_bad_input import ROOT, load_train_script

# The entry point's @record, under pytest's capture.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "random": lambda data: random.Random(0).randbytes(len(data)),
}
# damage -> what the line says of a safetensors file
SAFETENSORS_FAULTS = {"truncated": ": truncated: its header describes ", "random": ": not a safetensors file"}


def damage(file, how: str) -> None:
    file.write_bytes(DAMAGES[how](file.read_bytes()))


def refused_naming(file, args: list[str], tmp_path, capsys, monkeypatch) -> str:
    """Run `main` from the repository root: exit 2, one `error:` line starting with the damaged file's
    path, no line repeating torch's weights_only advice, nothing written. Returns the error line."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    status = load_train_script().main([*args, "--run.output_dir", str(out)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"error: {file}: "), err
    assert "weights_only" not in err and "Traceback" not in err, err
    assert not out.exists()
    return errors[0]


def no_model_loads(monkeypatch) -> None:
    import omnirl.trainer

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the reward's files were checked")

    monkeypatch.setattr(omnirl.trainer, "build_adapter", refuse)


@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_damaged_pickscore_is_named_before_anything_loads(how, tiny_sd3, tmp_path, capsys, monkeypatch):
    path = make_tiny_pickscore(tmp_path / "pickscore")
    damage(path / "model.safetensors", how)
    no_model_loads(monkeypatch)
    args = ["--recipe", "sd3_tiny_flowgrpo_pickscore", "--model.path", str(tiny_sd3)]
    line = refused_naming(
        path / "model.safetensors",
        [*args, "--reward.paths.pickscore", str(path)],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert SAFETENSORS_FAULTS[how] in line


@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_damaged_clap_is_named_before_anything_loads(how, tiny_ltx2, tmp_path, capsys, monkeypatch):
    path = make_tiny_clap(tmp_path / "clap")
    damage(path / "model.safetensors", how)
    recipe = yaml.safe_load((ROOT / "yaml/ltx23_tiny_t2av_flowgrpo.yaml").read_text())
    recipe["reward"] = {"weights": {"clap": 1.0}, "paths": {"clap": str(path)}}
    (tmp_path / "clap.yaml").write_text(yaml.safe_dump(recipe))
    no_model_loads(monkeypatch)
    args = ["--recipe", str(tmp_path / "clap.yaml"), "--model.path", str(tiny_ltx2)]
    line = refused_naming(path / "model.safetensors", args, tmp_path, capsys, monkeypatch)
    assert SAFETENSORS_FAULTS[how] in line


DINA_FILES = {
    "LoRA": "checkpoint/backbone_lora/adapter_model.safetensors",
    "head": "checkpoint/rm_head.pt",
}
# (file, damage) -> what the line says
DINA_FAULTS = {
    ("LoRA", "truncated"): SAFETENSORS_FAULTS["truncated"],
    ("LoRA", "random"): SAFETENSORS_FAULTS["random"],
    # found by the directory check: a zip archive without its end
    ("head", "truncated"): ": truncated or damaged: a zip archive (torch.save's format) without its end",
    # found when the reward loads it (after the policy: it reads the policy's blocks)
    ("head", "random"): ": not a PyTorch weight file: its bytes do not parse as one",
}


@pytest.mark.parametrize(("part", "how"), sorted(DINA_FAULTS))
def test_damaged_dina_lrm_file_is_named(part, how, tiny_sd3, tmp_path, capsys, monkeypatch):
    path = make_tiny_dina_lrm(tmp_path / "dina_lrm")
    file = path / DINA_FILES[part]
    damage(file, how)
    if (part, how) != ("head", "random"):
        no_model_loads(monkeypatch)
    args = ["--recipe", "sd3_tiny_flowgrpo_dinalrm", "--model.path", str(tiny_sd3)]
    line = refused_naming(file, [*args, "--reward.paths.dina_lrm", str(path)], tmp_path, capsys, monkeypatch)
    assert DINA_FAULTS[part, how] in line


@pytest.mark.parametrize("how", sorted(DAMAGES))
@pytest.mark.parametrize(
    ("recipe", "fixture", "file"),
    [
        ("bagel_tiny_flowgrpo", "tiny_bagel", "ema.safetensors"),
        ("sd3_tiny_flowgrpo", "tiny_sd3", "transformer/diffusion_pytorch_model.safetensors"),
    ],
)
def test_damaged_model_file_is_named_before_any_component_loads(
    how, recipe, fixture, file, request, tmp_path, capsys, monkeypatch
):
    import omnirl.models

    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    damage(model / file, how)
    adapter = omnirl.models.get_adapter(recipe.split("_")[0])

    def refuse(*args, **kwargs):
        raise AssertionError("a component loaded before the model's files were checked")

    monkeypatch.setattr(adapter, "__init__", refuse)
    line = refused_naming(model / file, ["--recipe", recipe, "--model.path", str(model)], tmp_path, capsys,
                          monkeypatch)  # fmt: skip
    assert SAFETENSORS_FAULTS[how] in line


def test_a_pickle_that_runs_code_is_refused_without_torch_advice(tmp_path):
    """A .pt file holding a callable is refused naming it and the global; torch's paragraph (which
    advises weights_only=False) is not repeated."""

    class RunsCode:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"head.weight": RunsCode()}, tmp_path / "head.pt")
    with pytest.raises(WeightFileError) as e:
        torch_load(tmp_path / "head.pt")
    text = str(e.value)
    assert text.startswith(f"{tmp_path / 'head.pt'}: refused: it holds objects other than tensors"), text
    assert "(the global print)" in text and "weights_only" not in text and "\n" not in text


def test_whole_files_pass(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    save_file(tensors, tmp_path / "w.safetensors")
    torch.save(tensors, tmp_path / "w.pt")
    check_weight_file(tmp_path / "w.safetensors")
    assert torch.equal(load_safetensors(tmp_path / "w.safetensors")["a"], tensors["a"])
    assert torch.equal(torch_load(tmp_path / "w.pt")["b"], tensors["b"])
    (tmp_path / "w.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes() + b"\0")
    with pytest.raises(WeightFileError, match="w.safetensors: damaged: its header describes"):
        check_weight_file(tmp_path / "w.safetensors")
