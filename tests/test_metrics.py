"""MetricsLogger: metrics.jsonl, tensorboard events read back, image grids, disabled ranks."""

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from omnirl.metrics import GRID_PAD, MetricsLogger, read_metrics


def _events(tmp_path):
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_jsonl_and_tensorboard_scalars(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    for step in range(3):
        logger.log(step, {"reward/mean": 0.5 * step, "loss/policy": torch.tensor(-1.0 - step)})
        # Flushed each step: readable while the run goes on.
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == step + 1
    logger.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": s, "reward/mean": 0.5 * s, "loss/policy": -1.0 - s} for s in range(3)]
    scalars = _events(tmp_path).Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [(0, 0.0), (1, 0.5), (2, 1.0)]

    # A resumed run appends to the same file.
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    logger.log(3, {"reward/mean": 2.0})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_bad_values_and_lines(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    with pytest.raises(ValueError, match="metric 'x' is not a number"):
        logger.log(0, {"x": "high"})
    logger.close()
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, \n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(path)


def test_image_grid(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    images = [torch.full((3, 8, 12), i / 4) for i in range(5)]  # 5 images -> 3 columns, 2 rows
    images[0][:, 0, 0] = torch.tensor([1.0, 0.0, 0.5])
    captions = [f"prompt {i}" for i in range(5)]
    logger.log_images(10, "train/samples", images, captions)
    logger.close()

    png = Image.open(tmp_path / "samples" / "step_000010.png")
    width, height = 3 * (12 + GRID_PAD) + GRID_PAD, 2 * (8 + GRID_PAD) + GRID_PAD
    assert png.size == (width, height) and png.mode == "RGB"
    pixels = np.asarray(png)  # [H, W, 3]
    assert pixels[GRID_PAD, GRID_PAD].tolist() == [255, 0, 128]
    # Image 4 sits in row 1, column 1.
    y, x = GRID_PAD + (8 + GRID_PAD), GRID_PAD + (12 + GRID_PAD)
    assert (pixels[y : y + 8, x : x + 12] == 255).all()
    assert (pixels[y - 1, x : x + 12] == 0).all()  # padding
    assert (tmp_path / "samples" / "step_000010.txt").read_text().splitlines() == captions

    acc = _events(tmp_path)
    (image,) = acc.Images("train/samples")
    assert (image.step, image.width, image.height) == (10, width, height)


def test_grid_of_mixed_sizes(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    logger.log_images(0, "val", [torch.rand(3, 4, 6), torch.rand(3, 10, 2)])
    logger.close()
    assert Image.open(tmp_path / "samples" / "step_000000.png").size == (2 * (6 + 2) + 2, 10 + 4)


def test_progress_bar(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    logger.progress(total=10, initial=4)
    logger.update(4, reward=0.25, step_time=1.5)
    assert logger._bar.n == 5
    logger.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "reward=0.2500" in err


def test_disabled_rank_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    logger = MetricsLogger(str(out), enabled=False, tensorboard=True)
    logger.progress(total=10)
    logger.log(0, {"reward/mean": 1.0})
    logger.update(0, reward=1.0, step_time=0.1)
    logger.log_images(0, "train/samples", [torch.rand(3, 4, 4)], ["x"])
    logger.close()
    assert not out.exists()
    assert capsys.readouterr() == ("", "")


def test_resumed_run_rewrites_rows_after_its_checkpoint(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    for step in range(4):  # a run killed after step 3, whose last checkpoint was after step 1
        logger.log(step, {"reward/mean": float(step)})
    logger.close()
    history = read_metrics(tmp_path / "metrics.jsonl")[:2]
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True, start_step=2, history=history)
    assert read_metrics(tmp_path / "metrics.jsonl") == history
    logger.log(2, {"reward/mean": 20.0})
    logger.close()
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 20.0]
    scalars = _events(tmp_path).Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [(0, 0.0), (1, 1.0), (2, 20.0)]
