"""The text-edit task: edit data files (strict loading, images attached to requests), the rendered data set,
the text_edit reward on rendered signs, and the tiny Qwen-Image-Edit recipe under torchrun."""

import json
import random
import sys
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from omnirl import distributed as D
from omnirl.batching import make_requests
from omnirl.config import REPO_ROOT
from omnirl.data.edit import load_edit_rows, open_inputs
from omnirl.errors import DataError
from omnirl.ops.diffusion import sampling_params
from omnirl.recipe import load_config
from omnirl.rewards.text_edit import TextEditReward
from scripts import make_edit_data
from tests.test_train import read_jsonl, torchrun

TINY_DATA = REPO_ROOT / "data" / "edit_tiny"


def write_rows(tmp_path, rows: list) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (40, 30), (10, 20, 30)).save(tmp_path / "img" / "a.png")
    (tmp_path / "img" / "broken.png").write_bytes(b"not a png")
    path = tmp_path / "edit.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {
    "image": "img/a.png",
    "prompt": 'Make the sign read "OPEN"',
    "target_text": "OPEN",
    "region": [0, 5, 40, 30],
}


def test_edit_rows_resolve_images_against_the_data_file(tmp_path):
    path = write_rows(tmp_path, [GOOD, "", {**GOOD, "target": "img/a.png", "region": [1, 2, 3, 4]}])
    rows = load_edit_rows(path)
    image = (tmp_path / "img" / "a.png").resolve()
    assert [r.metadata["source"] for r in rows] == [f"{path}:1", f"{path}:3"]
    assert rows[0].metadata["image"] == rows[1].metadata["target"] == str(image)
    assert rows[0].inputs == {"image": image}  # a path: read when a step uses the row
    opened = open_inputs({**rows[0].inputs, "other": 3})
    assert opened["other"] == 3 and opened["image"].mode == "RGB" and opened["image"].size == (40, 30)


@pytest.mark.parametrize(
    "row, words",
    [
        ({**GOOD, "image": "img/missing.png"}, r'"image" image file not found: .*img/missing\.png'),
        ({**GOOD, "target": "nope.png"}, r'"target" image file not found: .*nope\.png'),
        ({**GOOD, "image": "img/broken.png"}, r"broken\.png is not a readable image"),
        ({k: v for k, v in GOOD.items() if k != "image"}, r'needs "image"'),
        ({**GOOD, "image": 5}, r'"image" must be a non-empty path'),
        ({**GOOD, "regoin": [0, 0, 1, 1]}, r"unknown key\(s\) 'regoin'"),
        ({**GOOD, "target_text": " "}, r'"target_text" must be a non-empty string'),
        ({**GOOD, "region": [0, 0, 41, 30]}, r'"region" must be .*x1 <= 40 .*40x30.*\[0, 0, 41, 30\]'),
        ({**GOOD, "region": [5, 0, 5, 30]}, r'"region" must be'),
        ({**GOOD, "region": [0, 0, 10]}, r'"region" must be'),
        ({**GOOD, "region": [0.5, 0, 10, 10]}, r'"region" must be'),
        ({**GOOD, "prompt": ""}, r'"prompt"'),
    ],
)
def test_edit_rows_errors_name_file_and_line(tmp_path, row, words):
    path = write_rows(tmp_path, [GOOD, row])
    with pytest.raises(DataError, match=f"{path}:2: .*{words}"):
        load_edit_rows(path)
    skipped = []
    assert len(load_edit_rows(path, skipped)) == 1 and len(skipped) == 1  # data.on_bad_row: skip


def test_shipped_tiny_edit_set_and_the_generator(tmp_path, monkeypatch):
    rows = load_edit_rows(TINY_DATA / "train.jsonl")
    assert len(rows) == 8 and len(load_edit_rows(TINY_DATA / "val.jsonl")) == 2
    for r in rows:
        assert f'"{r.metadata["target_text"]}"' in r.prompt and Image.open(r.metadata["image"]).size == (
            64,
            64,
        )
    argv = ["make_edit_data.py", "--out", str(tmp_path), "--train", "3", "--val", "1", "--size", "96"]
    monkeypatch.setattr(sys, "argv", argv)
    make_edit_data.main()
    generated = load_edit_rows(tmp_path / "train.jsonl")
    assert len(generated) == 3 and all(Path(r.metadata["target"]).is_file() for r in generated)


def test_requests_carry_the_rows_source_image(tmp_path):
    cfg = load_config(
        "qwen_image_edit_tiny_flowgrpo",
        [
            "--model.path",
            str(tmp_path),
            "--run.output_dir",
            str(tmp_path),
            "--rollout.prompts_per_step",
            "2",
            "--rollout.group_size",
            "3",
        ],  # fmt: skip
    )
    rows = load_edit_rows(cfg.data.train_path)
    requests, rows = make_requests(cfg, rows, 0, D.init_distributed(), sampling_params(cfg))
    assert len(requests) == 6
    for r, row in zip(requests, rows):
        assert r.inputs["image"].size == (64, 64)
        assert r.inputs["image"].tobytes() == Image.open(row.metadata["image"]).convert("RGB").tobytes()
    # A group's requests share one decoded image (the adapter encodes it once).
    assert requests[0].inputs["image"] is requests[2].inputs["image"] is not requests[3].inputs["image"]


@pytest.mark.slow
def test_text_edit_reward_prefers_the_right_text_and_an_untouched_background(tmp_path):
    size, words = 256, ("CLOSED", "OPEN")
    scene = make_edit_data.scene(random.Random(3), size, words)
    source = make_edit_data.render(scene, size, words[0])
    source.save(tmp_path / "source.png")
    meta = {
        "image": str(tmp_path / "source.png"),
        "region": scene["region"],
        "target_text": "OPEN",
        "source": "x:1",
    }
    outputs = {
        "correct edit": make_edit_data.render(scene, size, "OPEN"),
        "wrong text": make_edit_data.render(scene, size, "SHUT"),
        "background changed": make_edit_data.render({**scene, "seed": scene["seed"] + 1}, size, "OPEN"),
        "unedited source": source,
    }
    # The model's output need not have the source's size: it is resized to it first.
    images = [im.resize((192, 192), Image.BICUBIC) for im in outputs.values()]
    scores = dict(zip(outputs, TextEditReward()(images, [""] * len(images), [meta] * len(images))))
    print("text_edit:", ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    assert scores["correct edit"] > 0.95
    assert scores["correct edit"] > scores["background changed"] + 0.03
    assert scores["correct edit"] > scores["wrong text"] + 0.3
    assert scores["correct edit"] > scores["unedited source"] + 0.3
    with pytest.raises(DataError, match='x:1: the text_edit reward needs "region"'):
        TextEditReward()(images[:1], [""], [{k: v for k, v in meta.items() if k != "region"}])


@pytest.mark.slow
def test_tiny_edit_recipe_under_torchrun(tiny_qwen_image_edit, tmp_path):
    out = tmp_path / "run"
    torchrun(
        2,
        REPO_ROOT / "yaml/qwen_image_edit_tiny_flowgrpo.yaml",
        "--model.path",
        str(tiny_qwen_image_edit),
        "--run.output_dir",
        str(out),
        "--run.steps",
        "2",
        "--rollout.prompts_per_step",
        "2",
        "--validation.every",
        "2",
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["train/updates"] == 1 and 0 <= m["reward/text_edit"] <= 1 for m in metrics)
    assert 0 <= metrics[-1]["val/reward"] <= 1
    lora = load_file(out / "lora/pytorch_lora_weights.safetensors")
    # peft's default init has B = 0: after two updates the exported LoRA is no longer a no-op.
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)
