"""What the diffusion adapter tests share: their tiny adapters' configs and requests, the initial latents
the reference pipelines start from, the LoRA they perturb and export, and the comparisons."""

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from omnirl.config import Config, RolloutConfig
from omnirl.distributed import derive_seed
from omnirl.models.base import Request, SamplingParams
from omnirl.models.diffusers_setup import LORA_FILE
from omnirl.recipe import config_for


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def tiny_config(adapter: str, path, **lora) -> Config:
    """The config of `adapter` (`config_for`) on the checkpoint at `path`, with the LoRA fields `lora`."""
    cfg = config_for(adapter)
    cfg.model.path = str(path)
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    return cfg


def prompt_requests(
    params: SamplingParams, prompts: list[str], negatives: list[str], first: int = 0, images=None
) -> list[Request]:
    """One request per (prompt, negative prompt), its group and index counted from `first` and its seed
    that of the request of that index in step 0 of base seed 7; request i conditioned on the image
    images[i % len(images)] when `images` are given."""
    return [
        Request(
            p,
            first + i,
            first + i,
            derive_seed(7, 0, first + i),
            params,
            negative_prompt=n,
            inputs={"image": images[i % len(images)]} if images else {},
        )
        for i, (p, n) in enumerate(zip(prompts, negatives))
    ]


def initial_latents(requests: list[Request], shape: tuple[int, ...]) -> torch.Tensor:
    """The initial latents [B, *shape] an adapter draws for `requests`, each from its own seed: what the
    reference pipeline is given, so that both sample from the same noise."""
    return torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(r.seed)) for r in requests]
    )


def load_pipeline(pipeline_cls, path, **components):
    """The reference pipeline of the tiny checkpoint at `path`, without progress bars."""
    pipe = pipeline_cls.from_pretrained(path, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def perturb_lora(adapter, std: float) -> None:
    """The LoRA's B matrices (zero at initialisation, where the LoRA changes nothing) drawn from
    N(0, std^2), seeded."""
    torch.manual_seed(0)
    for name, p in adapter.policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, std)


def export_lora_twice(adapter, out_dir: Path, files: tuple[str, ...] = (LORA_FILE,)) -> None:
    """Exports the LoRA from the module and, as an FSDP run does, from its gathered full state dict (into
    out_dir / "from_state_dict"), and checks that both wrote the same tensors into `files`, one per
    trainable parameter in all."""
    adapter.export_lora(out_dir)
    adapter.export_lora(out_dir / "from_state_dict", adapter.policy.state_dict())
    total = 0
    for f in files:
        exported, again = load_file(out_dir / f), load_file(out_dir / "from_state_dict" / f)
        assert exported.keys() == again.keys() and all(torch.equal(v, again[k]) for k, v in exported.items())
        total += len(exported)
    assert total == len(adapter.trainable_parameters())


def rollout_outputs(adapter, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final latents [B, ...] and images [B, 3, H, W] of the adapter's rollout of `requests`."""
    trajs = adapter.rollout(requests)
    return torch.stack([t.final_latents for t in trajs]), torch.stack([t.output.image for t in trajs])


def check_lora_in_pipeline(
    pipe,
    lora_dir: Path,
    pipeline_outputs: Callable[[], Sequence[torch.Tensor]],
    rollout_outputs: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Loads the LoRA exported into `lora_dir` into the stock pipeline `pipe` and checks that every exported
    weight lands in a module of the stock transformer (none unmatched), that it moves the pipeline's output,
    and that the pipeline with it gives the rollout's final latents and images. `pipeline_outputs()` runs
    the pipeline and `rollout_outputs()` the adapter's rollout on the same requests, each returning
    (final latents, images) in one layout."""
    exported = load_file(lora_dir / LORA_FILE)
    base, _ = pipeline_outputs()
    pipe.load_lora_weights(lora_dir)
    loaded = {k for k in pipe.transformer.state_dict() if "lora_" in k}
    assert len(loaded) == len(exported)
    ref_latents, ref_images = pipeline_outputs()
    latents, images = rollout_outputs()
    change, d_latents, d_images = (
        max_diff(ref_latents, base),
        max_diff(latents, ref_latents),
        max_diff(images, ref_images),
    )
    print(f"LoRA moves the pipeline {change:.2e}; vs rollout: latents {d_latents:.2e}, images {d_images:.2e}")
    assert change > 1e-2
    assert d_latents < 1e-5 and d_images < 1e-5


def packed_serial_diffs(packed, serial, shape: tuple[int, ...] = (4, 16, 16)) -> tuple[float, float]:
    """Checks each (packed, serial) pair of trajectories of the tiny models (the same trained steps, two
    of them, latents [2, *shape], non-zero log-probs) and returns the max |diff| of their final and next
    latents and of their log-probs."""
    d_latents = d_logprobs = 0.0
    for a, b in zip(packed, serial):
        assert a.step_indices.tolist() == b.step_indices.tolist()
        assert a.latents.shape == (2, *shape) and a.logprobs.shape == (2,)
        assert torch.all(a.logprobs != 0)
        d_latents = max(
            d_latents, max_diff(a.final_latents, b.final_latents), max_diff(a.next_latents, b.next_latents)
        )
        d_logprobs = max(d_logprobs, max_diff(a.logprobs, b.logprobs))
    return d_latents, d_logprobs


def compiled_rollout_diffs(adapter, make: Callable[[], list[Request]], max_num_seqs: int, monkeypatch):
    """The packed rollout with the blocks compiled (`generation.compile`; dynamo with its 'eager' backend,
    which traces with fullgraph=True as inductor would, so a graph break fails here) against the eager
    one, on the same requests. A second compiled rollout must not recompile. Returns (graphs compiled,
    max |diff| of the final latents, of the log-probs) over both compiled rollouts."""
    from torch._dynamo.utils import counters

    from omnirl.rollout import compiled
    from omnirl.rollout.diffusion import DiffusionEngine

    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    start = counters["stats"]["unique_graphs"]
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=max_num_seqs, compile=True))
    first = engine.generate(make())
    graphs = counters["stats"]["unique_graphs"] - start
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = engine.generate(make())
    assert all("forward" not in vars(m) for m in adapter.fsdp_units()), "training must run the eager forward"
    eager = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=max_num_seqs)).generate(make())
    d_latents = d_logprobs = 0.0
    for run in (first, second):
        for a, b in zip(run, eager, strict=True):
            assert a.step_indices.tolist() == b.step_indices.tolist()
            d_latents = max(d_latents, max_diff(a.final_latents, b.final_latents))
            d_logprobs = max(d_logprobs, max_diff(a.logprobs, b.logprobs))
    return graphs, d_latents, d_logprobs
