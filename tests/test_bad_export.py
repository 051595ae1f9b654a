"""Bad input to export, to checkpoints, to reward paths and to the output directory: one line `error: ...`,
exit status 2, no traceback, nothing written (test_bad_input.py holds the rest).

Export: a two-expert LoRA directory missing an expert's file, a model folder missing a component's folder,
a truncated LoRA file, an export onto its own source, `--format peft` of a LoRA without omnirl's metadata,
a local-looking model path that does not exist (never looked up on the hub). Checkpoints whose files were
replaced and whose manifest was rewritten to match. Reward paths checked for what each reward loads before
anything loads. An output directory that cannot be written, a refused run leaving no lock, and of two runs
started together on a new directory the second refused before it loads anything.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.models import get_adapter
from omnirl.models.wan.adapter import LORA_FILE, LORA_FILE_2, WanAdapter
from tests.support_compare import perturb_lora, tiny_config
from tests.test_bad_input import ROOT, assert_one_error_line, load_train_script
from tests.test_checkpoint import export_status, reseal
from tests.test_train import tiny_cfg


@pytest.fixture(scope="module")
def a14b_lora_dir(tiny_wan_a14b, tmp_path_factory) -> Path:
    """An A14B run's lora/ directory: both experts' LoRA files."""
    cfg = tiny_config("wan", tiny_wan_a14b, rank=4, alpha=8.0)
    cfg.family.num_frames = 9
    adapter = WanAdapter(cfg, torch.device("cpu"))
    perturb_lora(adapter, 0.05)
    out = tmp_path_factory.mktemp("a14b") / "lora"
    adapter.export_lora(out)
    return out


@pytest.fixture(scope="module")
def sd3_checkpoint(tiny_sd3, tmp_path_factory) -> Path:
    """A LoRA checkpoint of the tiny SD3 (step 1), to be copied before it is damaged."""
    out = tmp_path_factory.mktemp("sd3_ckpt") / "run"
    cfg = tiny_cfg(tiny_sd3, out.parent)
    cfg.run.output_dir = str(out)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    return checkpoint.save(cfg, 1, adapter.policy, opt, D.init_distributed())


def assert_one_error_after_loading(status: int, capsys, expected: str) -> None:
    """Exit status 2, one line `error: ...` holding `expected` and no traceback, after the progress bars of
    loading the model (a checkpoint's tensors are read into the model they were trained on)."""
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert expected in lines[0]
    assert "weights_only" not in err, lines[0]  # torch's advice to load untrusted bytes unrestricted


def export_refused(capsys, expected: str, *args) -> None:
    """scripts/export.py refuses `args` with one line holding `expected`; its OUT (args[1]) is not written."""
    assert_one_error_line(export_status(*args), capsys, expected)
    assert not Path(args[1]).exists()


# export


def test_merge_of_a_two_expert_lora_without_its_second_file_is_refused(
    a14b_lora_dir, tiny_wan_a14b, tmp_path, capsys
):
    half = tmp_path / "half"
    half.mkdir()
    shutil.copyfile(a14b_lora_dir / LORA_FILE, half / LORA_FILE)
    for mode in (["--merge"], ["--format", "peft"], []):
        export_refused(
            capsys, f"{half} lacks {LORA_FILE_2} (the LoRA of transformer_2)",
            half, tmp_path / "out", *mode, "--model-path", tiny_wan_a14b,
        )  # fmt: skip


def test_model_folder_without_a_component_folder_names_it(tiny_wan_a14b, tmp_path, capsys):
    model = tmp_path / "a14b"
    shutil.copytree(tiny_wan_a14b, model)
    shutil.rmtree(model / "transformer_2")
    out = tmp_path / "out"
    status = load_train_script().main(
        [
            "--recipe",
            "wan22_a14b_tiny_flowgrpo_lora",
            "--model.path",
            str(model),
            "--run.output_dir",
            str(out),
        ]
    )
    assert_one_error_line(
        status, capsys, f"lists the component transformer_2 (WanTransformer3DModel), but there is no folder "
        f"{model / 'transformer_2'}",
    )  # fmt: skip
    assert not out.exists()


def test_truncated_lora_file_is_one_line(a14b_lora_dir, tmp_path, capsys):
    lora = tmp_path / "lora"
    shutil.copytree(a14b_lora_dir, lora)
    data = (lora / LORA_FILE_2).read_bytes()
    (lora / LORA_FILE_2).write_bytes(data[: len(data) // 2])
    for extra in ([], ["--format", "peft"]):
        export_refused(
            capsys, f"{lora / LORA_FILE_2}: truncated: its header describes ", lora, tmp_path / "out", *extra
        )


def test_export_onto_its_own_source_is_refused(a14b_lora_dir, sd3_checkpoint, tmp_path, capsys):
    lora = tmp_path / "lora"
    shutil.copytree(a14b_lora_dir, lora)
    before = {f: (lora / f).read_bytes() for f in os.listdir(lora)}
    for source in (lora, sd3_checkpoint):
        for extra in ([], ["--format", "peft"]):
            status = export_status(source, source, *extra)
            assert_one_error_line(status, capsys, f"{source}: the export would write over its own source")
    assert {f: (lora / f).read_bytes() for f in os.listdir(lora)} == before
    checkpoint.verify(sd3_checkpoint)  # untouched


def test_peft_of_a_lora_without_omnirl_metadata_is_one_line(a14b_lora_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    lora = tmp_path / "lora"
    lora.mkdir()
    save_file(load_file(a14b_lora_dir / LORA_FILE), lora / LORA_FILE)  # no metadata: as another trainer's
    expected = f"{lora / LORA_FILE}: --format peft needs a transformer LoRA with its config"
    export_refused(capsys, expected, lora, tmp_path / "out", "--format", "peft")


@pytest.mark.parametrize("form", ["absolute", "./", "../", "existing parent"])
def test_missing_local_model_path_is_refused_at_once(form, a14b_lora_dir, sd3_checkpoint, tmp_path, capsys,
                                                     monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    missing = {
        "absolute": str(tmp_path / "no_such_model"),
        "./": "./no_such_model",
        "../": f"../{tmp_path.name}/no_such_model",
        "existing parent": "models/no_such_model",
    }[form]
    expected = f"--model-path {missing!r} does not exist (a local path: it is not looked up on the hub)"
    export_refused(capsys, expected, a14b_lora_dir, tmp_path / "merged", "--merge", "--model-path", missing)
    export_refused(capsys, expected, sd3_checkpoint, tmp_path / "lora", "--model-path", missing)


def test_checkpoint_naming_a_missing_local_model_is_refused(sd3_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "step_000001"
    shutil.copytree(sd3_checkpoint, ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["identity"]["model.path"] = str(tmp_path / "moved_away")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    reseal(ckpt)
    expected = (
        f"model.path (recorded in {ckpt}/meta.json; --model-path replaces it) '{tmp_path / 'moved_away'}'"
    )
    export_refused(capsys, expected + " does not exist", ckpt, tmp_path / "lora")


# checkpoints

REPLACED = {  # file -> its new bytes, from the old ones; the manifest is rewritten to match (`reseal`)
    "model_optim/__0_0.distcp": lambda data: bytes(len(data)),
    "model_optim/__0_0.distcp ": lambda data: data[: len(data) // 2],  # truncated (the space: a second case)
    "rng/rank_00000.pt": lambda data: os.urandom(len(data)),
    "metrics.jsonl": lambda data: b"\xff\xfe not json\n",
}


@pytest.mark.parametrize("case", sorted(REPLACED))
def test_checkpoint_with_replaced_bytes_is_one_line_naming_the_file(case, sd3_checkpoint, tiny_sd3, tmp_path,
                                                                    capsys):  # fmt: skip
    ckpt = tmp_path / "step_000001"
    shutil.copytree(sd3_checkpoint, ckpt)
    rel = case.strip()
    (ckpt / rel).write_bytes(REPLACED[case]((ckpt / rel).read_bytes()))
    reseal(ckpt)
    out = tmp_path / "out"
    status = load_train_script().main(
        ["--recipe", "sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--checkpoint.resume", str(ckpt),
         "--run.output_dir", str(out), "--run.steps", "2"]
    )  # fmt: skip
    assert_one_error_after_loading(status, capsys, str(ckpt / rel))
    assert not out.exists()
    if rel.startswith("model_optim"):  # export reads only the weights
        status = export_status(ckpt, tmp_path / "lora")
        assert_one_error_after_loading(status, capsys, f"{ckpt / rel}: not a checkpoint shard omnirl wrote")
        assert not (tmp_path / "lora").exists()


# reward paths


def clip_video_recipe(tmp_path: Path, path: str | None) -> Path:
    """The tiny TI2V recipe rewarded by clip_video, its reward.paths.clip_video `path` (None: no entry)."""
    recipe = yaml.safe_load((ROOT / "yaml/wan22_ti2v_tiny_dancegrpo.yaml").read_text())
    recipe["reward"]["weights"] = {"clip_video": 1.0}
    recipe["data"]["train_path"] = str(ROOT / recipe["data"]["train_path"])
    if path is not None:
        recipe["reward"]["paths"] = {"clip_video": path}
    out = tmp_path / "clip_video.yaml"
    out.write_text(yaml.safe_dump(recipe))
    return out


@pytest.mark.parametrize("form", ["relative missing", "absolute missing", "not CLIP", "no weights", "none"])
def test_reward_path_is_checked_before_anything_loads(form, tiny_wan_ti2v, tiny_sd3, tmp_path, capsys,
                                                       monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    qwen = tmp_path / "not_clip"  # a transformers checkpoint of another model: the tiny SD3's text encoder
    shutil.copytree(Path(tiny_sd3) / "text_encoder", qwen)
    no_weights = tmp_path / "clip_without_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "clip"}))
    path, expected = {
        "relative missing": ("clip_ckpt", "reward.paths.clip_video 'clip_ckpt' does not exist (a local"),
        "absolute missing": (str(tmp_path / "clip"), f"reward.paths.clip_video '{tmp_path / 'clip'}' does"),
        "not CLIP": (str(qwen), f"reward.paths.clip_video '{qwen}' holds a 'clip_text_model' model; reward "
                     "clip_video loads a 'clip' one"),
        "no weights": (str(no_weights), f"reward.paths.clip_video '{no_weights}' lacks model.safetensors or"),
        "none": (None, "reward clip_video needs reward.paths.clip_video"),
    }[form]  # fmt: skip
    loaded = []
    monkeypatch.setattr(WanAdapter, "__init__", lambda *a: loaded.append(a))  # nothing may load
    out = tmp_path / "out"
    recipe = clip_video_recipe(tmp_path, path)
    status = load_train_script().main(
        ["--recipe", str(recipe), "--model.path", str(tiny_wan_ti2v), "--run.output_dir", str(out)]
    )
    assert_one_error_line(status, capsys, expected)
    assert not out.exists() and not loaded


# the output directory


def test_output_dir_that_cannot_be_written_is_refused_before_loading(tiny_sd3, tmp_path, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr(get_adapter("sd3"), "__init__", lambda *a: loaded.append(a))  # nothing may load
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    main = load_train_script().main
    args = ["--recipe", "sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--run.output_dir"]
    status = main([*args, str(blocker / "out")])
    assert_one_error_line(
        status, capsys, f"run.output_dir '{blocker / 'out'}' cannot be written: Not a directory"
    )
    # A read-only file system, as the kernel reports it (EROFS) for the lock file of a new directory.
    read_only = tmp_path / "ro"
    real_makedirs = os.makedirs

    def makedirs(name, *a, **kw):
        if str(name).startswith(str(read_only)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(name))
        return real_makedirs(name, *a, **kw)

    monkeypatch.setattr(os, "makedirs", makedirs)
    status = main([*args, str(read_only / "out")])
    assert_one_error_line(
        status, capsys, f"run.output_dir '{read_only / 'out'}' cannot be written: Read-only"
    )
    assert not loaded and sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_refused_run_leaves_no_lock(tiny_sd3, tmp_path, capsys):
    """A run refused for its input (here a missing data file) leaves its output directory as it found it:
    an existing one without a .lock, a new one not created."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a previous run's notes")
    for target in (out, tmp_path / "new" / "deeper"):
        status = load_train_script().main(
            ["--recipe", "sd3_tiny_flowgrpo", "--model.path", str(tiny_sd3), "--run.output_dir", str(target),
             "--data.train_path", str(tmp_path / "nope.jsonl")]
        )  # fmt: skip
        assert_one_error_line(status, capsys, "prompt file not found")
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["notes.txt"]


@pytest.mark.slow  # two training processes start: tens of seconds on 2 cores
def test_second_of_two_runs_started_together_is_refused_before_loading(tiny_sd3, tmp_path):
    """Two runs on one new output directory, started at once: one is refused at once, before it loads
    anything (no loading progress on its stderr), with the one error line; the other runs."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tests._train_entry", "--recipe", "sd3_tiny_flowgrpo", "--model.path",
           str(tiny_sd3), "--run.output_dir", str(out), "--run.steps", "1000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    runs = [subprocess.Popen(cmd, cwd=ROOT, env=env, **pipes) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while all(r.poll() is None for r in runs):
            assert time.monotonic() < deadline, "neither run was refused"
            time.sleep(0.2)
        (refused,) = [r for r in runs if r.poll() is not None]
        err = refused.stderr.read()
        assert refused.returncode == 2
        assert (
            err.startswith(f"error: run.output_dir '{out}' is in use by another run (pid ")
            and err.count("\n") == 1
        ), err[-3000:]
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
            r.wait()


# a run's peft adapter directory (BAGEL's lora/)


@pytest.fixture(scope="module")
def bagel_lora_dir(tiny_bagel, tmp_path_factory) -> Path:
    """The LoRA directory a BAGEL run writes at its end (its adapter's export_lora: a peft adapter)."""
    from omnirl.models.bagel.adapter import BagelAdapter, BagelSettings

    targets = ["q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen"]
    cfg = tiny_config("bagel", tiny_bagel, rank=4, alpha=8.0, target_modules=targets)
    cfg.family = BagelSettings()
    adapter = BagelAdapter(cfg, torch.device("cpu"))
    perturb_lora(adapter, 0.05)
    out = tmp_path_factory.mktemp("bagel") / "lora"
    adapter.export_lora(out)
    return out


def test_bagel_peft_lora_dir_copies_and_merges(bagel_lora_dir, tiny_bagel, tmp_path, capsys):
    """A BAGEL run's own lora/ (adapter_config.json, adapter_model.safetensors) exports as it is and, with
    --merge, fused into the official layout: an adapted weight is W + alpha / r * B A, the rest unchanged."""
    from safetensors.torch import load_file

    assert export_status(bagel_lora_dir, tmp_path / "copy") == 0
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "copy" / name).read_bytes() == (bagel_lora_dir / name).read_bytes()
    assert export_status(bagel_lora_dir, tmp_path / "merged", "--merge", "--model-path", tiny_bagel) == 0
    base, merged = load_file(tiny_bagel / "ema.safetensors"), load_file(tmp_path / "merged/ema.safetensors")
    lora = load_file(bagel_lora_dir / "adapter_model.safetensors")
    module = "language_model.model.layers.0.self_attn.q_proj_moe_gen"
    a, b = lora[f"base_model.model.{module}.lora_A.weight"], lora[f"base_model.model.{module}.lora_B.weight"]
    expected = base[f"{module}.weight"] + 8.0 / 4 * (b @ a)
    assert torch.allclose(merged[f"{module}.weight"], expected, atol=1e-6)
    assert not torch.equal(merged[f"{module}.weight"], base[f"{module}.weight"])
    unadapted = "language_model.model.layers.0.self_attn.q_proj.weight"  # the understanding copy
    assert torch.equal(merged[unadapted], base[unadapted])
    assert "wrote" in capsys.readouterr().out


def test_bagel_peft_lora_dir_refusals(bagel_lora_dir, tiny_bagel, tiny_sd3, tmp_path, capsys):
    """Merged onto a model that is not BAGEL, or holding a LoRA of another shape: one line naming what is
    wrong, nothing written."""
    export_refused(
        capsys, f"--model-path '{tiny_sd3}' is not a BAGEL checkpoint in the official layout",
        bagel_lora_dir, tmp_path / "out", "--merge", "--model-path", tiny_sd3,
    )  # fmt: skip
    other = tmp_path / "other"
    shutil.copytree(bagel_lora_dir, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if ".lora_A." in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    save_file(tensors, other / "adapter_model.safetensors")
    export_refused(
        capsys, f"{other / 'adapter_model.safetensors'}: {key} updates a ",
        other, tmp_path / "out", "--merge", "--model-path", tiny_bagel,
    )  # fmt: skip


def test_merge_onto_a_damaged_model_names_its_file(bagel_lora_dir, tiny_bagel, tmp_path, capsys):
    """--model-path's weight files are checked before anything loads, as model.path's are for a run."""
    model = tmp_path / "bagel"
    shutil.copytree(tiny_bagel, model)
    data = (model / "ema.safetensors").read_bytes()
    (model / "ema.safetensors").write_bytes(data[: len(data) // 2])
    export_refused(
        capsys, f"{model / 'ema.safetensors'}: truncated: its header describes ",
        bagel_lora_dir, tmp_path / "out", "--merge", "--model-path", model,
    )  # fmt: skip
