"""Stable Diffusion 3 / 3.5: the diffusion adapter (packed denoising loop, per-row SDE windows, log-probs).

The components, the prompt encoding (`StableDiffusion3Pipeline.encode_prompt`) and the sigma schedule
(`FlowMatchEulerDiscreteScheduler`) are diffusers' own. The denoising loop is written out here, like the
pipeline's, because RL needs what the pipeline does not do: one generator per request (so a packed batch
draws the same noise as a serial run), a per-row SDE window, and the log-prob of every trained step
(`flow_sde.flow_step`). With noise level 0 it is the pipeline's sampler: same initial latents, same image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from torch import nn
from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

from omnirl.config import Config
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Latent, Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, guided_velocity, make_trainable, trajectories
from omnirl.models.flow_sde import WindowedSampler, phase, to_host

# The pipeline's default T5 length; a tokenizer with a smaller limit (the tiny model's) lowers it.
T5_MAX_SEQUENCE_LENGTH = 256


@dataclass
class SD3Settings:
    """SD3's prompts are padded to fixed lengths (CLIP 77 + T5 `max_sequence_length`); its sizes are
    sampling.*."""

    max_sequence_length: int = T5_MAX_SEQUENCE_LENGTH
    """T5 tokens of a prompt (the pipeline's default 256; flow_grpo's SD3 training encodes 128). A
    tokenizer with a smaller limit (the tiny model's) lowers it."""

    RANGES: ClassVar[dict] = {
        "max_sequence_length": ((lambda v: 1 <= v <= 512), "an integer in [1, 512] (T5's trained length)"),
    }


class SD3Adapter(DiffusersBase):
    """The `DiffusionAdapter` for `StableDiffusion3Pipeline` checkpoints (SD3 medium, SD3.5 medium/large)."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image", "latent"})
    pipeline_cls = StableDiffusion3Pipeline
    # rollout.precision fp8 keeps these block layers in bf16: the AdaLN modulation of the image and text
    # streams (AdaLayerNormZero; the last block's text stream: AdaLayerNormContinuous).
    fp8_keep_bf16 = ("norm1.linear", "norm1_context.linear")
    memory_probe_rows = 1  # nothing runs in chunks: the whole batch decodes at once
    Settings = SD3Settings
    # sampling.height / width must be multiples of this (checked when the recipe loads): the VAE's 8x
    # downsampling times the transformer's 2x2 patches. The tiny test model's VAE downsamples 2x.
    pixel_multiple = 16
    # What the latent rewards read besides the Protocol's members (omnirl.rewards.dina_lrm).
    scheduler: FlowMatchEulerDiscreteScheduler
    vae_scale_factor: int  # image pixels per latent pixel, per side
    max_sequence_length: int  # T5 tokens of a prompt (family.max_sequence_length, capped by the tokenizer)

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        self.transformer = load_pretrained(
            SD3Transformer2DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKL, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(
            CLIPTextModelWithProjection, path, subfolder="text_encoder", dtype=dtype
        )
        self.text_encoder_2 = load_pretrained(
            CLIPTextModelWithProjection, path, subfolder="text_encoder_2", dtype=dtype
        )
        self.text_encoder_3 = load_pretrained(T5EncoderModel, path, subfolder="text_encoder_3", dtype=dtype)
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        tokenizers = [
            AutoTokenizer.from_pretrained(path, subfolder=f"tokenizer{s}") for s in ("", "_2", "_3")
        ]
        settings = cast(SD3Settings, cfg.family)
        self.max_sequence_length = min(settings.max_sequence_length, tokenizers[2].model_max_length)

        # (from_pretrained is typed as maybe a tuple: with return_unused_kwargs)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.scheduler = cast(FlowMatchEulerDiscreteScheduler, scheduler)
        if self.scheduler.config["use_dynamic_shifting"]:
            # The SD3 pipeline then shifts sigmas by image size; SD3 / 3.5 checkpoints use a fixed shift.
            raise ConfigError(f"model.path {path!r}: a scheduler with use_dynamic_shifting is not supported")
        # Computed as the pipeline does (8 for SD3: a latent pixel is 8x8 image pixels).
        self.vae_scale_factor = 2 ** (len(self.vae.config["block_out_channels"]) - 1)

        # A pipeline around the text encoders only, so that prompts are encoded by diffusers' own code
        # (diffusers types its modules as required; None is taken).
        none: dict[str, Any] = dict.fromkeys(["transformer", "scheduler", "vae"])
        self.text_pipe = StableDiffusion3Pipeline(
            **none,
            text_encoder=self.text_encoder,
            tokenizer=tokenizers[0],
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=tokenizers[1],
            text_encoder_3=self.text_encoder_3,
            tokenizer_3=tokenizers[2],
        )

        make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder, self.text_encoder_2, self.text_encoder_3]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's sigma schedule: [num_steps + 1] float32 on the host, the last one 0."""
        self.scheduler.set_timesteps(num_steps)
        sigmas = self.scheduler.sigmas
        assert isinstance(sigmas, torch.Tensor)  # set_timesteps made them
        return sigmas.float().cpu()

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None) -> dict[str, torch.Tensor]:
        """Prompt embeddings on the device; pass `negative_prompts` (one per prompt) only when guiding.

        Every row has the same length (CLIP 77 + T5 max_sequence_length, both padded to their maximum),
        so per-sample embeddings stored in trajectories can be stacked again by the trainer.
        """
        guided = negative_prompts is not None
        prompt_embeds, negative_embeds, pooled, negative_pooled = self.text_pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,  # pyright: ignore[reportArgumentType] (None: `prompt`, as diffusers does)
            prompt_3=None,  # pyright: ignore[reportArgumentType]
            device=self.device,
            do_classifier_free_guidance=guided,
            negative_prompt=negative_prompts,
            max_sequence_length=self.max_sequence_length,
        )
        # [B, 77 + L, D], [B, P]
        embeds: dict[str, Any] = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        if guided:
            embeds["negative_prompt_embeds"] = negative_embeds  # [B, 77 + L, D]
            embeds["negative_pooled_prompt_embeds"] = negative_pooled  # [B, P]
        return embeds

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
        fused_cfg: bool = True,
        policy: nn.Module | None = None,
    ) -> torch.Tensor:
        """The guided velocity [B, C, h, w] float32 for latents [B, C, h, w] at per-row sigmas [B].

        The rollout and the trainer's log-prob recomputation both call this, so they run the same math.
        With guidance the unconditional and conditional rows go through one forward by default
        (`fused_cfg`), stacked [uncond; cond] as the pipeline does. `policy` runs another module of the
        same architecture instead (the trainer's frozen reference copy for the KL term).
        """
        model = policy if policy is not None else self.transformer
        dtype = compute_dtype(model, self.transformer_dtype)  # the model's inputs: FSDP's root does not cast
        x = latents.to(dtype)
        # The pipeline feeds the scheduler's timesteps, which are sigma * num_train_timesteps in float32.
        timestep = sigmas.float() * self.scheduler.config["num_train_timesteps"]  # [B]

        def forward(x, t, text, pooled):
            out = model(
                hidden_states=x,
                timestep=t,
                encoder_hidden_states=text.to(dtype),
                pooled_projections=pooled.to(dtype),
                return_dict=False,
            )[0]
            return out.float()

        keys = ("prompt_embeds", "pooled_prompt_embeds")
        return guided_velocity(forward, x, timestep, embeds, keys, guidance_scale, fused_cfg)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward (CFG rows included) per denoising step.

        Each request's own generator draws, in order: its initial latents, its SDE window start, and the
        noise of each step inside its window; so a request's sample does not depend on its batch.
        """
        p = requests[0].params
        self.check_batch(requests, self.vae_scale_factor * self.transformer.config.patch_size)
        num_steps = p.num_steps
        channels = self.transformer.config.in_channels
        h, w = p.height // self.vae_scale_factor, p.width // self.vae_scale_factor
        sigmas = self.sigmas(num_steps)  # [T + 1] host
        shift = self.scheduler.config["shift"]
        sampler = WindowedSampler(requests, (channels, h, w), sigmas, self.device, shift, on_step=on_step)
        latents = sampler.initial_latents  # [B, C, h, w]
        guided = p.guidance_scale > 1
        with phase("encode"):
            negatives = [r.negative_prompt for r in requests] if guided else None
            embeds = self.encode([r.prompt for r in requests], negatives)

        for i in sampler.steps():  # num_steps but a compressed schedule's
            with phase("transformer"):  # [B, C, h, w]
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)

        # The decode runs only when a reward or a viewer reads pixels; every output holds its latents with
        # their conditioning (references, no copy) for latent rewards.
        images = self.decode(latents) if p.decode else [None] * len(requests)
        keys = list(embeds)  # one copy per tensor, not per sample
        latents, *values = to_host([latents, *embeds.values()])
        rows = [{k: e[b] for k, e in zip(keys, values)} for b in range(len(requests))]
        outputs = [
            Output(image=im, latent=Latent(latents[b], rows[b], r.seed))
            for b, (im, r) in enumerate(zip(images, requests))
        ]
        return trajectories(requests, sampler, sampler.host_sigmas, rows, outputs, latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Images [3, H, W] in [0, 1] on the host of final latents [B, C, h, w] (the VAE's decode, as the
        pipeline's; the latents may be on the host)."""
        with phase("vae_decode"):
            config = self.vae.config
            vae_in = latents.to(self.device) / config["scaling_factor"] + config["shift_factor"]
            images = self.vae.decode(vae_in.to(self.vae.dtype), return_dict=False)[0]  # [B, 3, H, W], [-1, 1]
            images = (images.float() * 0.5 + 0.5).clamp(0, 1)  # as VaeImageProcessor.postprocess
        return list(to_host([images])[0])

    def compat_key(self, request: Request) -> tuple:
        return request.params.key  # prompts are padded to fixed lengths: nothing to add

    def num_tokens(self, request: Request) -> int:
        p, patch = request.params, self.transformer.config.patch_size
        image = (p.height // self.vae_scale_factor // patch) * (p.width // self.vae_scale_factor // patch)
        return image + 77 + self.max_sequence_length  # CLIP tokens + T5 tokens
