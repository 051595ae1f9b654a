"""Qwen-Image: the diffusion adapter (packed denoising loop with True-CFG, per-row SDE windows, log-probs).

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/qwen_image/README.md`, "The adapter").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from torch import nn
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from omnirl.config import Config
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, make_trainable, trajectories
from omnirl.models.flow_sde import WindowedSampler, host_rows, phase, to_host

# QwenImagePipeline.check_inputs rejects a longer max_sequence_length.
MAX_SEQUENCE_LENGTH = 1024
# Images the VAE decodes at once (`decode`).
DECODE_ROWS = 16


def pad_to(t: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """Zero-pad `t` at the end of `dim` to `length` (False for a bool mask)."""
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def collate(rows: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt embeddings [L_i, D] -> ([B, length, D] zero-padded at the end, [B, length] bool mask)."""
    embeds = torch.stack([pad_to(r, length, dim=0) for r in rows])
    positions = torch.arange(length, device=embeds.device)
    mask = torch.stack([positions < len(r) for r in rows])
    return embeds, mask


# The parts the Qwen-Image and Qwen-Image-Edit adapters share (their pipelines share them too).


def pipeline_sigmas(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The pipelines' sigma schedule: [num_steps + 1] float32 on the host, the last one 0. Its shift `mu`
    grows with the generated image's token count."""
    config = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    retrieve_timesteps(scheduler, num_steps, sigmas=sigmas.tolist(), mu=mu)
    return scheduler.sigmas.float().cpu()


def prepare_latents(
    adapter, requests: list[Request], on_step: StepHook | None = None
) -> tuple[torch.Tensor, WindowedSampler]:
    """The packed batch's sigma schedule [T + 1] (host; `pipeline_sigmas` of the generated image's tokens,
    an edit's condition tokens not counted) and its sampler, whose initial latents are [B, C, h, w]: C the
    transformer's input channels over 4, since it sees 2x2 latent patches; `on_step` goes to the sampler."""
    p, factor = requests[0].params, adapter.vae_scale_factor
    channels = adapter.transformer.config.in_channels // 4
    h, w = p.height // factor, p.width // factor
    sigmas = pipeline_sigmas(adapter.scheduler, p.num_steps, (h // 2) * (w // 2))  # [T + 1] host
    return sigmas, WindowedSampler(requests, (channels, h, w), sigmas, adapter.device, on_step=on_step)


def bucket(buckets: list[int], length: int) -> int:
    """The smallest of the ascending `buckets` that holds `length` tokens."""
    return next(b for b in buckets if b >= length)


def padded_lengths(
    buckets: list[int], cond: list[int], negative: list[int], fused_cfg: bool
) -> tuple[int, int]:
    """The (conditional, negative) lengths a packed batch pads its texts to, from its rows' own lengths:
    the conditional ones to the bucket of the longest; the negative ones to theirs too when CFG is fused
    (`true_cfg` then pads both to the longer), else to their own longest (one length: it is in the key), so
    the negative forward runs unpadded and unmasked. `negative` is empty without guidance."""
    neg = max(negative, default=0)
    return bucket(buckets, max(cond)), bucket(buckets, neg) if fused_cfg and negative else neg


def collate_texts(
    embeds: list[dict[str, torch.Tensor]], keys, buckets: list[int] | None
) -> dict[str, torch.Tensor]:
    """The micro-batch's texts of each of `keys` present, with masks (`<key>_mask`): padded to the longest
    row's bucket of `buckets`, or to the longest row when None. Bucketed, a compiled update meets the
    rollout's few text lengths instead of a new one whenever a micro-batch's longest prompt changes."""
    out = {}
    for key in keys:
        if key in embeds[0]:
            rows = [e[key] for e in embeds]
            longest = max(len(r) for r in rows)
            out[key], out[f"{key}_mask"] = collate(
                rows, longest if buckets is None else bucket(buckets, longest)
            )
    return out


def row_texts(request: Request, fused_cfg: bool) -> list[str]:
    """The texts of a request's conditional row: its prompt and, with a fused CFG, its negative prompt
    (both rows share one forward, hence one padded length)."""
    texts = [request.prompt]
    if fused_cfg and request.params.guidance_scale > 1:
        texts.append(request.negative_prompt)
    return texts


def text_embeds(
    rows: list[torch.Tensor], batch: int, buckets: list[int], fused_cfg: bool
) -> dict[str, torch.Tensor]:
    """The packed batch's text inputs from `encode`'s rows (the `batch` prompts, then their negative
    prompts when there are more rows), padded to the batch's `padded_lengths`, with masks."""
    lengths = [len(r) for r in rows]
    text_length, negative_length = padded_lengths(buckets, lengths[:batch], lengths[batch:], fused_cfg)
    embeds = {}
    embeds["prompt_embeds"], embeds["prompt_embeds_mask"] = collate(rows[:batch], text_length)
    if len(rows) > batch:
        negative = collate(rows[batch:], negative_length)
        embeds["negative_prompt_embeds"], embeds["negative_prompt_embeds_mask"] = negative
    return embeds


def true_cfg(forward, x, timestep, embeds: dict[str, torch.Tensor], guidance_scale: float, fused_cfg: bool):
    """The guided prediction of `forward(x, timestep, text, mask)` (the transformer's packed output).
    True-CFG as the pipelines: neg + s * (cond - neg), rescaled per token to the norm of the conditional
    prediction. The conditional and negative rows go through one forward when `fused_cfg` (the shorter
    text padded and masked to the longer), else two."""
    cond = (embeds["prompt_embeds"], embeds["prompt_embeds_mask"])  # [B, L, D], [B, L]
    if guidance_scale <= 1:
        return forward(x, timestep, *cond)
    neg = (embeds["negative_prompt_embeds"], embeds["negative_prompt_embeds_mask"])  # [B, L', D]
    if fused_cfg:
        length = max(cond[0].shape[1], neg[0].shape[1])
        v_cond, v_neg = forward(
            torch.cat([x, x]),
            torch.cat([timestep, timestep]),
            torch.cat([pad_to(cond[0], length), pad_to(neg[0], length)]),
            torch.cat([pad_to(cond[1], length), pad_to(neg[1], length)]),
        ).chunk(2)
    else:
        v_cond = forward(x, timestep, *cond)
        v_neg = forward(x, timestep, *neg)
    comb = v_neg + guidance_scale * (v_cond - v_neg)
    return comb * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def packed_velocity(
    adapter,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    embeds: dict[str, torch.Tensor],
    guidance_scale: float,
    fused_cfg: bool,
    policy: nn.Module | None,
    condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """The True-CFG velocity [B, C, h, w] float32 of `policy` (else the adapter's transformer) for latents
    [B, C, h, w] at per-row sigmas [B], its inputs packed as the pipelines pack them: 2x2 latent patches,
    the scheduler's timestep, and for an edit the tokens of the condition latents `condition`
    [B, C, h', w'] after the generated ones (`img_shapes` then has two entries per row), of which only the
    generated tokens' velocity is kept."""
    model = policy if policy is not None else adapter.transformer
    dtype = compute_dtype(model, adapter.transformer_dtype)  # the model's inputs: FSDP's root does not cast
    batch, channels, h, w = latents.shape
    pack = QwenImagePipeline._pack_latents
    x = pack(latents, batch, channels, h, w)  # [B, S, 4C], S = h/2 * w/2
    img_shapes = [(1, h // 2, w // 2)]
    if condition is not None:
        cond_h, cond_w = condition.shape[2:]
        x = torch.cat([x, pack(condition, batch, channels, cond_h, cond_w)], dim=1)  # [B, S + S', 4C]
        img_shapes.append((1, cond_h // 2, cond_w // 2))
    x = x.to(dtype)
    num_image_tokens = (h // 2) * (w // 2)
    # The pipeline feeds the scheduler's timestep (sigma * 1000, float32) cast to its dtype, / 1000.
    timestep = (sigmas.float() * adapter.scheduler.config.num_train_timesteps).to(dtype) / 1000  # [B]

    def forward(x, t, text, mask):
        out = model(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=text.to(dtype),
            # A mask keeps SDPA off its flash kernel: pass none when no row is padded.
            encoder_hidden_states_mask=None if mask.all() else mask,
            img_shapes=[img_shapes] * len(x),
            return_dict=False,
        )[0]
        return out[:, :num_image_tokens].float()  # [B', S, 4C] the generated tokens only

    v = true_cfg(forward, x, timestep, embeds, guidance_scale, fused_cfg)
    # _unpack_latents works in pixels and adds the video VAE's frame axis.
    pixels = adapter.vae_scale_factor
    return QwenImagePipeline._unpack_latents(v, h * pixels, w * pixels, pixels)[:, :, 0]


def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] float32 in [0, 1] of latents [B, C, h, w], de-normalised as the pipelines do,
    with the frame axis the video VAE expects."""
    config, vae_dtype, device = vae.config, vae.dtype, latents.device
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(device, vae_dtype)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(device, vae_dtype)
    vae_in = latents[:, :, None].to(vae_dtype) / inv_std + mean  # [B, C, 1, h, w]
    # In chunks: the video VAE's activations grow with the batch (64 images at 512 px ran out of the
    # H200's memory next to the transformer; benchmarks/RESULTS.md), and each image decodes on its own.
    chunks = [vae.decode(x, return_dict=False)[0][:, :, 0] for x in vae_in.split(DECODE_ROWS)]
    images = torch.cat(chunks)  # [B, 3, H, W] in [-1, 1]
    return (images.float() * 0.5 + 0.5).clamp(0, 1)  # as VaeImageProcessor.postprocess


def bucket_range(limit: int | None) -> tuple:
    """The range of family.prompt_length_buckets (a `Settings.RANGES` entry): distinct ascending positive
    lengths, at most `limit` (None: no limit)."""
    return (
        lambda b: bool(b) and b == sorted(set(b)) and b[0] >= 1 and (limit is None or b[-1] <= limit),
        f"distinct ascending lengths {f'in [1, {limit}]' if limit else 'positive'}",
    )


@dataclass
class QwenImageSettings:
    prompt_length_buckets: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    """Text-token lengths that prompts are padded to (ascending): a packed batch pads its texts to the
    smallest bucket that holds its longest, so a compiled transformer sees few shapes. Requests of different
    buckets share a batch (the packer sorts them by length and fills full batches). The largest is the
    maximum prompt length: longer prompts are truncated to it (the pipeline's max_sequence_length, at most
    1024)."""

    RANGES: ClassVar[dict] = {"prompt_length_buckets": bucket_range(MAX_SEQUENCE_LENGTH)}  # checked at load


class QwenImageAdapter(DiffusersBase):
    """The `DiffusionAdapter` for `QwenImagePipeline` checkpoints (Qwen/Qwen-Image)."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image"})
    pipeline_cls = QwenImagePipeline
    # rollout.precision fp8 keeps these block layers in bf16: the modulation of the image and text streams.
    fp8_keep_bf16 = ("img_mod.1", "txt_mod.1")
    memory_probe_rows = DECODE_ROWS  # the decode's chunk (`decode`)
    Settings = QwenImageSettings
    # sampling.height / width must be multiples of this (checked when the recipe loads): the VAE's 8x
    # downsampling times the 2x2 latent patches the transformer packs. The tiny test model's VAE: 2x.
    pixel_multiple = 16

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        self.buckets = list(cfg.family.prompt_length_buckets)
        self.transformer = load_pretrained(
            QwenImageTransformer2DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKLQwenImage, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(
            Qwen2_5_VLForConditionalGeneration, path, subfolder="text_encoder", dtype=dtype
        )
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        # The class the pipeline loads: another tokenizer class may read the same files into other ids.
        self.tokenizer = Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer")
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        # Computed as the pipeline does (8 for Qwen-Image); the transformer then packs 2x2 latent patches.
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        # A pipeline around the text encoder only, so that prompts are encoded by diffusers' own code
        # (diffusers types its modules as required; None is taken).
        none: dict[str, Any] = dict.fromkeys(["scheduler", "vae", "transformer"])
        self.text_pipe = QwenImagePipeline(**none, text_encoder=self.text_encoder, tokenizer=self.tokenizer)

        make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder]

    def prompt_length(self, prompt: str) -> int:
        """Text tokens the transformer sees for `prompt`: the templated prompt minus the dropped template
        prefix, truncated to the largest bucket (as `encode_prompt` truncates to max_sequence_length)."""
        pipe = self.text_pipe
        tokens = self.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
        return min(len(tokens) - pipe.prompt_template_encode_start_idx, self.buckets[-1])

    def text_length(self, request: Request) -> int:
        """Text tokens of the request's conditional row: its prompt's; with a fused CFG the longer of its
        prompt's and its negative prompt's, since both rows share one forward and one padded length."""
        return max(self.prompt_length(t) for t in row_texts(request, request.params.fused_cfg))

    def compat_key(self, request: Request) -> tuple:
        """The sampling settings and, when CFG runs as two forwards, the negative prompt's exact length: a
        recipe's negative prompt is usually one string for all requests, so its own forward then needs
        neither padding nor a mask (padding a 6-token negative to a 64-token bucket costs transformer time:
        benchmarks/RESULTS.md). Prompt lengths are not in the key (see the module
        docstring): a batch pads to its longest prompt's bucket."""
        guided = request.params.guidance_scale > 1
        split = guided and not request.params.fused_cfg
        return request.params.key + (self.prompt_length(request.negative_prompt) if split else 0,)

    def num_tokens(self, request: Request) -> int:
        """Transformer tokens of the request's conditional row when its text is padded to its bucket (the
        packer sorts by it and counts a batch as rows x its longest)."""
        p = request.params
        image = (p.height // self.vae_scale_factor // 2) * (p.width // self.vae_scale_factor // 2)
        return image + bucket(self.buckets, self.text_length(request))  # prompt_length <= the largest

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Each prompt's embeddings [L_i, D] on the device, unpadded (L_i = `prompt_length`).

        Each distinct prompt is encoded once: a GRPO group repeats its prompt `group_size` times, and the
        negative prompt is usually one string for all.
        """
        unique = list(dict.fromkeys(prompts))
        embeds, mask = self.text_pipe.encode_prompt(
            unique, device=self.device, max_sequence_length=self.buckets[-1]
        )  # [U, L, D], [U, L] (None when no row is padded)
        lengths = [embeds.shape[1]] * len(unique) if mask is None else mask.sum(dim=1).tolist()
        rows = {p: embeds[i, :n] for i, (p, n) in enumerate(zip(unique, lengths))}
        return [rows[p] for p in prompts]

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
        True-CFG as the pipeline: neg + s * (cond - neg), rescaled per token to the norm of the conditional
        prediction. The conditional and negative rows go through one forward by default (`fused_cfg`), the
        shorter text padded and masked to the longer. `policy` runs another module of the same architecture
        instead (the trainer's frozen reference copy for the KL term).
        """
        return packed_velocity(self, latents, sigmas, embeds, guidance_scale, fused_cfg, policy)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward per denoising step (two if not `fused_cfg`).

        Each request's own generator draws, in order: its initial latents, its SDE window start, and the
        noise of each step inside its window; so a request's sample does not depend on its batch.
        """
        p = requests[0].params
        self.check_batch(requests, self.vae_scale_factor * 2)
        batch = len(requests)
        sigmas, sampler = prepare_latents(self, requests, on_step)
        latents = sampler.initial_latents  # [B, C, h, w]
        guided = p.guidance_scale > 1
        texts = [r.prompt for r in requests] + ([r.negative_prompt for r in requests] if guided else [])
        with phase("encode"):
            rows = self.encode(texts)  # [L_i, D] each: the prompts, then the negative prompts
            embeds = text_embeds(rows, batch, self.buckets, p.fused_cfg)

        for i in sampler.steps():
            with phase("transformer"):  # [B, C, h, w]
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)

        with phase("vae_decode"):
            images = decode(self.vae, latents)  # [B, 3, H, W] in [0, 1]

        rows = host_rows(rows)  # one copy for the batch, not one per sample
        images, latents = to_host([images, latents])
        samples = [
            {"prompt_embeds": rows[b]} | ({"negative_prompt_embeds": rows[batch + b]} if guided else {})
            for b in range(batch)
        ]  # [L_b, D], unpadded: batch_embeds pads
        outputs = [Output(image=im) for im in images]
        return trajectories(requests, sampler, sampler.host_sigmas, samples, outputs, latents)

    def batch_embeds(
        self, embeds: list[dict[str, torch.Tensor]], bucketed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Pad each text to the longest of the micro-batch (`bucketed`: to its bucket), with its mask."""
        return collate_texts(embeds, embeds[0], self.buckets if bucketed else None)
