"""FLUX.2-klein: the diffusion adapter for `Flux2KleinPipeline` checkpoints (packed denoising loop, per-row
SDE windows, log-probs).

`Flux2KleinAdapter` (with its `Flux2KleinSettings`, `family.*`) takes the components and every input the
transformer sees from diffusers (the Qwen3 prompt encoding, the position ids, the shifted sigma schedule,
the VAE's batch-norm statistics and patches) and writes out the loop for what the pipeline does not do:
one generator per request, a per-row SDE window and the log-prob of every trained step. A step-distilled
checkpoint takes no CFG.

How it works: omnirl/models/flux2_klein/README.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import numpy as np
import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps
from torch import nn
from transformers import AutoTokenizer, Qwen3ForCausalLM

from omnirl.config import Config
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, guided_velocity, make_trainable, trajectories
from omnirl.models.flow_sde import WindowedSampler, phase, to_host
from omnirl.ranges import at_least

PIPE = Flux2KleinPipeline


@dataclass
class Flux2KleinSettings:
    max_sequence_length: int = 512
    """Prompt length in tokens, chat template included (Flux2KleinPipeline's default 512; prompts are
    padded to it); the tokenizer's own limit lowers it."""

    RANGES: ClassVar[dict] = {"max_sequence_length": at_least(1)}  # checked when the recipe loads


