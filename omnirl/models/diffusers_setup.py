"""What every diffusion adapter does the same way around its own classes.

- `DiffusionBase`: the members of the `DiffusionAdapter` Protocol that do not depend on the family;
  every diffusion adapter subclasses it. `DiffusersBase`: the same for a family built on a diffusers
  pipeline, with the checkpoint check and the LoRA and merged exports.
- `attention_kernels` (the family's choice of PyTorch attention kernels on a GPU), `check_checkpoint`,
  `make_trainable` (a peft LoRA over a frozen base, or the whole model trainable),
  `guided_velocity` (classifier-free guidance as the SD3 and Wan pipelines compute it), `trajectories`
  (a packed batch's `Trajectory` records), `save_lora` (a LoRA in the family's diffusers format).

The module loading stays in each adapter: the measuring scripts replace each adapter's `load_pretrained`.

How it works: docs/extending.md#how-to-add-a-diffusion-family
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import torch
from diffusers.training_utils import cast_training_params
from peft.utils.error import NoMatchingPeftModuleError
from torch import nn

from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, place_policy
from omnirl.models.base import Output, Request, Trajectory
from omnirl.models.flow_sde import Pool, WindowedSampler
from omnirl.models.peft_lora import lora_disabled, peft_config, sorted_sets

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name


class DiffusionBase:
    """The family-independent part of a `DiffusionAdapter`, whatever holds the model.

    A subclass calls `super().__init__(cfg, device)` first (it checks model.path by the subclass's
    `check_path` and sets `model_path`, `device`, `lora` and `transformer_dtype`), loads its modules, sets
    `transformer` (the trained module) and makes it trainable (`make_trainable`). A family whose policy is
    not one transformer (Wan2.2's two experts) overrides `policy`, `trained_modules` and `fsdp_units`; one
    whose embeddings differ in length overrides `batch_embeds`. What an export holds is the subclass's
    (`DiffusersBase`: a diffusers pipeline's; BAGEL: its official layout).
    """

    transformer: Any  # a diffusers model (BAGEL: BagelModel): its config and blocks are read by name
    device: torch.device
    lora: bool  # model.finetune lora: the base frozen under a LoRA
    transformer_dtype: torch.dtype  # the trained module's dtype: model.dtype under a LoRA, else float32
    compat_key: Callable[[Request], tuple]  # the subclass's: what requests of one packed batch share
    # False: PyTorch's cuDNN attention kernel is turned off for the process on a CUDA device, so that
    # scaled_dot_product_attention takes one of its other kernels. A family sets it where the cuDNN
    # kernel failed on a GPU (FLUX.1: the trained backward, omnirl/models/flux/README.md).
    cudnn_attention: bool = True

    def __init__(self, cfg: Config, device: torch.device):
        self.check_path(cfg.model.path)
        self.model_path = cfg.model.path
        self.device = device
        attention_kernels(self, device)
        # A fully fine-tuned transformer is trained, hence kept, in float32; a LoRA base stays in model.dtype.
        self.lora = cfg.model.finetune == "lora"
        self.transformer_dtype = DTYPES[cfg.model.dtype] if self.lora else torch.float32

    @classmethod
    def check_path(cls, path: str) -> None:
        """model.path holds this family's checkpoint, else a ConfigError naming what is wrong."""
        raise NotImplementedError

    @property
    def policy(self) -> nn.Module:
        """The trained module: the one transformer."""
        return self.transformer

    def trained_modules(self) -> dict[str, nn.Module]:
        """The pipeline's components that training changes, by their name in the pipeline."""
        return {"transformer": self.transformer}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.transformer.transformer_blocks)

    def logprob_pool(self, params) -> Pool | None:
        """None: one latent stream, its log-prob the mean over all latent dims."""
        return None

    def batch_embeds(
        self, embeds: list[dict[str, torch.Tensor]], bucketed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Stacked: every sample's embeddings have one length per key (the text encoder pads them), so
        `bucketed` changes nothing."""
        return {k: torch.stack([e[k] for e in embeds]) for k in embeds[0]}

    def check_batch(self, requests: list[Request], multiple: int) -> tuple:
        """The compatibility key a packed batch shares (asserted), after checking that its sampling height
        and width are multiples of `multiple` pixels (the VAE's factor times the transformer's patch)."""
        key = self.compat_key(requests[0])
        assert all(self.compat_key(r) == key for r in requests), "a packed batch must share one compat_key"
        p = requests[0].params
        if p.height % multiple or p.width % multiple:
            raise ValueError(
                f"sampling height and width must be multiples of {multiple}, got {p.height}x{p.width}"
            )
        return key

    def prompt_problem(self, row: PromptRow) -> str | None:
        """None: a prompt longer than the text encoder's limit is truncated to it, as the pipeline does."""
        return None

    def lora_disabled(self):
        if not self.lora:
            raise ValueError("the reference policy with the LoRA off needs model.finetune 'lora'")
        return lora_disabled(self.policy)


class DiffusersBase(DiffusionBase):
    """`DiffusionBase` for a family built on a diffusers pipeline (`pipeline_cls`: the checkpoints it
    loads, the LoRA format it writes); every diffusion adapter but BAGEL's subclasses it. A family whose
    policy is more than one transformer overrides `export_lora`, `lora_files` and `load_lora` too.

    What an export holds is the adapter's: `export_lora` writes one LoRA file per trained component
    (`lora_files` names them), `export_merged` and `merge_lora` write the whole pipeline with every trained
    component's weights in it.
    """

    pipeline_cls: type

    @classmethod
    def check_path(cls, path: str) -> None:
        check_checkpoint(path, cls.pipeline_cls)

    def export_lora(self, out_dir: str | Path, state_dict: dict | None = None) -> None:
        """Write the LoRA as `pytorch_lora_weights.safetensors` in the diffusers format, loadable with the
        pipeline's `load_lora_weights`. An FSDP run passes the gathered full state dict."""
        if not self.lora:
            raise ValueError("export_lora needs model.finetune 'lora'")
        save_lora(self.pipeline_cls, self.transformer, out_dir, state_dict)

    def export_merged(self, out_dir: str | Path, dtype: torch.dtype) -> None:
        """The whole pipeline of model.path in `dtype` (safetensors), every trained component in it: a LoRA
        fused into its base (`merge_lora`), or a fully fine-tuned component in place of the base's."""
        if self.lora:
            with tempfile.TemporaryDirectory() as tmp:
                self.export_lora(tmp)
                self.merge_lora(self.model_path, Path(tmp), out_dir, dtype)
            return
        pipe = self.pipeline_cls.from_pretrained(
            self.model_path, torch_dtype=torch.float32, **self.trained_modules()
        )
        pipe.to(dtype).save_pretrained(out_dir, safe_serialization=True)

    @classmethod
    def lora_files(cls, model_path: str) -> dict[str, str]:
        """Component -> the file `export_lora` writes its LoRA to, for the checkpoint at `model_path`."""
        return {"transformer": LORA_FILE}

    @classmethod
    def load_lora(cls, pipe, lora_dir: Path, component: str, weight_name: str) -> None:
        """Load the LoRA file `weight_name` of `lora_dir` into `pipe`'s `component`."""
        pipe.load_lora_weights(lora_dir, weight_name=weight_name)

    @classmethod
    def merge_lora(cls, model_path: str, lora_dir: Path, out_dir: str | Path, dtype: torch.dtype) -> None:
        """The whole pipeline of `model_path` in `dtype` (safetensors) with the LoRA of `lora_dir` (every file
        of `lora_files`) fused into each component's weights by diffusers' `fuse_lora`, in float32."""
        files = cls.lora_files(model_path)
        pipe = cls.pipeline_cls.from_pretrained(model_path, torch_dtype=torch.float32)
        for component, weight_name in files.items():
            cls.load_lora(pipe, lora_dir, component, weight_name)
        pipe.fuse_lora(components=list(files))
        pipe.unload_lora_weights()
        pipe.to(dtype).save_pretrained(out_dir, safe_serialization=True)


def attention_kernels(adapter: DiffusionBase, device: torch.device) -> None:
    """On a CUDA device, turn PyTorch's cuDNN attention off for the process where the family says so
    (`cudnn_attention`); scaled_dot_product_attention then picks among the other kernels. Process-wide,
    as one process trains one family."""
    if device.type == "cuda" and not adapter.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)


def check_checkpoint(path: str, pipeline_cls) -> None:
    """`path` (a local directory or a hub id) holds a `pipeline_cls` checkpoint, else a ConfigError."""
    try:
        index = pipeline_cls.load_config(path)
    except OSError as e:
        raise ConfigError(
            f"model.path {path!r} is neither a local diffusers checkpoint (a directory with "
            f"model_index.json) nor a loadable hub id: {e}"
        ) from None
    if index.get("_class_name") != pipeline_cls.__name__:
        raise ConfigError(
            f"model.path {path!r} holds a {index.get('_class_name')}, not a {pipeline_cls.__name__}"
        )
    if not os.path.isdir(path):
        return  # a hub id: the hub's snapshot is complete
    for name, entry in index.items():
        if not name.startswith("_") and isinstance(entry, list) and entry[0] is not None:
            if not os.path.isdir(os.path.join(path, name)):
                raise ConfigError(
                    f"model.path {path!r}: its model_index.json lists the component {name} "
                    f"({entry[-1]}), but there is no folder {os.path.join(path, name)}"
                )


def make_trainable(transformer: Any, cfg: Config, device: torch.device) -> None:
    """LoRA from `cfg.lora` when `model.finetune` is "lora" (base frozen; the adapter in float32 even over
    a bf16 base, since the optimizer updates it), else every weight trainable; then gradient
    checkpointing from `model.gradient_checkpointing`, and onto `device` unless FSDP2 will shard the frozen
    base (`place_policy`: then it stays on the host until `fully_shard` places it)."""
    if cfg.model.finetune == "lora":
        transformer.requires_grad_(False)
        config = peft.LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,  # pyright: ignore[reportArgumentType] (peft types it int)
            target_modules=cfg.lora.target_modules,
            init_lora_weights=True if cfg.lora.init == "default" else "gaussian",
            lora_dropout=cfg.lora.dropout,
        )
        try:
            transformer.add_adapter(config)
        except NoMatchingPeftModuleError:
            raise ConfigError(
                f"lora.target_modules {cfg.lora.target_modules} bind no module of the "
                f"{type(transformer).__name__}: the run would train nothing"
            ) from None
        cast_training_params(transformer, torch.float32)
    else:
        transformer.requires_grad_(True)
    if cfg.model.gradient_checkpointing is True:  # auto decides at the first update (omnirl.autotune)
        transformer.enable_gradient_checkpointing()
    place_policy(transformer, cfg.distributed.frozen_base, device)


