"""FLUX.1 (dev): the diffusion adapter (packed denoising loop, per-row SDE windows, log-probs).

`FluxAdapter` (with its `FluxSettings`, `family.*`) takes the components, the prompt encoding, the 2x2
latent packing, the position ids and the shifted sigma schedule from diffusers; the embedded guidance is
`family.guidance_scale`, true CFG `sampling.guidance_scale` > 1. The denoising loop is written out, as in
every family, for one generator per request, a per-row SDE window and the log-prob of every trained
step; with noise level 0 it is the pipeline's sampler.

How it works: omnirl/models/flux/README.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from torch import nn
from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

from omnirl.config import Config
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, guided_velocity, make_trainable, trajectories
from omnirl.models.flow_sde import WindowedSampler, phase, to_host
from omnirl.ranges import POSITIVE, at_least


@dataclass
class FluxSettings:
    guidance_scale: float = 3.5
    """The distilled guidance FLUX.1-dev takes as an input of its transformer (FluxPipeline's
    `guidance_scale`; one forward). Ignored by a checkpoint without guidance embeddings (FLUX.1-schnell)."""
    shift: float | None = None
    """None: the pipeline's resolution-dependent shift of the sigma schedule (`calculate_shift` of the
    image token count, with the scheduler's base / max shift). A number: that fixed time shift instead,
    shift * t / (1 + (shift - 1) * t), as DanceGRPO and MixGRPO sample FLUX (shift 3)."""
    max_sequence_length: int = 512
    """T5 prompt length (FluxPipeline's default 512; prompts are padded to it); the tokenizer's own limit
    lowers it."""

    RANGES: ClassVar[dict] = {
        "guidance_scale": POSITIVE,
        "shift": ((lambda v: v is None or (math.isfinite(v) and v > 0)), "null or a finite number > 0"),
        "max_sequence_length": at_least(1),
    }  # checked when the recipe loads


class FluxAdapter(DiffusersBase):
    """The `DiffusionAdapter` for `FluxPipeline` checkpoints (black-forest-labs/FLUX.1-dev)."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image"})
    pipeline_cls = FluxPipeline
    # rollout.precision fp8 keeps these block layers in bf16: the AdaLN modulation of the double blocks'
    # image and text streams (AdaLayerNormZero) and of the single blocks (AdaLayerNormZeroSingle).
    fp8_keep_bf16 = ("norm1.linear", "norm1_context.linear", "norm.linear")
    # cuDNN's attention backward failed on an H100 at the DanceGRPO recipe's shapes (torch 2.11: an illegal
    # memory access, or silently non-finite gradients); with it off the step trains (README.md).
    cudnn_attention = False
    memory_probe_rows = 1  # nothing runs in chunks: the whole batch decodes at once
    Settings = FluxSettings
    # sampling.height / width must be multiples of this (checked when the recipe loads): the VAE's 8x
    # downsampling times the 2x2 latent patches the transformer packs. The tiny test model's VAE: 2x.
    pixel_multiple = 16

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        settings = cfg.family
        self.guidance = float(settings.guidance_scale)
        self.shift = settings.shift
        self.transformer = load_pretrained(
            FluxTransformer2DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKL, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(CLIPTextModel, path, subfolder="text_encoder", dtype=dtype)
        self.text_encoder_2 = load_pretrained(T5EncoderModel, path, subfolder="text_encoder_2", dtype=dtype)
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        tokenizer_2 = AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2")
        self.max_sequence_length = min(settings.max_sequence_length, tokenizer_2.model_max_length)
        # (from_pretrained is typed as maybe a tuple: with return_unused_kwargs)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.scheduler = cast(FlowMatchEulerDiscreteScheduler, scheduler)
        # Computed as the pipeline does (8 for FLUX); the transformer then packs 2x2 latent patches.
        self.vae_scale_factor = 2 ** (len(self.vae.config["block_out_channels"]) - 1)
        # A pipeline around the text encoders only, so that prompts are encoded by diffusers' own code
        # (diffusers types its modules as required; None is taken).
        none: dict[str, Any] = dict.fromkeys(["transformer", "scheduler", "vae"])
        self.text_pipe = FluxPipeline(
            **none,
            text_encoder=self.text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=tokenizer_2,
        )

        make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder, self.text_encoder_2]

    def fsdp_units(self) -> list[nn.Module]:
        """Both block kinds: the double-stream blocks, then the single-stream ones."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    def sigmas(self, num_steps: int, image_seq_len: int) -> torch.Tensor:
        """The pipeline's sigma schedule: [num_steps + 1] float32 on the host, the last one 0. Its shift
        `mu` grows with the image's token count, unless `family.shift` fixes it (mu = log(shift): the
        scheduler's exponential time shift is then the fixed shift)."""
        config = self.scheduler.config
        if self.shift is None:
            mu = calculate_shift(
                image_seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.15),
            )
        else:
            mu = math.log(self.shift)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        retrieve_timesteps(self.scheduler, num_steps, sigmas=sigmas.tolist(), mu=mu)
        out = self.scheduler.sigmas
        assert isinstance(out, torch.Tensor)  # set_timesteps made them
        return out.float().cpu()

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None) -> dict[str, torch.Tensor]:
        """Prompt embeddings on the device; pass `negative_prompts` (one per prompt) only for true CFG.

        Every row has the same length (T5 padded to max_sequence_length), so per-sample embeddings stored
        in trajectories can be stacked again by the trainer. Each distinct text is encoded once.
        """
        texts = prompts + (negative_prompts or [])
        unique = list(dict.fromkeys(texts))
        embeds, pooled, _ = self.text_pipe.encode_prompt(
            prompt=unique,
            prompt_2=None,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )  # [U, L, D] T5, [U, P] CLIP pooled
        assert embeds is not None and pooled is not None  # encoded here, not passed in
        row = {t: i for i, t in enumerate(unique)}
        index = torch.tensor([row[t] for t in texts], device=embeds.device)
        embeds, pooled = embeds[index], pooled[index]
        n = len(prompts)
        out = {"prompt_embeds": embeds[:n], "pooled_prompt_embeds": pooled[:n]}  # [B, L, D], [B, P]
        if negative_prompts is not None:
            out["negative_prompt_embeds"] = embeds[n:]
            out["negative_pooled_prompt_embeds"] = pooled[n:]
        return out

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
        fused_cfg: bool = True,
        policy: nn.Module | None = None,
    ) -> torch.Tensor:
        """The velocity [B, C, h, w] float32 for latents [B, C, h, w] at per-row sigmas [B].

        The rollout and the trainer's log-prob recomputation both call this, so they run the same math.
        The inputs are packed as the pipeline packs them (2x2 latent patches, image and text position ids,
        the scheduler's timestep / 1000, the distilled guidance). `guidance_scale` > 1 is true CFG with
        the negative prompts, their rows in the same forward by default (`fused_cfg`). `policy` runs
        another module of the same architecture instead (the trainer's frozen reference copy).
        """
        model = policy if policy is not None else self.transformer
        dtype = compute_dtype(model, self.transformer_dtype)  # the model's inputs: FSDP's root does not cast
        batch, channels, h, w = latents.shape
        x = FluxPipeline._pack_latents(latents, batch, channels, h, w).to(dtype)  # [B, S, 4C]
        ids = FluxPipeline._prepare_latent_image_ids
        img_ids = ids(batch, h // 2, w // 2, latents.device, dtype)  # [S, 3]
        # The pipeline feeds the scheduler's timestep (sigma * 1000, float32) cast to its dtype, / 1000.
        timestep = (sigmas.float() * self.scheduler.config["num_train_timesteps"]).to(dtype) / 1000  # [B]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([1], self.guidance, device=latents.device, dtype=torch.float32)

        def forward(x, t, text, pooled):
            txt_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=dtype)  # [L, 3]
            out = model(
                hidden_states=x,
                timestep=t,
                guidance=None if guidance is None else guidance.expand(len(x)),
                pooled_projections=pooled.to(dtype),
                encoder_hidden_states=text.to(dtype),
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
            return out.float()  # [B', S, 4C]

        keys = ("prompt_embeds", "pooled_prompt_embeds")
        v = guided_velocity(forward, x, timestep, embeds, keys, guidance_scale, fused_cfg)
        pixels = self.vae_scale_factor
        return FluxPipeline._unpack_latents(v, h * pixels, w * pixels, pixels)  # [B, C, h, w]

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward (true-CFG rows included) per denoising step.

        Each request's own generator draws, in order: its initial latents, its SDE window start, and the
        noise of each step inside its window; so a request's sample does not depend on its batch.
        """
        p = requests[0].params
        self.check_batch(requests, self.vae_scale_factor * 2)
        channels = self.transformer.config.in_channels // 4
        h, w = p.height // self.vae_scale_factor, p.width // self.vae_scale_factor
        sigmas = self.sigmas(p.num_steps, (h // 2) * (w // 2))  # [T + 1] host
        sampler = WindowedSampler(
            requests, (channels, h, w), sigmas, self.device, self.shift, on_step=on_step
        )
        latents = sampler.initial_latents  # [B, C, h, w]
        guided = p.guidance_scale > 1
        with phase("encode"):
            negatives = [r.negative_prompt for r in requests] if guided else None
            embeds = self.encode([r.prompt for r in requests], negatives)

        for i in sampler.steps():
            with phase("transformer"):  # [B, C, h, w]
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)

        images = self.decode(latents) if p.decode else [None] * len(requests)
        keys = list(embeds)  # one copy per tensor, not per sample
        latents, *values = to_host([latents, *embeds.values()])
        rows = [{k: e[b] for k, e in zip(keys, values)} for b in range(len(requests))]
        outputs = [Output(image=im) for im in images]
        return trajectories(requests, sampler, sampler.host_sigmas, rows, outputs, latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Images [3, H, W] in [0, 1] on the host of final latents [B, C, h, w] (the VAE's decode, as the
        pipeline's)."""
        with phase("vae_decode"):
            config = self.vae.config
            vae_in = latents.to(self.device) / config["scaling_factor"] + config["shift_factor"]
            images = self.vae.decode(vae_in.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W], [-1, 1]
            images = (images.float() * 0.5 + 0.5).clamp(0, 1)  # as VaeImageProcessor.postprocess
        return list(to_host([images])[0])

    def compat_key(self, request: Request) -> tuple:
        return request.params.key  # prompts are padded to one length: nothing to add

    def num_tokens(self, request: Request) -> int:
        p = request.params
        image = (p.height // self.vae_scale_factor // 2) * (p.width // self.vae_scale_factor // 2)
        return image + self.max_sequence_length  # T5 tokens; CLIP enters pooled
