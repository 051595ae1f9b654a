"""MetricsLogger: metrics.jsonl, tensorboard events read back, image grids, videos and audio read back,
disabled ranks."""

import io
import wave
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from omnirl.metrics import GRID_PAD, MetricsLogger, read_metrics


def _events(tmp_path):
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0, "audio": 0})
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
    logger.log_videos(
        0, "train/videos", [torch.rand(2, 3, 4, 4)], fps=8, audios=[torch.zeros(1, 8)], sample_rate=8000
    )
    logger.log_audios(0, "train/audio", [torch.zeros(1, 8)], sample_rate=8000)
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


def _video(frames, height, width):
    """[F, 3, H, W] in [0, 1]: smooth colour waves that move a fifth of the width per frame, so the
    frames differ and a decoded frame only matches its own input frame."""
    y = torch.linspace(0, 1, height)[:, None]
    x = torch.linspace(0, 1, width)[None, :]
    return torch.stack(
        [
            torch.stack(
                [
                    0.5 + 0.4 * torch.cos(2 * torch.pi * (x - f / 5)) * torch.ones_like(y),
                    y * torch.ones_like(x),
                    0.5 + 0.4 * (x - y),
                ]
            )
            for f in range(frames)
        ]
    )


def _tone(channels, seconds, sample_rate):
    """[C, T]: a sine per channel (440, 660, ... Hz) at amplitude 0.5."""
    t = torch.arange(round(seconds * sample_rate)) / sample_rate
    return torch.stack([0.5 * torch.sin(2 * torch.pi * 220 * (c + 2) * t) for c in range(channels)])


# Mean absolute error of a decoded frame, in [0, 1]: through yuv420p and H.264 at crf 18 these waves come
# back about 0.016 off (4 levels of 255); the next frame's input is 0.11 away.
VIDEO_TOLERANCE = 0.03


