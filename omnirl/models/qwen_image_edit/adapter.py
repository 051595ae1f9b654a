"""Qwen-Image-Edit: the diffusion adapter for text + condition image -> image (packed True-CFG loop, per-row
SDE windows, log-probs).

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/qwen_image_edit/README.md`, "The adapter").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
    calculate_dimensions,
)
from PIL import Image
from torch import nn
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, load_pretrained
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, make_trainable, trajectories
from omnirl.models.flow_sde import host_rows, phase, to_host
from omnirl.models.qwen_image.adapter import (
    DECODE_ROWS,
    bucket,
    bucket_range,
    collate_texts,
    decode,
    packed_velocity,
    pad_to,
    prepare_latents,
    row_texts,
    text_embeds,
)
from omnirl.ranges import at_least


class ImageOnlyProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor: the edit pipeline passes only images, and building
    the video processor needs torchvision (`Qwen2VLVideoProcessor` raises ImportError without it)."""

    def __init__(self, image_processor, tokenizer):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer)


@dataclass
class QwenImageEditSettings:
    prompt_length_buckets: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    """Text-token lengths that prompts are padded to (ascending), as Qwen-Image's. The text also holds the
    condition image's vision tokens and is never truncated (the edit pipeline does not): a longer one than
    the largest bucket is an error."""
    condition_area: int = 1024 * 1024
    """Pixel area the condition image is resized to (its aspect ratio kept, sides multiples of 32) before
    the VAE and the text encoder see it. QwenImageEditPipeline hard-codes 1024 * 1024."""

    RANGES: ClassVar[dict] = {  # checked when the recipe loads (omnirl.config_checks)
        "prompt_length_buckets": bucket_range(None),
        "condition_area": at_least(1),
    }


