"""Sample statistics that show a policy gaming its reward, computed every step from the step's outputs.

`step_sums` returns sums and counts (`name_sum`, `name_count`) of this rank's samples, so that the means
over all ranks are one all-reduce (`reduce_means`): a group's diversity (`distance`), the images' and
videos' dark, clipped, colour-entropy and high-frequency statistics (`image_stats`), the audio's silence
and loudness (`audio_stats`), the responses' length and repetition (`repetition`). What each measures and
why its threshold is what it is: docs/health.md.

How it works: docs/health.md#reward-hacking-monitors
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import torch

from omnirl import distributed as D

DARK_LUMA = 0.05
SILENT_DBFS = -60.0


def luma(images: torch.Tensor) -> torch.Tensor:
    """[..., 3, H, W] in [0, 1] -> [..., H, W] (Rec. 601)."""
    return 0.299 * images[..., 0, :, :] + 0.587 * images[..., 1, :, :] + 0.114 * images[..., 2, :, :]


def image_stats(image: torch.Tensor) -> dict[str, float]:
    """One image [3, H, W] in [0, 1]: dark and clipped fractions, colour entropy, high-frequency energy."""
    x = image.float().clamp(0, 1)
    y = luma(x)
    q = (x * 255).round()
    clipped = ((q == 0) | (q == 255)).any(dim=0).float().mean()
    bins = (x * 8).long().clamp(max=7)  # [3, H, W]
    idx = (bins[0] * 64 + bins[1] * 8 + bins[2]).flatten()
    p = torch.bincount(idx, minlength=512).double()
    p = p[p > 0] / p.sum()
    entropy = float(-(p * p.log2()).sum())
    spec = torch.fft.fftshift(torch.fft.fft2(y - y.mean())).abs().pow(2)
    h, w = y.shape
    fy = torch.linspace(-1, 1, h).view(-1, 1)
    fx = torch.linspace(-1, 1, w).view(1, -1)
    high = (fy.pow(2) + fx.pow(2)).sqrt() > 0.5
    energy = float(spec.sum())
    return {
        "dark_frac": float((y < DARK_LUMA).float().mean()),
        "saturated_frac": float(clipped),
        "colour_entropy": entropy,
        "high_freq_energy": float(spec[high].sum()) / energy if energy > 0 else 0.0,
    }


def audio_stats(audio: torch.Tensor, sample_rate: int) -> dict[str, float]:
    """One track [C, T] in [-1, 1]: silent fraction of 10 ms frames and loudness (RMS, dBFS)."""
    mono = audio.float().mean(dim=0)
    frame = max(1, sample_rate // 100)
    n = mono.numel() // frame
    if n == 0:
        return {}
    rms = mono[: n * frame].view(n, frame).pow(2).mean(dim=1).sqrt()
    db = 20 * torch.log10(rms.clamp(min=1e-10))
    total = float(mono.pow(2).mean().sqrt())
    return {
        "silence_frac": float((db < SILENT_DBFS).float().mean()),
        "loudness_dbfs": 20 * math.log10(max(total, 1e-10)),
    }


def repetition(ids: list[int], n: int = 3) -> float:
    """The fraction of a response's n-grams that already occurred in it (0: none repeats)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def distance(a, b) -> float:
    """The distance of two samples of one group (see the module docstring)."""
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            n = min(a.shape[-1], b.shape[-1])  # audio tracks of unequal length: their common start
            a, b = a[..., :n], b[..., :n]
        return float((a.float() - b.float()).pow(2).mean().sqrt())
    sa, sb = set(a), set(b)
    return 1 - len(sa & sb) / max(len(sa | sb), 1)


def sample_of(traj):
    """What the diversity of a sample compares: its video, image, audio or response tokens (None: the
    sample has none of them decoded, e.g. a latent reward's rollout)."""
    if hasattr(traj, "response_ids"):
        return traj.response_ids.tolist()
    out = traj.output
    for field in ("video", "image", "audio"):
        if (value := getattr(out, field)) is not None:
            return value
    return None


def finite(traj) -> bool:
    """Whether a decoded sample holds only finite values (a NaN sample has no statistics: the update
    stops the run on it, `omnirl.step`)."""
    if hasattr(traj, "response_ids"):
        return True
    out = traj.output
    values = [getattr(out, f) for f in ("video", "image", "audio")]
    return all(bool(torch.isfinite(v).all()) for v in values if isinstance(v, torch.Tensor))


def step_sums(trajs: list) -> dict[str, float]:
    """This rank's sums and counts of every statistic over the step's finite samples (the module
    docstring)."""
    sums: dict[str, float] = defaultdict(float)
    trajs = [t for t in trajs if finite(t)]

    def add(name: str, value: float) -> None:
        sums[f"{name}_sum"] += value
        sums[f"{name}_count"] += 1

    groups: dict[int, list] = defaultdict(list)
    for t in trajs:
        if (s := sample_of(t)) is not None:
            groups[t.request.group_id].append(s)
        if hasattr(t, "response_ids"):
            ids = t.response_ids.tolist()
            add("response_len", float(len(ids)))
            add("repetition", repetition(ids))
            continue
        out = t.output
        if out.image is not None:
            for k, v in image_stats(out.image).items():
                add(k, v)
        if out.video is not None:
            for k, v in image_stats(out.video[len(out.video) // 2]).items():  # the middle frame
                add(k, v)
            if len(out.video) > 1:
                add("temporal_variation", float((out.video[1:] - out.video[:-1]).abs().mean()))
        if out.audio is not None:
            for k, v in audio_stats(out.audio, out.sample_rate).items():
                add(k, v)
    for samples in groups.values():
        if len(samples) < 2:
            continue
        pair_d = [distance(a, b) for a, b in itertools.combinations(samples, 2)]
        add("diversity", sum(pair_d) / len(pair_d))
    return dict(sums)


def reduce_means(sums: dict[str, float], names: list[str]) -> dict[str, float]:
    """The global mean of each statistic of `names` (the same list on every rank); NaN where no rank had
    a sample of it. Collective."""
    flat = [sums.get(f"{n}_{part}", 0.0) for n in names for part in ("sum", "count")]
    t = D.all_reduce(torch.tensor(flat, dtype=torch.float64)).view(-1, 2)
    return {n: (s / c if c else math.nan) for n, (s, c) in zip(names, t.tolist())}


# Every statistic, in a fixed order: every rank reduces all of them (NaN where none applies).
STATISTICS = [
    "diversity",
    "dark_frac",
    "saturated_frac",
    "colour_entropy",
    "high_freq_energy",
    "temporal_variation",
    "silence_frac",
    "loudness_dbfs",
    "response_len",
    "repetition",
]