def test_videos_with_their_audio(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    # The second video has odd sides, which yuv420p cannot hold: it is padded to 32 x 34.
    videos = [_video(5, 32, 32), _video(5, 31, 33)]
    audios = [_tone(2, 5 / 8, 16000), _tone(1, 0.5, 16000)]  # stereo as long as its video, mono shorter
    captions = ["a cat", "a dog"]
    logger.log_videos(3, "val/videos", videos, fps=8, captions=captions, audios=audios, sample_rate=16000)
    logger.close()
    samples = tmp_path / "samples"
    assert (samples / "step_000003.txt").read_text().splitlines() == captions

    for i, (video, audio) in enumerate(zip(videos, audios)):
        _, _, height, width = video.shape
        with av.open(str(samples / f"step_000003_{i}.mp4")) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
            assert stream.average_rate == 8
            decoded = torch.stack(
                [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
            )  # [F, H', W', 3]
        assert decoded.shape == (5, height + height % 2, width + width % 2, 3)
        decoded = decoded.permute(0, 3, 1, 2).float() / 255  # [F, 3, H', W']
        for f in range(5):
            assert (decoded[f, :, :height, :width] - video[f]).abs().mean() < VIDEO_TOLERANCE
        if height % 2:  # the padding row repeats the last one
            assert (decoded[:, :, height, :width] - video[:, :, -1]).abs().mean() < VIDEO_TOLERANCE

        with av.open(str(samples / f"step_000003_{i}.mp4")) as container:
            stream = container.streams.audio[0]
            assert stream.codec_context.name == "aac" and stream.rate == 16000
            assert stream.codec_context.channels == audio.shape[0]
            assert stream.duration * stream.time_base == audio.shape[1] / 16000
            sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)  # [C, T']
        # AAC is lossy and ends on whole 1024-sample frames, but the track starts in step with the input:
        # about 0.005 off, where one sample's shift would be 0.05.
        assert sound.shape[1] >= audio.shape[1]
        assert np.abs(sound[:, : audio.shape[1]] - audio.numpy()).mean() < 0.02

    acc = _events(tmp_path)
    for i, (video, audio) in enumerate(zip(videos, audios)):
        (image,) = acc.Images(f"val/videos/{i}")
        assert (image.step, image.width, image.height) == (3, video.shape[3], video.shape[2])
        gif = Image.open(io.BytesIO(image.encoded_image_string))
        assert gif.format == "GIF" and gif.n_frames == 5 and gif.size == (video.shape[3], video.shape[2])
        assert abs(gif.info["duration"] - 1000 / 8) <= 10  # GIF delays are whole hundredths
        for f in range(5):
            gif.seek(f)
            frame = torch.from_numpy(np.array(gif.convert("RGB"))).permute(2, 0, 1).float() / 255
            assert (frame - video[f]).abs().mean() < 0.05  # 256 colours a frame: about 0.024 off
        (track,) = acc.Audio(f"val/videos/{i}/audio")
        assert (track.step, track.sample_rate, track.length_frames) == (3, 16000, audio.shape[1])


def test_video_without_audio(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    logger.log_videos(0, "val/videos", [_video(3, 16, 16)], fps=30000 / 1001)
    logger.close()
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_000000_0.mp4"]
    with av.open(str(tmp_path / "samples" / "step_000000_0.mp4")) as container:
        assert not container.streams.audio
        assert container.streams.video[0].average_rate == Fraction(30000, 1001)  # NTSC's rate, exact
        assert len(list(container.decode(video=0))) == 3


def test_audios_as_wav(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    stereo = torch.rand(2, 500) * 2 - 1
    stereo[0, :3] = torch.tensor([1.0, -1.0, 1.5])  # the extremes, and one beyond them (clamped)
    audios = [stereo, _tone(1, 0.01, 22050)]  # 22050 Hz: any rate a WAV holds
    logger.log_audios(7, "val/audio", audios, sample_rate=22050, captions=["rain", "a bell"])
    logger.close()
    assert (tmp_path / "samples" / "step_000007.txt").read_text().splitlines() == ["rain", "a bell"]

    acc = _events(tmp_path)
    for i, audio in enumerate(audios):
        expected = audio.clamp(-1, 1).numpy()  # [C, T]
        with wave.open(str(tmp_path / "samples" / f"step_000007_{i}.wav")) as f:
            assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (audio.shape[0], 2, 22050)
            assert f.getnframes() == audio.shape[1]
            pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, audio.shape[0]).T
        assert np.abs(pcm / 32767 - expected).max() <= 0.5 / 32767 + 1e-7  # 16-bit rounding
        if i == 0:
            assert pcm[0, :3].tolist() == [32767, -32767, 32767]

        (track,) = acc.Audio(f"val/audio/{i}")
        assert (track.step, track.sample_rate, track.length_frames) == (7, 22050, audio.shape[1])
        with wave.open(io.BytesIO(track.encoded_audio_string)) as f:
            assert f.getnchannels() == 1  # the channels' mean: tensorboard takes mono
            mono = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
        assert np.abs(mono / 32767 - expected.mean(0)).max() <= 1 / 32767 + 1e-7  # add_audio truncates


def test_bad_sample_inputs(tmp_path):
    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    video, audio = _video(2, 8, 8), _tone(1, 0.01, 16000)
    with pytest.raises(ValueError, match=r"video 1: expected \[F, 3, H, W\], got \(3, 8, 8\)"):
        logger.log_videos(0, "v", [video, video[0]], fps=8)
    with pytest.raises(ValueError, match=r"video 0: expected \[F, 3, H, W\], got \(2, 4, 8, 8\)"):
        logger.log_videos(0, "v", [torch.rand(2, 4, 8, 8)], fps=8)
    with pytest.raises(ValueError, match="fps must be positive"):
        logger.log_videos(0, "v", [video], fps=0)
    with pytest.raises(ValueError, match="2 captions for 1 samples"):
        logger.log_videos(0, "v", [video], fps=8, captions=["a", "b"])
    with pytest.raises(ValueError, match="1 audio tracks for 2 videos"):
        logger.log_videos(0, "v", [video, video], fps=8, audios=[audio], sample_rate=16000)
    with pytest.raises(ValueError, match="positive sample_rate, got None"):
        logger.log_videos(0, "v", [video], fps=8, audios=[audio])
    with pytest.raises(ValueError, match="sample_rate without audios"):
        logger.log_videos(0, "v", [video], fps=8, sample_rate=16000)
    with pytest.raises(ValueError, match="AAC takes the sample rates .*, got 22000"):
        logger.log_videos(0, "v", [video], fps=8, audios=[audio], sample_rate=22000)
    with pytest.raises(ValueError, match=r"audio 0: expected \[C, T\], got \(160,\)"):
        logger.log_audios(0, "a", [audio[0]], sample_rate=16000)
    with pytest.raises(ValueError, match="1 captions for 2 samples"):
        logger.log_audios(0, "a", [audio, audio], sample_rate=16000, captions=["a"])
    with pytest.raises(ValueError, match="no audio tracks"):
        logger.log_audios(0, "a", [], sample_rate=16000)
    logger.close()
    assert not (tmp_path / "samples").exists()  # nothing was written before the check


def test_samples_are_logged_by_their_modality(tmp_path):
    """The trainer's sample logging picks the writer from what the outputs hold."""
    from omnirl.models.base import Output
    from omnirl.ops.diffusion import log_outputs

    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False)
    image, video, audio = torch.rand(3, 8, 8), torch.rand(3, 3, 16, 16), torch.rand(1, 1600) * 2 - 1
    log_outputs(logger, 0, [Output(image=image)] * 2, ["a", "b"])
    log_outputs(logger, 1, [Output(video=video, fps=8.0, audio=audio, sample_rate=16000)], ["c"])
    log_outputs(logger, 2, [Output(audio=audio, sample_rate=16000)], ["d"])
    logger.close()
    names = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert names == [
        "step_000000.png", "step_000000.txt", "step_000001.txt", "step_000001_0.mp4",
        "step_000002.txt", "step_000002_0.wav",
    ]  # fmt: skip
    import av

    with av.open(str(tmp_path / "samples/step_000001_0.mp4")) as f:
        assert len(f.streams.video) == 1 and len(f.streams.audio) == 1
