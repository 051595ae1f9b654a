"""The rollout time breakdown on the tiny SD3 (CPU): every labelled phase of ours and of the stock pipeline
is counted as often as it runs (the times themselves are measured on GPUs)."""

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from benchmarks.breakdown import breakdown, label_stock
from omnirl.distributed import derive_seed
from omnirl.models.base import Request, SamplingParams
from tests.test_sd3 import make_adapter

STEPS = 3


@pytest.mark.slow
def test_ours_and_stock_break_down_into_the_same_phases(tiny_sd3):
    adapter = make_adapter(tiny_sd3)
    params = SamplingParams(32, 32, STEPS, 4.5, 0.7, "sde", 0, (0, 1))
    requests = [Request(f"a photo of {i}", i, i, derive_seed(0, 0, i), params) for i in range(2)]
    ours = breakdown(lambda: adapter.rollout(requests), torch.device("cpu"))
    calls = {k: v["calls"] for k, v in ours["phases"].items()}
    # noise: the initial draw, then each trained step: window 0 trains every step but the last (on CPU
    # there is nothing to copy to the host).
    steps = {"transformer": STEPS, "sde_step": STEPS}
    assert calls == {"encode": 1, "noise": 1 + STEPS - 1, **steps, "vae_decode": 1}
    assert all(v["host_s"] > 0 for v in ours["phases"].values()) and ours["wall_s"] > 0

    parts = {"transformer": adapter.policy, "vae": adapter.vae, "scheduler": adapter.scheduler}
    pipe = StableDiffusion3Pipeline(**{**adapter.text_pipe.components, **parts})
    pipe.set_progress_bar_config(disable=True)
    with label_stock(pipe):
        stock = breakdown(
            lambda: pipe(
                prompt=["a", "b"], height=32, width=32, num_inference_steps=STEPS, output_type="pil"
            ),
            torch.device("cpu"),
        )
    calls = {k: v["calls"] for k, v in stock["phases"].items()}
    assert calls["transformer"] == STEPS and calls["sde_step"] == STEPS and calls["vae_decode"] == 1
    assert calls["encode"] == 1 and calls["to_host"] == 1
    assert "encode_prompt" not in vars(pipe)  # the labels are gone after the context
