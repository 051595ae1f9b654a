"""Comparisons shared by the diffusion adapter tests."""

import torch


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def packed_serial_diffs(packed, serial) -> tuple[float, float]:
    """Checks each (packed, serial) pair of trajectories of the tiny models (the same trained steps, two
    of them, latents [2, 4, 16, 16], non-zero log-probs) and returns the max |diff| of their final and
    next latents and of their log-probs."""
    d_latents = d_logprobs = 0.0
    for a, b in zip(packed, serial):
        assert a.step_indices.tolist() == b.step_indices.tolist()
        assert a.latents.shape == (2, 4, 16, 16) and a.logprobs.shape == (2,)
        assert torch.all(a.logprobs != 0)
        d_latents = max(
            d_latents, max_diff(a.final_latents, b.final_latents), max_diff(a.next_latents, b.next_latents)
        )
        d_logprobs = max(d_logprobs, max_diff(a.logprobs, b.logprobs))
    return d_latents, d_logprobs