class QwenImageEditAdapter(DiffusersBase):
    """The `DiffusionAdapter` for `QwenImageEditPipeline` checkpoints (Qwen/Qwen-Image-Edit). Every request
    carries its condition image (a PIL image) in `request.inputs["image"]`."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image"})
    pipeline_cls = QwenImageEditPipeline
    # rollout.precision fp8 keeps these block layers in bf16: the modulation of the image and text streams,
    # as Qwen-Image's.
    fp8_keep_bf16 = ("img_mod.1", "txt_mod.1")
    memory_probe_rows = DECODE_ROWS  # the decode's chunk (qwen_image.decode)
    Settings = QwenImageEditSettings
    # sampling.height / width must be multiples of this (checked when the recipe loads): the VAE's 8x
    # downsampling times the 2x2 latent patches the transformer packs. The tiny test model's VAE: 2x.
    pixel_multiple = 16

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        self.buckets = list(cfg.family.prompt_length_buckets)
        self.condition_area = cfg.family.condition_area
        self.transformer = load_pretrained(
            QwenImageTransformer2DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKLQwenImage, path, subfolder="vae", torch_dtype=dtype)
        self.text_encoder = load_pretrained(
            Qwen2_5_VLForConditionalGeneration, path, subfolder="text_encoder", dtype=dtype
        )
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        # The classes the pipeline loads: another tokenizer class may read the same files into other ids.
        # The edit pipeline tokenizes with its processor's tokenizer (its own `tokenizer` goes unused).
        self.processor = ImageOnlyProcessor(
            Qwen2VLImageProcessor.from_pretrained(path, subfolder="processor"),
            Qwen2Tokenizer.from_pretrained(path, subfolder="processor"),
        )
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        # A pipeline without transformer, so that prompts, condition images and latents are prepared by
        # diffusers' own code (it computes vae_scale_factor, 8 for Qwen-Image, from the VAE)
        # (diffusers types its modules as required; None is taken).
        none: dict[str, Any] = dict.fromkeys(["scheduler", "transformer"])
        self.pipe = QwenImageEditPipeline(
            **none,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.processor.tokenizer,
            processor=self.processor,
        )
        self.vae_scale_factor = self.pipe.vae_scale_factor

        make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.text_encoder]

    def condition_size(self, request: Request) -> tuple[int, int]:
        """(height, width) in pixels the request's condition image is resized to, as the pipeline does:
        `condition_area` pixels at the image's aspect ratio, sides rounded to multiples of 32."""
        image = request.inputs.get("image")
        if image is None:
            raise ValueError(
                f"request {request.index} ({request.metadata.get('source', repr(request.prompt))}): "
                f"Qwen-Image-Edit needs a condition image in request.inputs['image']"
            )
        return self.resized(image.width, image.height)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) a `width` x `height` condition image is resized to (`condition_size`)."""
        new_width, new_height, _ = calculate_dimensions(self.condition_area, width / height)
        if not (new_width and new_height):
            raise ConfigError(
                f"family.condition_area {self.condition_area} is too small for a {width}x{height} "
                "condition image: a side rounds to 0 (sides are multiples of 32)"
            )
        return new_height, new_width

    def prompt_problem(self, row: PromptRow) -> str | None:
        """Why the row's instruction cannot run: with its condition image's vision tokens it is longer than
        the largest of family.prompt_length_buckets (the edit pipeline does not truncate), or None. The
        image's header gives its size; it is not decoded again."""
        with Image.open(row.inputs["image"]) as image:
            size = self.resized(*image.size)
        length = self.prompt_length(row.prompt, size)
        if length <= self.buckets[-1]:
            return None
        return (
            f"the instruction ({len(row.prompt)} characters) with its {size[1]}x{size[0]} condition image is "
            f"{length} text tokens, more than the largest of family.prompt_length_buckets "
            f"({self.buckets[-1]}): shorten it or add a larger bucket (the edit pipeline does not truncate)"
        )

    def prompt_length(self, prompt: str, condition_size: tuple[int, int]) -> int:
        """Text tokens the transformer sees for `prompt` with a condition image of `condition_size`: the
        templated prompt, whose one <|image_pad|> the processor expands into the image's vision tokens,
        minus the dropped template prefix."""
        pipe, image_processor = self.pipe, self.processor.image_processor
        tokens = self.processor.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
        patches = image_processor.get_number_of_image_patches(*condition_size)
        vision = patches // image_processor.merge_size**2
        return len(tokens) - 1 + vision - pipe.prompt_template_encode_start_idx

    def text_length(self, request: Request) -> int:
        """Text tokens of the request's conditional row: its prompt's with its condition image's vision
        tokens; with a fused CFG the longer of that and its negative prompt's (both rows share one forward
        and one padded length). Past the largest bucket it is an error: the pipeline does not truncate."""
        size = self.condition_size(request)
        texts = row_texts(request, request.params.fused_cfg)
        lengths = {text: self.prompt_length(text, size) for text in texts}
        for text, length in lengths.items():
            if length > self.buckets[-1]:  # data rows are checked before step 0: the negative prompt
                raise ConfigError(
                    f"{'sampling.negative_prompt' if text == request.negative_prompt else 'the prompt'} "
                    f"({len(text)} characters) with a {size[1]}x{size[0]} condition image is {length} text "
                    f"tokens, more than the largest of family.prompt_length_buckets ({self.buckets[-1]}): "
                    "shorten it or add a larger bucket (the edit pipeline does not truncate)"
                )
        return max(lengths.values())

    def compat_key(self, request: Request) -> tuple:
        """The sampling settings, the condition image's size and, when CFG runs as two forwards, the
        negative prompt's exact length (its own forward then needs no padding and no mask)."""
        size = self.condition_size(request)
        split = request.params.guidance_scale > 1 and not request.params.fused_cfg
        return request.params.key + (size, self.prompt_length(request.negative_prompt, size) if split else 0)

    def num_tokens(self, request: Request) -> int:
        """Transformer tokens of the request's conditional row (generated and condition image tokens, text
        padded to its bucket): the packer sorts by it and counts a batch as rows x its longest."""
        p, factor = request.params, self.vae_scale_factor * 2  # a token is a 2x2 patch of latents
        cond_h, cond_w = self.condition_size(request)
        image = (p.height // factor) * (p.width // factor) + (cond_h // factor) * (cond_w // factor)
        return image + bucket(self.buckets, self.text_length(request))

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list) -> list[torch.Tensor]:
        """Embeddings [L_i, D] on the device of each (prompt, resized condition image) pair, unpadded.

        Each distinct pair is encoded once: a GRPO group repeats its prompt and image `group_size` times
        (the requests of a data row share one image object), and the negative prompt is one string.
        """
        pairs = {(p, id(im)): (p, im) for p, im in zip(prompts, images)}
        position = {key: i for i, key in enumerate(pairs)}
        # [U, L, D], [U, L] (None when no row is padded); `image` takes PIL images (typed as a tensor)
        embeds, mask = self.pipe.encode_prompt(
            prompt=[p for p, _ in pairs.values()],
            image=[im for _, im in pairs.values()],  # pyright: ignore[reportArgumentType]
            device=self.device,
        )
        lengths = [embeds.shape[1]] * len(pairs) if mask is None else mask.sum(dim=1).tolist()
        rows = [embeds[i, :n] for i, n in enumerate(lengths)]
        return [rows[position[(p, id(im))]] for p, im in zip(prompts, images)]

    @torch.no_grad()
    def encode_images(self, images: list, height: int, width: int) -> torch.Tensor:
        """Normalised VAE latents [B, C, h, w] of resized condition images (the mode, as the pipeline)."""
        distinct = list({id(im): im for im in images}.values())  # a data row's requests share its image
        position = {id(im): i for i, im in enumerate(distinct)}
        pixels = self.pipe.image_processor.preprocess(distinct, height, width)  # [U, 3, H, W] in [-1, 1]
        pixels = pixels[:, :, None].to(self.device, self.vae.dtype)  # the video VAE's frame axis
        # [U, C, h, w]; the mode: no generator (typed as required)
        latents = self.pipe._encode_vae_image(pixels, generator=None)[:, :, 0]  # pyright: ignore[reportArgumentType]
        return latents[[position[id(im)] for im in images]]

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
        Each row's condition latents (`image_latents`, cropped to its `condition_size`) follow its image
        tokens. True-CFG as the pipeline: neg + s * (cond - neg), rescaled per token to the norm of the
        conditional prediction; the conditional and negative rows go through one forward by default
        (`fused_cfg`), the shorter text padded and masked to the longer. `policy` runs another module of
        the same architecture instead (the trainer's frozen reference copy for the KL term).
        """
        sizes = embeds["condition_size"]  # [B, 2] latent height, width of each row's condition image
        if (sizes != sizes[0]).any():
            # RoPE takes one image layout per forward (QwenEmbedRope reads img_shapes[0]), so a trainer
            # micro-batch mixing condition aspect ratios runs one forward per condition size.
            out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
            for size in sizes.unique(dim=0):
                rows = (sizes == size).all(dim=1).nonzero().squeeze(1)
                part = {k: e[rows] for k, e in embeds.items()}
                out[rows] = self.velocity(
                    latents[rows], sigmas[rows], part, guidance_scale, fused_cfg, policy
                )
            return out

        cond_h, cond_w = sizes[0].tolist()
        condition = embeds["image_latents"][:, :, :cond_h, :cond_w]  # [B, C, h', w'] (unpad)
        return packed_velocity(self, latents, sigmas, embeds, guidance_scale, fused_cfg, policy, condition)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch of one condition size as Qwen-Image's rollout does (one transformer
        forward per denoising step, two if not `fused_cfg`; each request's own generator), the text encoder
        and the VAE both reading each request's condition image at that size."""
        p = requests[0].params
        cond_h, cond_w = self.check_batch(requests, self.vae_scale_factor * 2)[-2]
        batch = len(requests)
        sigmas, sampler = prepare_latents(self, requests, on_step)
        latents = sampler.initial_latents  # [B, C, h, w]
        guided = p.guidance_scale > 1
        # The text encoder and the VAE both see the condition image resized to the condition size.
        sources = {id(r.inputs["image"]): r.inputs["image"] for r in requests}
        resized = {i: self.pipe.image_processor.resize(im, cond_h, cond_w) for i, im in sources.items()}
        conditions = [resized[id(r.inputs["image"])] for r in requests]
        texts = [r.prompt for r in requests] + ([r.negative_prompt for r in requests] if guided else [])
        with phase("encode"):
            rows = self.encode(texts, conditions * (2 if guided else 1))  # [L_i, D]: prompts, then negatives
            assert [len(r) for r in rows] == [self.prompt_length(t, (cond_h, cond_w)) for t in texts], (
                "prompt_length (hence the bucket) disagrees with the encoded length"
            )
            embeds = {"image_latents": self.encode_images(conditions, cond_h, cond_w)}  # [B, C, h', w']
            latent_size = list(embeds["image_latents"].shape[2:])
            embeds["condition_size"] = torch.tensor([latent_size] * batch, device=self.device)  # [B, 2]
            embeds |= text_embeds(rows, batch, self.buckets, p.fused_cfg)

        for i in sampler.steps():
            with phase("transformer"):  # [B, C, h, w]
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)

        with phase("vae_decode"):
            images = decode(self.vae, latents)  # [B, 3, H, W] in [0, 1]

        rows = host_rows(rows)  # one copy for the batch, not one per sample
        conditions_host, images, latents = to_host([embeds["image_latents"], images, latents])
        samples = [
            {"prompt_embeds": rows[b], "image_latents": conditions_host[b]}  # [L_b, D] unpadded, [C, h', w']
            | ({"negative_prompt_embeds": rows[batch + b]} if guided else {})
            for b in range(batch)
        ]
        outputs = [Output(image=im) for im in images]
        return trajectories(requests, sampler, sampler.host_sigmas, samples, outputs, latents)

    def batch_embeds(
        self, embeds: list[dict[str, torch.Tensor]], bucketed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Pad each text to the longest of the micro-batch (`bucketed`: to its bucket), with its mask
        (`<key>_mask`); zero-pad the condition latents to the largest condition size, recorded per row in
        `condition_size`."""
        keys = ("prompt_embeds", "negative_prompt_embeds")
        out = collate_texts(embeds, keys, self.buckets if bucketed else None)
        images = [e["image_latents"] for e in embeds]  # [C, h'_i, w'_i]
        out["condition_size"] = torch.tensor([im.shape[1:] for im in images])  # [B, 2]
        cond_h, cond_w = out["condition_size"].max(dim=0).values.tolist()
        out["image_latents"] = torch.stack([pad_to(pad_to(im, cond_h), cond_w, dim=2) for im in images])
        return out