def guided_velocity(
    forward,
    x: torch.Tensor,
    timestep: torch.Tensor,
    embeds: dict[str, torch.Tensor],
    keys: tuple[str, ...],
    guidance_scale: float,
    fused_cfg: bool,
) -> torch.Tensor:
    """Classifier-free guidance as the SD3 and Wan pipelines compute it: uncond + s * (cond - uncond), cond
    being `forward(x, timestep, *inputs)` of the text inputs `embeds[k]` for k in `keys` and uncond the same
    of `embeds["negative_" + k]`. With `fused_cfg` both go through one forward, stacked [uncond; cond] as
    the pipelines stack them, else through two; without guidance (s <= 1) only the conditional one runs."""
    cond = [embeds[k] for k in keys]
    if guidance_scale <= 1:
        return forward(x, timestep, *cond)
    uncond = [embeds[f"negative_{k}"] for k in keys]
    if fused_cfg:
        both = [torch.cat([u, c]) for u, c in zip(uncond, cond)]
        v_uncond, v_cond = forward(torch.cat([x, x]), torch.cat([timestep, timestep]), *both).chunk(2)
    else:
        v_uncond = forward(x, timestep, *uncond)
        v_cond = forward(x, timestep, *cond)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def trajectories(
    requests: list[Request],
    sampler: WindowedSampler,
    sigmas: torch.Tensor,
    embeds: list[dict[str, torch.Tensor]],
    outputs: list[Output],
    final_latents: torch.Tensor,
) -> list[Trajectory]:
    """The packed batch's records, all on the host: for request b its trained steps (`sampler.record`:
    latents, next_latents, means [K, *latent], step_indices, logprobs [K]), the sigma schedule [T + 1], its
    embeddings `embeds[b]`, its output and its final latents `final_latents[b]`."""
    return [
        Trajectory(
            request=req,
            **sampler.record(b),
            sigmas=sigmas,
            embeds=embeds[b],
            output=outputs[b],
            final_latents=final_latents[b],
        )
        for b, req in enumerate(requests)
    ]


def save_lora(
    pipeline_cls,
    transformer: nn.Module,
    out_dir,
    state_dict: dict | None = None,
    weight_name: str = LORA_FILE,
) -> None:
    """Write `transformer`'s LoRA as `out_dir/<weight_name>` in the diffusers format, loadable with
    `pipeline_cls.load_lora_weights`. An FSDP run passes the gathered full state dict."""
    layers = peft.get_peft_model_state_dict(transformer, state_dict=state_dict)
    pipeline_cls.save_lora_weights(
        out_dir,
        transformer_lora_layers=layers,
        weight_name=weight_name,
        # Without it a loader assumes lora_alpha == rank and scales the update wrongly.
        transformer_lora_adapter_metadata=sorted_sets(peft_config(transformer)["default"]).to_dict(),
    )
    sort_safetensors_header(Path(out_dir) / weight_name)


def sort_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted. The writer (Rust) puts the keys of
    `__metadata__` in hash-map order, which changes from process to process, so two exports of the same
    weights would differ in their bytes; the tensors' data and offsets stay as they are."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors keeps the data 8-byte aligned
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + size :])
