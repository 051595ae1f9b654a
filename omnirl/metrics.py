"""What users watch: metrics.jsonl, tensorboard scalars and samples (image grids, texts, videos, audio),
and a tqdm progress bar.

`MetricsLogger` writes them under `output_dir` (`log`, `log_images`, `log_texts`, `log_videos`,
`log_audios`, `progress` / `update`); only the enabled process (rank 0) writes, and on other ranks every
method returns at once, so the trainer calls them unconditionally. Videos are encoded in-process with
PyAV. `read_metrics` reads a metrics.jsonl back.

How it works: docs/recipes.md#outputs-and-metrics
"""

from __future__ import annotations

import io
import json
import math
import os
import wave
from fractions import Fraction
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
        row: dict[str, float] = {"step": step}
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
        if self._tb is not None:
            self._tb.add_image(tag, grid, step, dataformats="HWC")
        self._log_captions(step, tag, captions)
        if self._tb is not None:
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

    def log_videos(
        self,
        step: int,
        tag: str,
        videos: list[torch.Tensor],
        fps: float,
        captions: list[str] | None = None,
        audios: list[torch.Tensor] | None = None,
        sample_rate: int | None = None,
    ) -> None:
        """Videos [F, 3, H, W] in [0, 1], played at `fps`: samples/step_{step:06d}_{i}.mp4 each and a
        tensorboard animated GIF under `{tag}/{i}`. `audios` are the videos' own sound tracks, one
        [C, T] in [-1, 1] at `sample_rate` per video: muxed into its mp4 as AAC and logged as tensorboard
        audio (mono) under `{tag}/{i}/audio`, since a GIF has no sound. Captions as in `log_images`.

        One GIF per video rather than a grid of them: videos of one step may differ in length and size,
        and each GIF frame has one 256-colour palette, which a grid would share between all its cells."""
        if not self.enabled:
            return
        if not videos:
            raise ValueError("log_videos: no videos")
        for i, video in enumerate(videos):
            if video.dim() != 4 or video.shape[1] != 3 or 0 in video.shape:
                raise ValueError(f"video {i}: expected [F, 3, H, W], got {tuple(video.shape)}")
        if not fps > 0:
            raise ValueError(f"log_videos: fps must be positive, got {fps}")
        _check_captions(captions, len(videos))
        import av  # loads the libav libraries: only runs that log videos pay for it

        if audios is not None:
            _check_audios(audios, sample_rate)
            if len(audios) != len(videos):
                raise ValueError(f"log_videos: {len(audios)} audio tracks for {len(videos)} videos")
            aac_rates = av.Codec("aac", "w").audio_rates  # None: the codec takes any rate
            assert sample_rate is not None  # _check_audios refuses audio without one
            # ffmpeg's own error would only say "Invalid argument"
            if aac_rates is not None and sample_rate not in aac_rates:
                raise ValueError(f"log_videos: AAC takes the sample rates {aac_rates}, got {sample_rate}")
        elif sample_rate is not None:
            raise ValueError("log_videos: sample_rate without audios")
        samples = self.output_dir / "samples"
        samples.mkdir(exist_ok=True)
        # A float rate as a fraction a time base can hold: 30000/1001 (NTSC's 29.97) stays exact.
        rate = Fraction(fps).limit_denominator(1001)
        for i, video in enumerate(videos):
            frames = (video.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
            frames = frames.permute(0, 2, 3, 1).numpy()  # [F, H, W, 3]
            _, height, width, _ = frames.shape
            # yuv420p keeps one colour sample per 2x2 pixels, so its sides must be even: an odd side
            # gets one more row / column, a copy of the last, which keeps the edge's colour true.
            padded = np.pad(frames, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
            audio = None
            if audios is not None:
                audio = audios[i].detach().float().cpu().clamp(-1, 1).contiguous().numpy()  # [C, T]
            with av.open(str(samples / f"step_{step:06d}_{i}.mp4"), "w") as container:
                stream = container.add_stream("libx264", rate=rate)
                stream.width, stream.height = padded.shape[2], padded.shape[1]
                stream.pix_fmt = "yuv420p"  # 4:2:0, the layout every player decodes
                stream.options = {"crf": "18"}  # x264's default, 23, smears the detail a sample is read for
                layout = "" if audio is None else f"{audio.shape[0]}c"  # 1c is mono, 2c stereo
                audio_stream = None
                if audio is not None:
                    audio_stream = container.add_stream("aac", rate=sample_rate, layout=layout)
                for t, rgb in enumerate(padded):
                    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")  # converted to yuv420p by PyAV
                    frame.pts = t  # in the stream's time base, 1 / rate
                    container.mux(stream.encode(frame))
                container.mux(stream.encode(None))  # the frames x264 still holds for its B-frames
                if audio is not None and audio_stream is not None:
                    # One frame for the whole track: PyAV cuts it into AAC's 1024-sample frames.
                    track = av.AudioFrame.from_ndarray(audio, format="fltp", layout=layout)
                    assert sample_rate is not None  # audio comes with one (checked above)
                    track.sample_rate, track.pts = sample_rate, 0
                    container.mux(audio_stream.encode(track))
                    container.mux(audio_stream.encode(None))
            if self._tb is not None:
                # (protobuf makes its message classes at import: no checker sees them)
                from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

                gif = io.BytesIO()
                first, *rest = (Image.fromarray(rgb) for rgb in frames)
                # GIF delays are whole hundredths of a second: at 8 fps a frame shows for 120 ms, not 125.
                first.save(gif, format="GIF", save_all=True, append_images=rest, duration=1000 / fps, loop=0)
                # The summary SummaryWriter.add_video makes, without the moviepy it needs for the GIF.
                image = Summary.Image(
                    height=height, width=width, colorspace=3, encoded_image_string=gif.getvalue()
                )
                writer = self._tb.file_writer
                assert writer is not None  # a SummaryWriter makes its file writer when it is made
                writer.add_summary(Summary(value=[Summary.Value(tag=f"{tag}/{i}", image=image)]), step)
                if audio is not None:
                    assert sample_rate is not None  # audio comes with one (checked above)
                    self._tb.add_audio(f"{tag}/{i}/audio", audio.mean(0), step, sample_rate=sample_rate)
        self._log_captions(step, tag, captions)
        if self._tb is not None:
            self._tb.flush()

    def log_audios(
        self,
        step: int,
        tag: str,
        audios: list[torch.Tensor],
        sample_rate: int,
        captions: list[str] | None = None,
    ) -> None:
        """Audio samples [C, T] in [-1, 1] at `sample_rate`: samples/step_{step:06d}_{i}.wav each (16-bit
        PCM, all channels) and tensorboard audio under `{tag}/{i}`, downmixed to mono, the one channel
        SummaryWriter.add_audio takes. Captions as in `log_images`."""
        if not self.enabled:
            return
        _check_audios(audios, sample_rate)
        _check_captions(captions, len(audios))
        samples = self.output_dir / "samples"
        samples.mkdir(exist_ok=True)
        for i, audio in enumerate(audios):
            audio = audio.detach().float().cpu().clamp(-1, 1)  # [C, T]
            # Scaled by 32767, not 32768, so that -1 and 1 are both in range.
            pcm = (audio * 32767).round().to(torch.int16).T.contiguous().numpy()  # [T, C], interleaved
            with wave.open(str(samples / f"step_{step:06d}_{i}.wav"), "wb") as f:
                f.setnchannels(audio.shape[0])
                f.setsampwidth(2)
                f.setframerate(sample_rate)
                f.writeframes(pcm.astype("<i2").tobytes())  # WAV is little-endian
            if self._tb is not None:
                self._tb.add_audio(f"{tag}/{i}", audio.mean(0), step, sample_rate=sample_rate)
        self._log_captions(step, tag, captions)
        if self._tb is not None:
            self._tb.flush()

    def _log_captions(self, step: int, tag: str, captions: list[str] | None) -> None:
        """Captions of step `step`'s samples, in order: samples/step_{step:06d}.txt and tensorboard text."""
        if captions is None:
            return
        (self.output_dir / "samples" / f"step_{step:06d}.txt").write_text(
            "".join(c.replace("\n", " ") + "\n" for c in captions)
        )
        if self._tb is not None:
            self._tb.add_text(tag, "\n".join(f"{i}. {c}" for i, c in enumerate(captions, 1)), step)

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


def _check_captions(captions: list[str] | None, n: int) -> None:
    if captions is not None and len(captions) != n:
        raise ValueError(f"{len(captions)} captions for {n} samples")


def _check_audios(audios: list[torch.Tensor], sample_rate: int | None) -> None:
    if not audios:
        raise ValueError("no audio tracks")
    for i, audio in enumerate(audios):
        if audio.dim() != 2 or 0 in audio.shape:
            raise ValueError(f"audio {i}: expected [C, T], got {tuple(audio.shape)}")
    if sample_rate is None or sample_rate <= 0:
        raise ValueError(f"audio needs a positive sample_rate, got {sample_rate}")


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
