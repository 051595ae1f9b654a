"""What users watch: metrics.jsonl, tensorboard scalars and image grids, and a tqdm progress bar.

Only the enabled process (rank 0) writes anything; on other ranks every method returns at once, so
the trainer calls them unconditionally. Layout under `output_dir`:

  metrics.jsonl                one JSON object per step, {"step": s, **scalars}, appended and flushed
  tb/                          tensorboard event files (scalars; image grids and captions)
  samples/step_{s:06d}.png     the image grid of step s (and .txt with its captions, one per line)
  samples/step_{s:06d}.txt     an omni model's sample responses of step s, one per line
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

GRID_PAD = 2  # pixels between and around the cells of an image grid


class MetricsLogger:
    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        tensorboard: bool,
        start_step: int = 0,
        history: list[dict] | None = None,
    ):
        """The trainer passes `history`, the rows of the steps before `start_step` (a resumed run's, from its
        checkpoint; none for a fresh start): metrics.jsonl is rewritten to exactly those rows and
        tensorboard drops its events from `start_step` on, so rows that a killed run wrote after its last
        checkpoint are not logged twice. Without `history` rows are appended to the file as it is."""
        self.enabled = enabled
        if not enabled:
            return
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "metrics.jsonl"
        if history is not None:
            assert all(row["step"] < start_step for row in history)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in history))
            os.replace(tmp, path)  # atomic: a kill here leaves the old rows or the new, never half
        self._jsonl = open(path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only where it is used

            self._tb = SummaryWriter(
                str(self.output_dir / "tb"), purge_step=start_step if history is not None else None
            )
        self._bar = None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One row of metrics.jsonl and one tensorboard scalar per key (keys are slash-namespaced).

        Values are anything `float()` accepts (Python / numpy numbers, one-element tensors)."""
        if not self.enabled:
            return
        assert "step" not in scalars
        row = {"step": step}
        for key, value in scalars.items():
            try:
                row[key] = float(value)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"metric {key!r} is not a number: {value!r}") from None
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)

    def log_images(
        self, step: int, tag: str, images: list[torch.Tensor], captions: list[str] | None = None
    ) -> None:
        """Images [3, H, W] in [0, 1] as one grid (row-major, about square): a tensorboard image under
        `tag` and samples/step_{step:06d}.png; captions, in grid order, go to tensorboard text under
        `tag` and to samples/step_{step:06d}.txt."""
        if not self.enabled:
            return
        assert images and (captions is None or len(captions) == len(images))
        grid = make_grid(images)  # [H', W', 3] uint8
        samples = self.output_dir / "samples"
        samples.mkdir(exist_ok=True)
        Image.fromarray(grid).save(samples / f"step_{step:06d}.png")
        if captions is not None:
            (samples / f"step_{step:06d}.txt").write_text(
                "".join(c.replace("\n", " ") + "\n" for c in captions)
            )
        if self._tb is not None:
            self._tb.add_image(tag, grid, step, dataformats="HWC")
            if captions is not None:
                self._tb.add_text(tag, "\n".join(f"{i}. {c}" for i, c in enumerate(captions, 1)), step)
            self._tb.flush()

    def log_texts(self, step: int, tag: str, texts: list[str]) -> None:
        """Text samples (an omni model's responses): samples/step_{step:06d}.txt, one per line, and a
        tensorboard text under `tag`."""
        if not self.enabled:
            return
        samples = self.output_dir / "samples"
        samples.mkdir(exist_ok=True)
        (samples / f"step_{step:06d}.txt").write_text("".join(t.replace("\n", " ") + "\n" for t in texts))
        if self._tb is not None:
            self._tb.add_text(tag, "\n\n".join(texts), step)
            self._tb.flush()

    def progress(self, total: int, initial: int = 0) -> None:
        """Start the progress bar over `total` steps, `initial` of them already done (a resumed run)."""
        if not self.enabled:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=initial, desc="steps", dynamic_ncols=True)

    def update(self, step: int, reward: float, step_time: float) -> None:
        """Step `step` (0-based, as passed to `log`) is done: move the bar to step + 1, show its numbers."""
        if not self.enabled or self._bar is None:
            return
        self._bar.set_postfix(reward=f"{reward:.4f}", step_s=f"{step_time:.2f}", refresh=False)
        self._bar.update(step + 1 - self._bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._jsonl.close()


def make_grid(images: list[torch.Tensor]) -> np.ndarray:
    """Images [3, H, W] in [0, 1] (sizes may differ: each cell is as large as the largest) ->
    one [H', W', 3] uint8 array, ceil(sqrt(n)) columns, GRID_PAD black pixels between and around cells."""
    for i, img in enumerate(images):
        assert img.dim() == 3 and img.shape[0] == 3, f"image {i}: expected [3, H, W], got {tuple(img.shape)}"
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    cell_h = max(img.shape[1] for img in images) + GRID_PAD
    cell_w = max(img.shape[2] for img in images) + GRID_PAD
    grid = torch.zeros(3, rows * cell_h + GRID_PAD, cols * cell_w + GRID_PAD)
    for i, img in enumerate(images):
        y, x = (i // cols) * cell_h + GRID_PAD, (i % cols) * cell_w + GRID_PAD
        grid[:, y : y + img.shape[1], x : x + img.shape[2]] = img.detach().float().cpu()
    return (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl, in order. A malformed line is a ValueError naming file and line."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
    return rows
