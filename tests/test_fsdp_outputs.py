"""The outputs of FSDP2 roots and units: a root whose last layer is an nn.Linear on a 3-D input (LTX-2's and
Qwen-Image-Edit's proj_out) and FLUX's single-stream blocks (two slices of one tensor) returned views, and
FSDP2 warned on every trained forward that an in-place op on them would drop their pre-backward hook.
`fsdp.apply_fsdp` gives them copies of their outputs instead; here that warning is an error, on one rank
(gloo, in this process)."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from omnirl import fsdp
from omnirl.autotune import set_checkpointing
from tests import test_flux
from tests.support_compare import max_diff, perturb_lora
from tests.test_ltx2 import GUIDANCE, HEIGHT, NEGATIVES, PROMPTS, WIDTH, make_adapter

VIEW_WARNING = r".*returned a view tensor"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class Root(nn.Module):
    """A unit, then a last nn.Linear on the [B, T, C] activations, as the video transformers end."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # a unit: its output is no view
        self.proj_out = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj_out(self.block(x))


def test_a_root_ending_in_a_linear_returns_no_view(one_rank):
    torch.manual_seed(0)
    model = Root()
    x = torch.randn(2, 3, 8)
    assert model(x)._base is not None  # what torch's nn.Linear gives on a 3-D input
    fsdp.apply_fsdp(model, [model.block], one_rank, "float32", "float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=VIEW_WARNING)
        out = model(x)
        assert out._base is None
        out.square().sum().backward()
    with torch.no_grad():  # no backward, so nothing hooked and nothing copied
        assert model(x)._base is not None


def test_ltx2_lora_gradients_under_fsdp_without_the_view_warning(tiny_ltx2, one_rank):
    """The trained forward of the tiny LTX-2.3 (both streams, CFG) under FSDP2 raises no view warning,
    and its LoRA gradients are those of the same forward without FSDP."""

    def grads(sharded: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the same LoRA init
        adapter = make_adapter(tiny_ltx2)
        for name, p in adapter.policy.named_parameters():  # B of a fresh LoRA is 0: A's gradient would be
            if "lora_B" in name:
                nn.init.normal_(p.data, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        if sharded:
            fsdp.apply_fsdp(adapter.policy, adapter.fsdp_units(), one_rank, "float32", "float32")
        grid = adapter.grid(HEIGHT, WIDTH)
        gen = torch.Generator().manual_seed(1)
        latents = torch.randn(2, *adapter.latent_shape(HEIGHT, WIDTH), generator=gen)
        sigmas = adapter.sigmas(4, adapter.stream_sizes(grid)[0])[[0, 2]]
        embeds = adapter.encode(PROMPTS[:2], NEGATIVES[:2], grid)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=VIEW_WARNING)
            adapter.velocity(latents, sigmas, embeds, GUIDANCE).square().mean().backward()
        return lora_grads(adapter.policy)

    assert_same_lora_grads(grads(False), grads(True))


def assert_same_lora_grads(plain: dict[str, torch.Tensor], sharded: dict[str, torch.Tensor]) -> None:
    assert plain.keys() == sharded.keys() and len(plain) > 0
    assert any("lora_A" in n for n in plain) and any("lora_B" in n for n in plain)
    for name, g in plain.items():
        assert g.abs().sum() > 0, name
        assert max_diff(g, sharded[name]) <= 1e-5 * max(1.0, float(g.abs().max())), name


def lora_grads(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA gradients of `policy` (full tensors), by parameter name without FSDP2's prefix."""
    out = {}
    for name, p in policy.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, dist.tensor.DTensor) else p.grad
            out[name.replace("_fsdp_wrapped_module.", "")] = g
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flux_single_blocks_return_no_view_under_fsdp(tiny_flux, one_rank, checkpointing):
    """FLUX.1's single-stream blocks, FSDP2 units, slice their output into text and image rows: under FSDP2
    the trained forward of the tiny FLUX.1-dev (with and without gradient checkpointing) raises no view
    warning, and its LoRA gradients are those of the same forward without FSDP."""

    def grads(sharded: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the same LoRA init
        adapter = test_flux.make_adapter(tiny_flux)
        perturb_lora(adapter, 0.1)  # B of a fresh LoRA is 0
        set_checkpointing(adapter.policy, checkpointing)
        if sharded:
            fsdp.apply_fsdp(adapter.policy, adapter.fsdp_units(), one_rank, "float32", "float32")
        h = test_flux.SIZE // adapter.vae_scale_factor
        channels = adapter.policy.config.in_channels // 4
        latents = torch.randn(2, channels, h, h, generator=torch.Generator().manual_seed(1))
        sigmas = torch.tensor([0.9, 0.4])
        embeds = adapter.encode(test_flux.PROMPTS[:2], None)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=VIEW_WARNING)
            adapter.velocity(latents, sigmas, embeds, 1.0).square().mean().backward()
        return lora_grads(adapter.policy)

    assert_same_lora_grads(grads(False), grads(True))
