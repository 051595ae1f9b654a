"""Wan2.1 / Wan2.2 text-to-video: the diffusion adapter (packed denoising loop, per-row SDE windows,
log-probs), for both layouts of `WanPipeline` checkpoints:

- one transformer (Wan2.1, Wan2.2 TI2V-5B, which also sets `expand_timesteps`: the timestep is given per
  latent token, [B, tokens], instead of per row);
- two experts (Wan2.2 T2V-A14B): `transformer` denoises while the timestep is at or above `boundary_ratio *
  num_train_timesteps`, `transformer_2` below it, each with its own guidance scale (`guidance_scale` above,
  `guidance_scale_2` below), as in `WanPipeline.__call__`, which guides neither expert when `guidance_scale`
  <= 1, whatever `guidance_scale_2` is.

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/wan/README.md`, "The adapter").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer, UMT5EncoderModel

from omnirl.config import Config
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import (
    LORA_FILE,
    DiffusersBase,
    guided_velocity,
    make_trainable,
    save_lora,
    trajectories,
)
from omnirl.models.flow_sde import WindowedSampler, phase, to_host
from omnirl.ranges import POSITIVE, at_least

# The LoRA file of the low-noise expert; `WanPipeline.load_lora_weights(dir, weight_name=...,
# load_into_transformer_2=True)` loads it (diffusers names both experts' LoRA keys "transformer.").
LORA_FILE_2 = "pytorch_lora_weights_transformer_2.safetensors"
EXPERTS = ("transformer", "transformer_2")
# Latent frames the transformer has rotary positions for: WanTransformer3DModel's rope_max_seq_len, 1024
# in every Wan2.1 / 2.2 checkpoint; a longer video has frames without positions.
ROPE_FRAMES = 1024
LORA_FILES = {"transformer": LORA_FILE, "transformer_2": LORA_FILE_2}


def experts_of(path: str) -> list[str]:
    """The experts of the WanPipeline checkpoint at `path`: ["transformer"] or ["transformer",
    "transformer_2"], as its model_index.json lists them, checked against its boundary_ratio."""
    index = cast(dict, WanPipeline.load_config(path))  # (typed as maybe a tuple)
    boundary_ratio = index.get("boundary_ratio")
    names = [n for n in EXPERTS if (index.get(n) or [None])[0] is not None]
    if (boundary_ratio is None) != (names == ["transformer"]):
        raise ConfigError(
            f"model.path {path!r}: boundary_ratio {boundary_ratio} with experts {names}; expected "
            "one transformer without a boundary or transformer + transformer_2 with one"
        )
    return names


class Experts(nn.Module):
    """The two experts as one module, its children named as the checkpoint's subfolders (`transformer`,
    `transformer_2`): `experts(name, **inputs)` runs expert `name`, `experts[name]` is it. FSDP2 shards
    only modules with a forward, and calling the root lets it gather its own parameters (each expert's
    embeddings and output layers) before the expert runs. Not an `nn.ModuleDict`: FSDP2 of torch 2.11
    refuses every ModuleDict, one with a forward too."""

    def __init__(self, experts: Mapping[str, nn.Module]):
        super().__init__()
        for name, expert in experts.items():
            self.add_module(name, expert)

    def __getitem__(self, name: str) -> nn.Module:
        expert = self._modules[name]
        assert expert is not None, name
        return expert

    def __len__(self) -> int:
        return len(self._modules)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def forward(self, name: str, **inputs):
        return self[name](**inputs)


@dataclass
class WanSettings:
    num_frames: int = 81
    """Frames per video; num_frames - 1 must divide by the VAE's temporal factor (4), as WanPipeline
    requires (it rounds other counts; here they are an error)."""
    fps: float = 16.0
    """Frame rate of the videos written as samples and handed to video rewards (Wan2.2 TI2V-5B: 24)."""
    flow_shift: float = 5.0
    """Shift of the flow-matching sigma schedule (Wan's `flow_shift`; 5.0 at 720p, 3.0 at 480p)."""
    guidance_scale_2: float | None = None
    """Guidance of the low-noise expert `transformer_2` (None: sampling.guidance_scale, as WanPipeline).
    Only for two-expert checkpoints. As in WanPipeline, sampling.guidance_scale 1 turns guidance off for
    both experts: this then has no effect."""
    max_sequence_length: int = 512
    """UMT5 prompt length (WanPipeline's default 512); the tokenizer's own limit lowers it."""
    decode_rows: int = 2
    """Videos the VAE decodes at once: bounds the decode's peak memory (it grows with frames x pixels)."""

    # Checked when the recipe loads (omnirl.config_checks). Every Wan VAE (2.1, 2.2) has the temporal
    # factor 4; the adapter checks num_frames against the checkpoint's own again.
    RANGES: ClassVar[dict] = {
        "num_frames": (
            (lambda v: 1 <= v <= 4 * (ROPE_FRAMES - 1) + 1 and (v - 1) % 4 == 0),
            f"an integer in [1, {4 * (ROPE_FRAMES - 1) + 1}] with num_frames - 1 divisible by 4 (the VAE's "
            f"temporal factor; at most {ROPE_FRAMES} latent frames, the transformer's rotary table)",
        ),
        "fps": POSITIVE,
        "flow_shift": POSITIVE,
        "guidance_scale_2": (
            (lambda v: v is None or (math.isfinite(v) and v >= 1)),
            "null (= sampling.guidance_scale) or a finite number >= 1 (1 = no guidance)",
        ),
        "max_sequence_length": at_least(1),
        "decode_rows": at_least(1),
    }


class WanAdapter(DiffusersBase):
    """The `DiffusionAdapter` for `WanPipeline` checkpoints (one transformer or two experts)."""

    kind = "diffusion"
    modalities = frozenset({"video"})
    pipeline_cls = WanPipeline
    # rollout.precision fp8 keeps these block layers in bf16: none. A Wan block modulates with a learned
    # table (scale_shift_table) and the time embedding made outside the blocks, not with a linear layer.
    fp8_keep_bf16 = ()
    Settings = WanSettings
    # sampling.height / width must be multiples of this (checked when the recipe loads): an 8x VAE times the
    # 2x2 patches; the rollout checks the checkpoint's own multiple (32 for TI2V-5B's 16x VAE).
    pixel_multiple = 16

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        self.settings: WanSettings = cfg.family
        index = cast(dict, WanPipeline.load_config(path))  # (typed as maybe a tuple)
        self.expand_timesteps = bool(index.get("expand_timesteps", False))
        self.boundary_ratio = index.get("boundary_ratio")
        names = experts_of(path)
        if self.boundary_ratio is None and self.settings.guidance_scale_2 is not None:
            raise ConfigError("family.guidance_scale_2 needs a two-expert checkpoint (transformer_2)")
        experts = {
            n: load_pretrained(WanTransformer3DModel, path, subfolder=n, torch_dtype=self.transformer_dtype)
            for n in names
        }
        self.vae = load_pretrained(AutoencoderKLWan, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(UMT5EncoderModel, path, subfolder="text_encoder", dtype=dtype)
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        self.max_sequence_length = min(self.settings.max_sequence_length, tokenizer.model_max_length)
        # The pipeline of the text encoder alone (diffusers types its modules as required; None is taken).
        none: dict[str, Any] = dict.fromkeys(["vae", "scheduler"])
        self.text_pipe = WanPipeline(**none, tokenizer=tokenizer, text_encoder=self.text_encoder)
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=self.settings.flow_shift)
        self.num_train_timesteps = self.scheduler.config["num_train_timesteps"]
        self.scale_temporal: int = self.vae.config["scale_factor_temporal"]
        self.vae_scale_factor: int = self.vae.config["scale_factor_spatial"]
        if (self.settings.num_frames - 1) % self.scale_temporal:
            raise ConfigError(
                f"family.num_frames - 1 must divide by {self.scale_temporal}, got {self.settings.num_frames}"
            )
        for expert in experts.values():
            make_trainable(expert, cfg, device)
        self.experts: dict[str, Any] = experts  # name -> its WanTransformer3DModel
        self._policy: nn.Module = experts["transformer"] if len(experts) == 1 else Experts(experts)
        self.config: Any = experts["transformer"].config  # diffusers' FrozenDict, read by field name

    @property
    def policy(self) -> nn.Module:
        """The trained module: the one transformer, or the two experts (`Experts`)."""
        return self._policy

    @property
    def memory_probe_rows(self) -> int:
        """The decode's chunk: a rollout's peak grows linearly from `decode_rows` rows on."""
        return self.settings.decode_rows

    def trained_modules(self) -> dict[str, nn.Module]:
        return dict(self.experts)

    def fsdp_units(self) -> list[nn.Module]:
        return [b for e in self.experts.values() for b in e.blocks]

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The flow-matching schedule (shifted by family.flow_shift): [num_steps + 1] float32, last 0."""
        self.scheduler.set_timesteps(num_steps)
        sigmas = self.scheduler.sigmas
        assert isinstance(sigmas, torch.Tensor)  # set_timesteps made them
        return sigmas.float().cpu()

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        frames = (self.settings.num_frames - 1) // self.scale_temporal + 1
        return (
            self.config.in_channels,
            frames,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
        )

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None) -> dict[str, torch.Tensor]:
        """UMT5 embeddings [B, max_sequence_length, D], zero-padded past each prompt (diffusers' own)."""
        guided = negative_prompts is not None
        embeds, negative = self.text_pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=negative_prompts,
            do_classifier_free_guidance=guided,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        out = {"prompt_embeds": embeds}
        if guided:
            assert negative is not None  # encoded with classifier-free guidance
            out["negative_prompt_embeds"] = negative
        return out

    def guidance_2(self, guidance_scale: float) -> float:
        """The low-noise expert's scale: WanPipeline guides only when guidance_scale > 1, both experts."""
        g = self.settings.guidance_scale_2
        return guidance_scale if g is None or guidance_scale <= 1 else g

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
        fused_cfg: bool = True,
        policy: nn.Module | None = None,
    ) -> torch.Tensor:
        """The guided velocity [B, C, f, h, w] float32 at per-row sigmas [B], each row on its expert."""
        return self._velocity(latents, sigmas, embeds, guidance_scale, fused_cfg, policy, balance=True)

    def _velocity(self, latents, sigmas, embeds, guidance_scale, fused_cfg, policy, balance):
        root = policy if policy is not None else self._policy
        dtype = compute_dtype(root, self.transformer_dtype)
        timestep = sigmas.float() * self.num_train_timesteps  # [B], the pipeline's scheduler timesteps
        if self.boundary_ratio is None:
            return self._guided(root, latents, timestep, embeds, guidance_scale, fused_cfg, dtype)
        # The pipeline's rule: the high-noise expert at t >= boundary, compared in float32 as it does.
        high = timestep >= self.boundary_ratio * self.num_train_timesteps  # [B]
        out = torch.zeros(latents.shape, dtype=torch.float32, device=latents.device)
        sharded = isinstance(root, FSDPModule)
        for name, rows, scale in (
            ("transformer", high, guidance_scale),
            ("transformer_2", ~high, self.guidance_2(guidance_scale)),
        ):
            idx = rows.nonzero().squeeze(1)  # one host sync per forward: small next to a transformer
            expert = functools.partial(root, name)
            if len(idx):
                sub = {k: e[idx] for k, e in embeds.items()}
                out = out.index_put((idx,), self._guided(expert, latents[idx], timestep[idx], sub, scale,
                                                         fused_cfg, dtype))  # fmt: skip
            elif balance and sharded:
                # Every rank must run every sharded expert forward and backward the same number of times
                # (FSDP's collectives), whatever its rows' sigmas: a one-row pass contributing zero.
                sub = {k: e[:1] for k, e in embeds.items()}
                v = self._guided(expert, latents[:1], timestep[:1], sub, scale, fused_cfg, dtype)
                out = out + 0.0 * v.sum()
        return out

    def _guided(self, model, latents, timestep, embeds, guidance_scale, fused_cfg, dtype):
        x = latents.to(dtype)
        if self.expand_timesteps:  # TI2V: one timestep per latent token, [B, f * h/2 * w/2]
            p_t, p_h, p_w = self.config.patch_size
            _, _, f, h, w = latents.shape
            timestep = timestep[:, None].expand(-1, (f // p_t) * (h // p_h) * (w // p_w))

        def forward(x, t, text):
            out = model(hidden_states=x, timestep=t, encoder_hidden_states=text.to(dtype), return_dict=False)
            return out[0].float()

        return guided_velocity(forward, x, timestep, embeds, ("prompt_embeds",), guidance_scale, fused_cfg)

    def guided(self, guidance_scale: float) -> bool:
        """Whether the experts guide (the negative prompts are encoded then): WanPipeline's rule, whatever
        guidance_scale_2 is."""
        return guidance_scale > 1

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one forward per denoising step (of the expert owning that step)."""
        p = requests[0].params
        # The checkpoint's own multiple: its VAE's factor (8, or 16 for the TI2V-5B VAE) x the 2x2 patches.
        self.check_batch(requests, self.vae_scale_factor * self.config.patch_size[1])
        sigmas = self.sigmas(p.num_steps)
        shape = self.latent_shape(p.height, p.width)
        sampler = WindowedSampler(
            requests, shape, sigmas, self.device, self.settings.flow_shift, on_step=on_step
        )
        latents = sampler.initial_latents  # [B, C, f, h, w]
        with phase("encode"):
            negatives = [r.negative_prompt for r in requests] if self.guided(p.guidance_scale) else None
            embeds = self.encode([r.prompt for r in requests], negatives)
        for i in sampler.steps():  # num_steps but a compressed schedule's
            with phase("transformer"):
                v = self._velocity(
                    latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg, None, balance=False
                )
            latents = sampler.step(i, v, latents)

        with phase("vae_decode"):
            videos = torch.cat([self.decode(c) for c in latents.split(self.settings.decode_rows)])
        keys = list(embeds)
        videos, latents, *values = to_host([videos, latents, *embeds.values()])
        rows = [{k: e[b] for k, e in zip(keys, values)} for b in range(len(requests))]
        outputs = [Output(video=v, fps=self.settings.fps) for v in videos]
        return trajectories(requests, sampler, sampler.host_sigmas, rows, outputs, latents)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, f, h, w] -> videos [B, F, 3, H, W] in [0, 1], as WanPipeline decodes them."""
        c: Any = self.vae.config  # diffusers' FrozenDict, read by field name
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latents.device, self.vae.dtype)
        std = torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latents.device, self.vae.dtype)
        video = self.vae.decode(latents.to(self.vae.dtype) * std + mean, return_dict=False)[
            0
        ]  # [B, 3, F, H, W]
        return (video.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # as postprocess_video

    def compat_key(self, request: Request) -> tuple:
        # The frame count and resolution shape the latents; guidance_scale_2 the low-noise forwards.
        return request.params.key + (self.settings.num_frames, self.settings.guidance_scale_2)

    def num_tokens(self, request: Request) -> int:
        """Latent tokens after patching (frames x height x width): the self-attention's sequence. The text
        enters by cross-attention only, whose cost grows with the same count."""
        _, f, h, w = self.latent_shape(request.params.height, request.params.width)
        p_t, p_h, p_w = self.config.patch_size
        return (f // p_t) * (h // p_h) * (w // p_w)

    def export_lora(self, out_dir: str | Path, state_dict: dict | None = None) -> None:
        """Write each expert's LoRA in diffusers' Wan format: `pytorch_lora_weights.safetensors` (the one
        transformer, or the high-noise expert) and, for two experts, `pytorch_lora_weights_transformer_2
        .safetensors`, loaded by `WanPipeline.load_lora_weights(out_dir, weight_name=LORA_FILE_2,
        load_into_transformer_2=True)`. An FSDP run passes the gathered full state dict of `policy`."""
        if not self.lora:
            raise ValueError("export_lora needs model.finetune 'lora'")
        two = len(self.experts) > 1
        for name, expert in self.experts.items():
            sub = state_dict
            if state_dict is not None and two:
                sub = {k[len(name) + 1 :]: v for k, v in state_dict.items() if k.startswith(name + ".")}
            save_lora(WanPipeline, expert, out_dir, sub, LORA_FILES[name])

    @classmethod
    def lora_files(cls, model_path: str) -> dict[str, str]:
        return {name: LORA_FILES[name] for name in experts_of(model_path)}

    @classmethod
    def load_lora(cls, pipe, lora_dir: Path, component: str, weight_name: str) -> None:
        # diffusers names both experts' LoRA keys "transformer."; the flag picks the expert.
        load_2 = component == "transformer_2"
        pipe.load_lora_weights(lora_dir, weight_name=weight_name, load_into_transformer_2=load_2)
