"""Values past what the model or the rollout can hold: refused with one line `error: ...` naming the
field or the data row, exit status 2, nothing written, instead of a hang in step 0 or a process the kernel
kills. A limit that only the model knows (its context) is read from model.path's config.json, or where
that is not at hand checked once the model is loaded, before step 0; the others when the recipe loads."""

import json
import subprocess
import sys

import pytest

from tests.test_bad_input import ROOT, refused_run

# The entry point's @record, under pytest's capture.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def omni_args(tiny_qwen3_omni_thinker) -> list[str]:
    return ["--recipe", "mmk12_tiny", "--model.path", str(tiny_qwen3_omni_thinker)]


def test_row_buckets_past_the_halvings_of_the_slots(tiny_qwen3_omni_thinker, tmp_path, capsys, monkeypatch):
    """generation.row_buckets beyond the distinct halvings of rollout.max_num_seqs (all 8 slots, 4, 2, 1)
    is refused before the model loads: a billion of them looped in step 0."""
    import omnirl.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(omnirl.trainer, "build_adapter", no_model)
    args = [*omni_args(tiny_qwen3_omni_thinker), "--rollout.max_num_seqs", "8", "--generation.row_buckets"]
    refused_run([*args, "1000000000"], tmp_path, capsys, "generation.row_buckets must be at most 4 (")
    refused_run([*args, "5"], tmp_path, capsys, "generation.row_buckets must be at most 4 (")


def test_kv_windows_past_the_context(tiny_qwen3_omni_thinker, tmp_path, capsys, monkeypatch):
    """generation.kv_windows beyond the 64-column windows of the model's context (the tiny model's 1024
    tokens: 16) is refused before the model loads, from model.path's config.json: a billion of them
    looped in step 0."""
    import omnirl.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(omnirl.trainer, "build_adapter", no_model)
    for windows in ("1000000000", "17"):
        args = [*omni_args(tiny_qwen3_omni_thinker), "--generation.kv_windows", windows]
        err = refused_run(args, tmp_path, capsys, "generation.kv_windows must be at most 16 for model.path")
        assert f"(its context of 1024 tokens in windows of 64 columns), got {windows}" in err


@pytest.mark.slow
def test_kv_windows_refusal_is_the_only_line(tiny_qwen3_omni_thinker, tmp_path):
    """In a process of its own (the warning comes once per process): reading the config printed
    transformers' warning on the talker's M-RoPE keys before the error line."""
    out = tmp_path / "o"
    args = [
        *omni_args(tiny_qwen3_omni_thinker),
        "--generation.kv_windows",
        "17",
        "--run.output_dir",
        str(out),
    ]
    r = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: generation.kv_windows must be at most 16"), r.stderr
    assert r.stderr.count("\n") == 1 and not out.exists(), r.stderr


@pytest.mark.parametrize("size", ["5 kB", "100 kB"])
def test_bagel_prompt_past_the_llm_context_is_refused_by_row(size, tiny_bagel, tmp_path, capsys, monkeypatch):
    """A BAGEL prompt whose context with the image's query position is more than the language model's
    positions (the tiny model's 2048) is refused by file:row before step 0, as the omni models' are: it
    ran silently past the context (5 kB), or grew the process until the kernel killed it (100 kB)."""
    monkeypatch.chdir(ROOT)
    long = "a red cube on a blue table, " * (180 if size == "5 kB" else 3600)
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "a red cube"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    args = ["--recipe", "bagel_tiny_flowgrpo", "--model.path", str(tiny_bagel)]
    args += ["--data.train_path", str(rows)]
    err = refused_run(args, tmp_path, capsys, f"{rows}:2: the prompt ({len(long)} characters) is ")
    assert "context tokens; with the image's query position after them that is more than the language " in err
    assert "model's 2048 positions (max_position_embeddings): shorten it" in err
