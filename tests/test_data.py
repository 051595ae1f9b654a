"""Prompt files and the per-step prompt schedule."""

import pytest

from omnirl.config import REPO_ROOT
from omnirl.data import check_prompts
from omnirl.data.prompts import load_prompts, step_prompt_indices
from omnirl.errors import DataError
from omnirl.rewards.ocr import target_text


def write(tmp_path, text, name="p.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_prompts_keeps_metadata_and_skips_blank_lines(tmp_path):
    path = write(tmp_path, '{"prompt": "a cat", "text": "CAT", "tag": 3}\n\n  \n{"prompt": "a dog"}\n')
    rows = load_prompts(path)
    assert [r.prompt for r in rows] == ["a cat", "a dog"]
    assert rows[0].metadata == {"text": "CAT", "tag": 3, "source": f"{path}:1"}
    assert rows[1].metadata == {"source": f"{path}:4"}


@pytest.mark.parametrize(
    "text, line, words",
    [
        ('{"prompt": "ok"}\n{"prompt": "broken"\n', 2, "not valid JSON"),
        ('{"prompt": "ok"}\n\n{"text": "no prompt"}\n', 3, '"prompt"'),
        ('{"prompt": 5}\n', 1, '"prompt"'),
        ('{"prompt": "  "}\n', 1, '"prompt"'),
        ('["a list"]\n', 1, "JSON object"),
        ('{"prompt": "x", "source": "laion"}\n', 1, '"source"'),
    ],
)
def test_load_prompts_errors_name_file_and_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(DataError, match=f"{path}:{line}: .*{words}"):
        load_prompts(path)


def test_load_prompts_skips_bad_rows_when_asked(tmp_path):
    text = '{"prompt": "a cat"}\n{"prompt": "broken"\n\n["a list"]\n{"prompt": "a dog"}\n'
    path = write(tmp_path, text)
    skipped = []
    rows = load_prompts(path, skipped)
    assert [r.prompt for r in rows] == ["a cat", "a dog"]
    assert rows[1].metadata["source"] == f"{path}:5"
    assert len(skipped) == 2
    assert skipped[0].startswith(f"{path}:2: not valid JSON") and skipped[1].startswith(f"{path}:4: expected")
    with pytest.raises(DataError, match=f"{path}:2: not valid JSON"):
        load_prompts(path)
    with pytest.raises(DataError, match="no prompts"):  # nothing left after skipping is still an error
        load_prompts(write(tmp_path, '{"prompt": ""}\n', "bad.jsonl"), [])


def test_rows_the_model_cannot_run_are_refused_or_skipped(tmp_path):
    """`check_prompts` with the ops' `prompt_problem` (here: more than 10 characters is too long): a DataError
    naming the first such row, or with data.on_bad_row skip each dropped and listed; none left is an
    error."""
    path = write(tmp_path, '{"prompt": "a cat"}\n{"prompt": "a very long cat"}\n{"prompt": "a dog"}\n')
    rows = load_prompts(path)

    def problem(row):
        return f"{len(row.prompt)} characters, more than 10" if len(row.prompt) > 10 else None

    with pytest.raises(DataError, match=f"^{path}:2: 15 characters, more than 10$"):
        check_prompts(rows, problem, None)
    skipped = ["an earlier one"]
    assert [r.prompt for r in check_prompts(rows, problem, skipped)] == ["a cat", "a dog"]
    assert skipped == ["an earlier one", f"{path}:2: 15 characters, more than 10"]
    with pytest.raises(DataError, match="the model can run none of the 3 rows"):
        check_prompts(rows, lambda row: "too long", [])


def test_load_prompts_missing_or_empty_file(tmp_path):
    with pytest.raises(DataError, match="not found: .*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl: no prompts"):
        load_prompts(write(tmp_path, "\n\n", "empty.jsonl"))


def test_shipped_prompt_files_load_and_have_ocr_targets():
    assert len(load_prompts(REPO_ROOT / "data" / "sd3_tiny_prompts.jsonl")) >= 8
    rows = load_prompts(REPO_ROOT / "data" / "ocr_prompts_tiny.jsonl")
    assert len(rows) >= 8
    assert all(target_text(r.prompt, r.metadata) for r in rows)


def test_step_prompt_indices_cover_each_epoch_and_are_deterministic():
    n, per_step = 10, 4
    stream = [i for step in range(15) for i in step_prompt_indices(n, step, per_step, seed=7)]  # 6 epochs
    epochs = [stream[e * n : (e + 1) * n] for e in range(6)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # a fresh shuffle each epoch
    assert step_prompt_indices(n, 3, per_step, seed=7) == stream[12:16]  # deterministic
    assert step_prompt_indices(n, 3, per_step, seed=8) != stream[12:16]
    # The stream depends only on the global position: 2 prompts per step walks the same sequence, and
    # a step larger than the data set spans several epochs.
    assert [i for s in range(30) for i in step_prompt_indices(n, s, 2, seed=7)] == stream[:60]
    assert step_prompt_indices(n, 1, 25, seed=7) == stream[25:50]


def test_step_prompt_indices_independent_of_rank_count():
    full = step_prompt_indices(37, 5, 8, seed=0)
    for world in (1, 2, 4, 8):
        share = len(full) // world  # the trainer's contiguous slice per rank
        assert [i for r in range(world) for i in full[r * share : (r + 1) * share]] == full
    with pytest.raises(ValueError, match="prompts_per_step"):
        step_prompt_indices(10, 0, 0, seed=0)