class Flux2KleinAdapter(DiffusersBase):
    """The `DiffusionAdapter` for `Flux2KleinPipeline` checkpoints (black-forest-labs/FLUX.2-klein-*)."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image"})
    pipeline_cls = Flux2KleinPipeline
    # rollout.precision fp8 keeps these block layers in bf16: none. FLUX.2's modulation is computed once,
    # outside the blocks (double_stream_modulation_*, single_stream_modulation), so it stays bf16 anyway.
    fp8_keep_bf16 = ()
    memory_probe_rows = 1  # nothing runs in chunks: the whole batch decodes at once
    Settings = Flux2KleinSettings
    # sampling.height / width must be multiples of this (checked when the recipe loads): the VAE's 8x
    # downsampling times its 2x2 patches. The tiny test model's VAE: 2x.
    pixel_multiple = 16

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        index = cast(dict, Flux2KleinPipeline.load_config(path))
        self.distilled = bool(index.get("is_distilled", False))
        if self.distilled and cfg.sampling.guidance_scale > 1:
            raise ConfigError(
                f"sampling.guidance_scale {cfg.sampling.guidance_scale}: the checkpoint at {path!r} is "
                "step-distilled (is_distilled) and takes no classifier-free guidance; set it to 1"
            )
        self.transformer = load_pretrained(
            Flux2Transformer2DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKLFlux2, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(Qwen3ForCausalLM, path, subfolder="text_encoder", dtype=dtype)
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        self.max_sequence_length = min(cfg.family.max_sequence_length, self.tokenizer.model_max_length)
        # (from_pretrained is typed as maybe a tuple: with return_unused_kwargs)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.scheduler = cast(FlowMatchEulerDiscreteScheduler, scheduler)
        # Computed as the pipeline does (8 for FLUX.2); the VAE's 2x2 patches come on top.
        self.vae_scale_factor = 2 ** (len(self.vae.config["block_out_channels"]) - 1)
        make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder]

    def fsdp_units(self) -> list[nn.Module]:
        """Both block kinds: the double-stream blocks, then the single-stream ones."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    def sigmas(self, num_steps: int, image_seq_len: int) -> torch.Tensor:
        """The pipeline's sigma schedule: [num_steps + 1] float32 on the host, the last one 0, shifted by
        `compute_empirical_mu` of the image token count and the step count."""
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)
        retrieve_timesteps(self.scheduler, num_steps, sigmas=sigmas.tolist(), mu=mu)
        out = self.scheduler.sigmas
        assert isinstance(out, torch.Tensor)  # set_timesteps made them
        return out.float().cpu()

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None) -> dict[str, torch.Tensor]:
        """Prompt embeddings [B, L, 3D] on the device, padded to max_sequence_length; pass
        `negative_prompts` (one per prompt) only for CFG. Each distinct text is encoded once."""
        texts = prompts + (negative_prompts or [])
        unique = list(dict.fromkeys(texts))
        embeds = PIPE._get_qwen3_prompt_embeds(
            self.text_encoder,
            self.tokenizer,
            unique,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )  # [U, L, 3D]
        row = {t: i for i, t in enumerate(unique)}
        embeds = embeds[torch.tensor([row[t] for t in texts], device=embeds.device)]
        n = len(prompts)
        out = {"prompt_embeds": embeds[:n]}
        if negative_prompts is not None:
            out["negative_prompt_embeds"] = embeds[n:]
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
        """The velocity [B, C, h, w] float32 for latents [B, C, h, w] (patchified) at per-row sigmas [B].

        The rollout and the trainer's recomputation both call this. The inputs are the pipeline's: the
        latents flattened to tokens, the four-axis position ids, the scheduler's timestep / 1000.
        `guidance_scale` > 1 is CFG with the negative prompts, fused into one forward by default.
        `policy` runs another module of the same architecture instead (the trainer's frozen reference).
        """
        model = policy if policy is not None else self.transformer
        dtype = compute_dtype(model, self.transformer_dtype)  # the model's inputs: FSDP's root does not cast
        batch, channels, h, w = latents.shape
        x = PIPE._pack_latents(latents).to(dtype)  # [B, h w, C]
        img_ids = PIPE._prepare_latent_ids(latents).to(latents.device)  # [B, h w, 4]
        # The pipeline feeds the scheduler's timestep (sigma * 1000, float32) cast to its dtype, / 1000.
        timestep = (sigmas.float() * self.scheduler.config["num_train_timesteps"]).to(dtype) / 1000  # [B]

        def forward(x, t, text):
            out = model(
                hidden_states=x,
                timestep=t,
                guidance=None,
                encoder_hidden_states=text.to(dtype),
                txt_ids=PIPE._prepare_text_ids(text).to(text.device),  # [B', L, 4]
                img_ids=img_ids[:1].expand(len(x), -1, -1),
                return_dict=False,
            )[0]
            return out.float()  # [B', h w, C]

        v = guided_velocity(forward, x, timestep, embeds, ("prompt_embeds",), guidance_scale, fused_cfg)
        return v.permute(0, 2, 1).reshape(batch, channels, h, w)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward (CFG rows included) per denoising step.

        Each request's own generator draws, in order: its initial latents, its SDE window start, and the
        noise of each step inside its window; so a request's sample does not depend on its batch.
        """
        p = requests[0].params
        self.check_batch(requests, self.vae_scale_factor * 2)
        channels = self.transformer.config.in_channels
        h, w = p.height // self.vae_scale_factor // 2, p.width // self.vae_scale_factor // 2
        sigmas = self.sigmas(p.num_steps, h * w)  # [T + 1] host
        sampler = WindowedSampler(requests, (channels, h, w), sigmas, self.device, on_step=on_step)
        latents = sampler.initial_latents  # [B, 4C, h/2, w/2]
        guided = p.guidance_scale > 1
        with phase("encode"):
            negatives = [r.negative_prompt for r in requests] if guided else None
            embeds = self.encode([r.prompt for r in requests], negatives)

        for i in sampler.steps():
            with phase("transformer"):
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)

        images = self.decode(latents) if p.decode else [None] * len(requests)
        keys = list(embeds)  # one copy per tensor, not per sample
        latents, *values = to_host([latents, *embeds.values()])
        rows = [{k: e[b] for k, e in zip(keys, values)} for b in range(len(requests))]
        outputs = [Output(image=im) for im in images]
        return trajectories(requests, sampler, sampler.host_sigmas, rows, outputs, latents)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents [B, C, 2h, 2w] of sampler latents [B, 4C, h, w]: the batch norm's statistics
        undone, the 2x2 patches unfolded (the pipeline's `output_type="latent"`)."""
        bn, eps = self.vae.bn, self.vae.config["batch_norm_eps"]
        assert bn.running_mean is not None and bn.running_var is not None  # track_running_stats
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
        return PIPE._unpatchify_latents(latents * std + mean)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Images [3, H, W] in [0, 1] on the host of final latents [B, 4C, h, w] (as the pipeline's)."""
        with phase("vae_decode"):
            vae_in = cast(torch.FloatTensor, self.vae_latents(latents.to(self.device).to(self.vae.dtype)))
            images = self.vae.decode(vae_in, return_dict=False)[0]  # [B, 3, H, W], [-1, 1]
            images = (images.float() * 0.5 + 0.5).clamp(0, 1)  # as VaeImageProcessor.postprocess
        return list(to_host([images])[0])

    def compat_key(self, request: Request) -> tuple:
        return request.params.key  # prompts are padded to one length: nothing to add

    def num_tokens(self, request: Request) -> int:
        p = request.params
        image = (p.height // self.vae_scale_factor // 2) * (p.width // self.vae_scale_factor // 2)
        return image + self.max_sequence_length
