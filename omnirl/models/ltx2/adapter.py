"""LTX-2 / LTX-2.3 text to video + audio: the diffusion adapter (packed denoising loop of both streams,
per-row SDE steps, per-stream log-probs), on `LTX2Pipeline` checkpoints.

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/ltx2/README.md`, "The adapter").
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import (
    LATENT_DOWNSAMPLE_FACTOR as AUDIO_LATENT_FACTOR,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.video_processor import VideoProcessor
from torch import nn
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

from omnirl.config import Config
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained
from omnirl.models.base import Output, Request, SamplingParams, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusersBase, make_trainable, trajectories
from omnirl.models.flow_sde import Pool, WindowedSampler, phase, to_host
from omnirl.ranges import POSITIVE, at_least

POOLINGS = ("joint", "equal")
# The text inputs of a forward (the connectors' video and audio embeddings and their mask), and with
# guidance each under "negative_" + its name too.
TEXT_INPUTS = ("prompt_embeds", "audio_prompt_embeds", "prompt_mask")


@dataclass
class LTX2Settings:
    num_frames: int = 81
    """Frames per video; num_frames - 1 must divide by the video VAE's temporal factor (8)."""
    frame_rate: float = 24.0
    """Frames per second: of the samples, of the transformer's positions, and of the audio's length
    (num_frames / frame_rate seconds of audio)."""
    audio_guidance_scale: float | None = None
    """Guidance of the audio stream (None: sampling.guidance_scale, one scale for both streams, the
    reference's; LTX2Pipeline's default is 7 with the video's 3)."""
    guidance_rescale: float = 0.0
    """Rescale of the video's guided x0 towards the conditional one's std (LTX2Pipeline's
    guidance_rescale; 0 = off, the reference's)."""
    audio_guidance_rescale: float = 0.0
    """The same for the audio stream (LTX2Pipeline's audio_guidance_rescale)."""
    logprob_pooling: str = "joint"
    """How a step's log-prob pools the streams: 'joint' one mean over all video and audio latent elements
    (the reference's), 'equal' the mean of each stream weighted 1/2."""
    max_sequence_length: int = 1024
    """Gemma prompt length (LTX2Pipeline's default 1024); the tokenizer's own limit lowers it."""
    decode_rows: int = 8
    """Samples the VAEs and the vocoder decode at once: bounds the decode's peak memory (a rollout's
    peak grows with the rows up to this chunk, then only with the latents). The default covers a
    typical packed batch in one decode, as LTX2Pipeline decodes its whole batch."""

    RANGES: ClassVar[dict] = {
        "num_frames": (
            (lambda v: v >= 1 and (v - 1) % 8 == 0),
            "an integer >= 1 with num_frames - 1 divisible by 8 (the video VAE's temporal factor)",
        ),
        "frame_rate": POSITIVE,
        "audio_guidance_scale": (
            (lambda v: v is None or (math.isfinite(v) and v >= 1)),
            "null (= sampling.guidance_scale) or a finite number >= 1 (1 = no guidance)",
        ),
        "guidance_rescale": ((lambda v: 0 <= v <= 1), "a number in [0, 1] (0 = off)"),
        "audio_guidance_rescale": ((lambda v: 0 <= v <= 1), "a number in [0, 1] (0 = off)"),
        "logprob_pooling": ((lambda v: v in POOLINGS), f"one of {', '.join(POOLINGS)}"),
        "max_sequence_length": at_least(1),
        "decode_rows": at_least(1),
    }


def check_duration(path: str, s: LTX2Settings) -> None:
    """family.num_frames / family.frame_rate seconds against the checkpoint's own configs (no weights
    read): at least one latent frame of audio (the audio VAE's rate: sample_rate / mel_hop_length / 4 per
    second; fewer is an empty audio stream the transformer cannot take), and at most the transformer's
    positional range (`pos_embed_max_pos` seconds, LTX-2's longest clip: its positions are seconds over
    that range). A ConfigError naming both fields otherwise."""
    # (load_config is typed as maybe a tuple: with return_unused_kwargs)
    audio: Any = AutoencoderKLLTX2Audio.load_config(path, subfolder="audio_vae")
    transformer: Any = LTX2VideoTransformer3DModel.load_config(path, subfolder="transformer")
    per_second = audio["sample_rate"] / audio["mel_hop_length"] / AUDIO_LATENT_FACTOR
    seconds, longest = s.num_frames / s.frame_rate, transformer.get("pos_embed_max_pos", 20)
    if round(seconds * per_second) < 1 or seconds > longest:
        raise ConfigError(
            f"family.num_frames {s.num_frames} at family.frame_rate {s.frame_rate:g} is {seconds:.3g} s of "
            f"video; model.path {path!r} needs at least {0.5 / per_second:.3g} s (one latent frame of audio) "
            f"and at most {longest} s (the transformer's positional range)"
        )


@dataclass(frozen=True)
class Grid:
    """A request's latent grid: video frames x height x width tokens and audio frames."""

    frames: int
    height: int
    width: int
    audio_frames: int


class LTX2Adapter(DiffusersBase):
    """The `DiffusionAdapter` for `LTX2Pipeline` checkpoints (LTX-2, LTX-2.3): video and audio."""

    kind = "diffusion"
    modalities = frozenset({"video", "audio"})
    pipeline_cls = LTX2Pipeline
    # rollout.precision fp8 keeps these block layers in bf16: none. An LTX-2 block modulates with learned
    # tables (scale_shift_table) and the time embeddings made outside the blocks.
    fp8_keep_bf16 = ()
    Settings = LTX2Settings
    # sampling.height / width must be multiples of this: the video VAE's 32x (patch size 1).
    pixel_multiple = 32

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path, dtype = cfg.model.path, DTYPES[cfg.model.dtype]
        self.settings: LTX2Settings = cfg.family
        check_duration(path, self.settings)  # from the configs alone, before any weights load
        self.transformer = load_pretrained(
            LTX2VideoTransformer3DModel, path, subfolder="transformer", torch_dtype=self.transformer_dtype
        )
        self.vae = load_pretrained(AutoencoderKLLTX2Video, path, subfolder="vae", torch_dtype=dtype)
        self.audio_vae = load_pretrained(
            AutoencoderKLLTX2Audio, path, subfolder="audio_vae", torch_dtype=dtype
        )
        vocoder_cls = _vocoder_class(path)
        self.vocoder = load_pretrained(vocoder_cls, path, subfolder="vocoder", torch_dtype=dtype)
        self.connectors = load_pretrained(LTX2TextConnectors, path, subfolder="connectors", torch_dtype=dtype)
        self.text_encoder = load_pretrained(
            Gemma3ForConditionalGeneration, path, subfolder="text_encoder", dtype=dtype
        )
        for module in self.offload_modules():
            module.requires_grad_(False).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer")
        self.max_sequence_length = min(self.settings.max_sequence_length, tokenizer.model_max_length)
        # (from_pretrained is typed as maybe a tuple: with return_unused_kwargs)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.scheduler = cast(FlowMatchEulerDiscreteScheduler, scheduler)
        # The pipeline of the text encoder alone (diffusers types its modules as required; None is taken).
        modules = ["scheduler", "vae", "audio_vae", "connectors", "transformer", "vocoder"]
        none: dict[str, Any] = dict.fromkeys(modules)
        self.text_pipe = LTX2Pipeline(**none, text_encoder=self.text_encoder, tokenizer=tokenizer)
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae.spatial_compression_ratio)
        self.config: Any = self.transformer.config  # diffusers' FrozenDict, read by field name
        c, a = self.config, cast(Any, self.audio_vae.config)  # diffusers' FrozenDict, read by field name
        self.latent_mel_bins = a.mel_bins // self.audio_vae.mel_compression_ratio
        if c.audio_in_channels != a.latent_channels * self.latent_mel_bins:
            raise ConfigError(
                f"model.path {path!r}: the transformer takes {c.audio_in_channels} audio features, the audio "
                f"VAE makes {a.latent_channels} channels x {self.latent_mel_bins} mel bins"
            )
        temporal = self.vae.temporal_compression_ratio
        if (self.settings.num_frames - 1) % temporal:
            raise ConfigError(
                f"family.num_frames - 1 must divide by {temporal} (the video VAE's temporal factor), got "
                f"{self.settings.num_frames}"
            )
        make_trainable(self.transformer, cfg, device)

    @property
    def memory_probe_rows(self) -> int:
        """The decode's chunk: a rollout's peak grows linearly from `decode_rows` rows on."""
        return self.settings.decode_rows

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae, self.audio_vae, self.vocoder, self.connectors, self.text_encoder]

    # ------------------------------------------------------------------------------------ latent layout

    def grid(self, height: int, width: int) -> Grid:
        """The latent grid of a sample of `height` x `width` pixels and family.num_frames frames."""
        s, c, a = self.settings, self.config, self.audio_vae.config
        frames = (s.num_frames - 1) // self.vae.temporal_compression_ratio + 1
        spatial = self.vae.spatial_compression_ratio
        # The pipeline's audio length: num_frames / frame_rate seconds at its latent rate.
        per_second = a["sample_rate"] / a["mel_hop_length"] / self.audio_vae.temporal_compression_ratio
        audio = round(s.num_frames / s.frame_rate * per_second)
        p = c.patch_size
        return Grid(frames // c.patch_size_t, height // spatial // p, width // spatial // p, audio)

    def stream_sizes(self, grid: Grid) -> tuple[int, int]:
        """Elements of the video and of the audio stream in the joined latent."""
        video_tokens = grid.frames * grid.height * grid.width
        return video_tokens * self.config.in_channels, grid.audio_frames * self.config.audio_in_channels

    def latent_shape(self, height: int, width: int) -> tuple[int]:
        """The joined latent of one sample: video then audio tokens, token-major, flattened: [L]."""
        return (sum(self.stream_sizes(self.grid(height, width))),)

    def split(self, latents: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """Joined latents [B, L] -> video tokens [B, N_v, C_v] and audio tokens [B, N_a, C_a] (views)."""
        n_video, _ = self.stream_sizes(grid)
        b = latents.shape[0]
        video = latents[:, :n_video].view(b, -1, self.config.in_channels)
        return video, latents[:, n_video:].view(b, grid.audio_frames, self.config.audio_in_channels)

    def logprob_pool(self, params: SamplingParams) -> Pool:
        """The video and audio streams: 'joint' weights each by its share of the elements (one mean over
        both, the reference's), 'equal' each by 1/2."""
        sizes = self.stream_sizes(self.grid(params.height, params.width))
        if self.settings.logprob_pooling == "joint":
            weights = tuple(n / sum(sizes) for n in sizes)
        else:
            weights = (0.5, 0.5)
        return Pool(("video", "audio"), sizes, weights)

    def sigmas(self, num_steps: int, video_tokens: int) -> torch.Tensor:
        """linspace(1, 1/N, N) shifted by the checkpoint's scheduler with the dynamic shift of the video
        token count, as LTX2Pipeline sets them: [num_steps + 1] float32, last 0."""
        scheduler = copy.deepcopy(self.scheduler)
        c: Any = scheduler.config  # diffusers' FrozenDict, read by field name
        mu = calculate_shift(
            video_tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps).tolist(), mu=mu)
        sigmas = scheduler.sigmas
        assert isinstance(sigmas, torch.Tensor)  # set_timesteps made them
        return sigmas.float().cpu()

    # ---------------------------------------------------------------------------------------- the model

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None, grid: Grid) -> dict:
        """Gemma hidden states through the connectors, as LTX2Pipeline: per prompt the video and audio
        text embeddings [B, T, D] and their mask [B, T] (and the negatives' with guidance), and the grid."""
        guided = negative_prompts is not None
        embeds, mask, negative, negative_mask = self.text_pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=negative_prompts,
            do_classifier_free_guidance=guided,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        padding_side = self.text_pipe.tokenizer.padding_side
        out = {}
        for prefix, e, m in (("", embeds, mask), ("negative_", negative, negative_mask))[: 1 + guided]:
            video, audio, connector_mask = self.connectors(e, m, padding_side=padding_side)
            out.update({f"{prefix}prompt_embeds": video, f"{prefix}audio_prompt_embeds": audio,
                        f"{prefix}prompt_mask": connector_mask})  # fmt: skip
        g = torch.tensor([grid.frames, grid.height, grid.width, grid.audio_frames], device=self.device)
        out["grid"] = g.expand(len(prompts), -1)  # [B, 4] what velocity unpacks the latents by
        return out

    def guided(self, guidance_scale: float) -> bool:
        """Whether either stream is guided (the negatives are encoded then): LTX2Pipeline's rule."""
        return max(guidance_scale, self.audio_scale(guidance_scale)) > 1

    def audio_scale(self, guidance_scale: float) -> float:
        g = self.settings.audio_guidance_scale
        return guidance_scale if g is None else g

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
        fused_cfg: bool = True,
        policy: nn.Module | None = None,
    ) -> torch.Tensor:
        """The guided velocity [B, L] float32 of the joined latents [B, L] at per-row sigmas [B]."""
        grid = Grid(*embeds["grid"][0].tolist())  # one sync per call, in the trainer only
        model = policy if policy is not None else self.transformer
        inputs = self.forward_inputs(embeds, grid, guidance_scale, fused_cfg, model)
        return self._velocity(latents, sigmas, inputs, grid, guidance_scale, model)

    def forward_inputs(
        self,
        embeds: dict[str, torch.Tensor],
        grid: Grid,
        guidance_scale: float,
        fused_cfg: bool,
        model: nn.Module,
    ) -> list[dict[str, Any]]:
        """What does not change from step to step, made once per batch as LTX2Pipeline makes it before its
        loop: per transformer forward of a step (the negatives' first with guidance; one with fused CFG,
        [negative; positive] stacked as the pipeline stacks them) its text inputs in the model's dtype and
        the RoPE coordinates of both streams."""
        dtype = compute_dtype(model, self.transformer_dtype)
        positive = {k: embeds[k] for k in TEXT_INPUTS}
        texts = [positive]
        if self.guided(guidance_scale):
            negative = {k: embeds[f"negative_{k}"] for k in TEXT_INPUTS}
            texts = [negative, positive]
            if fused_cfg:
                texts = [{k: torch.cat([negative[k], positive[k]]) for k in TEXT_INPUTS}]
        transformer: Any = self.transformer  # the policy wraps it (LoRA, FSDP): the same rope modules
        out = []
        for text in texts:
            rows, device = text["prompt_mask"].shape[0], text["prompt_mask"].device
            out.append({
                "encoder_hidden_states": text["prompt_embeds"].to(dtype),
                "audio_encoder_hidden_states": text["audio_prompt_embeds"].to(dtype),
                "encoder_attention_mask": text["prompt_mask"],
                "audio_encoder_attention_mask": text["prompt_mask"],
                "video_coords": transformer.rope.prepare_video_coords(
                    rows, grid.frames, grid.height, grid.width, device, fps=self.settings.frame_rate
                ),
                "audio_coords": transformer.audio_rope.prepare_audio_coords(rows, grid.audio_frames, device),
            })  # fmt: skip
        return out

    def _velocity(self, latents, sigmas, inputs, grid, guidance_scale, model):
        dtype = compute_dtype(model, self.transformer_dtype)
        x = latents.float()
        video, audio = self.split(x, grid)
        timestep = sigmas.float() * self.scheduler.config["num_train_timesteps"]  # the pipeline's timesteps

        def forward(video, audio, t, text):
            out_video, out_audio = model(
                hidden_states=video.to(dtype),
                audio_hidden_states=audio.to(dtype),
                timestep=t,
                sigma=t,  # LTX-2.3's prompt modulation; audio_sigma defaults to it, as in the pipeline
                num_frames=grid.frames,
                height=grid.height,
                width=grid.width,
                fps=self.settings.frame_rate,
                audio_num_frames=grid.audio_frames,
                use_cross_timestep=True,
                return_dict=False,
                **text,
            )
            return out_video.float(), out_audio.float()

        scales = (guidance_scale, self.audio_scale(guidance_scale))
        s = sigmas.float().view(-1, 1, 1)
        if not self.guided(guidance_scale):
            pairs = zip((video, audio), forward(video, audio, timestep, inputs[0]))
            # The pipeline's round trip through x0, kept so that both agree to rounding.
            return torch.cat([((x_ - (x_ - v * s)) / s).flatten(1) for x_, v in pairs], dim=1)
        if len(inputs) == 1:  # fused CFG: [negative; positive] in one forward
            out_video, out_audio = forward(
                torch.cat([video, video]), torch.cat([audio, audio]), timestep.repeat(2), inputs[0]
            )
            (uncond_video, cond_video), (uncond_audio, cond_audio) = out_video.chunk(2), out_audio.chunk(2)
            uncond, cond = (uncond_video, uncond_audio), (cond_video, cond_audio)
        else:
            uncond = forward(video, audio, timestep, inputs[0])
            cond = forward(video, audio, timestep, inputs[1])
        rescales = (self.settings.guidance_rescale, self.settings.audio_guidance_rescale)
        out = []
        for x_, v_cond, v_uncond, scale, rescale in zip((video, audio), cond, uncond, scales, rescales):
            x0_cond, x0_uncond = x_ - v_cond * s, x_ - v_uncond * s
            x0 = x0_cond + (scale - 1) * (x0_cond - x0_uncond)
            if rescale > 0:
                x0 = rescale_noise_cfg(x0, x0_cond, guidance_rescale=rescale)
            out.append(((x_ - x0) / s).flatten(1))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward (of both streams) per denoising step."""
        p = requests[0].params
        self.check_batch(requests, self.pixel_multiple * self.config.patch_size)
        grid = self.grid(p.height, p.width)
        sigmas = self.sigmas(p.num_steps, grid.frames * grid.height * grid.width)
        pool = self.logprob_pool(p)
        sampler = WindowedSampler(
            requests, self.latent_shape(p.height, p.width), sigmas, self.device, pool=pool, on_step=on_step
        )
        latents = sampler.initial_latents  # [B, L] float32
        with phase("encode"):
            negatives = [r.negative_prompt for r in requests] if self.guided(p.guidance_scale) else None
            embeds = self.encode([r.prompt for r in requests], negatives, grid)
            inputs = self.forward_inputs(embeds, grid, p.guidance_scale, p.fused_cfg, self.transformer)
        for i in sampler.steps():
            with phase("transformer"):
                v = self._velocity(
                    latents, sampler.sigma(i), inputs, grid, p.guidance_scale, self.transformer
                )
            latents = sampler.step(i, v, latents)

        with phase("vae_decode"):
            decoded = [self.decode(c, grid) for c in latents.split(self.settings.decode_rows)]
        videos = torch.cat([v for v, _ in decoded])
        audios = torch.cat([a for _, a in decoded])
        keys = list(embeds)
        videos, audios, latents, *values = to_host([videos, audios, latents, *embeds.values()])
        rows = [{k: e[b] for k, e in zip(keys, values)} for b in range(len(requests))]
        rate = self.vocoder.config.output_sampling_rate
        outputs = [
            Output(video=v, fps=self.settings.frame_rate, audio=a, sample_rate=rate)
            for v, a in zip(videos, audios)
        ]
        return trajectories(requests, sampler, sampler.host_sigmas, rows, outputs, latents)

    def decode(self, latents: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """Joined latents [B, L] -> videos [B, F, 3, H, W] in [0, 1] and audio [B, C, T] in [-1, 1], as
        LTX2Pipeline decodes them (the video VAE at decode timestep 0; the audio VAE, then the vocoder)."""
        c = self.config
        video, audio = self.split(latents, grid)
        video = LTX2Pipeline._unpack_latents(
            video, grid.frames, grid.height, grid.width, c.patch_size, c.patch_size_t
        ).to(self.vae.dtype)
        video = LTX2Pipeline._denormalize_latents(
            video, self.vae.latents_mean, self.vae.latents_std, self.vae.config["scaling_factor"]
        )
        timestep = None
        if self.vae.config["timestep_conditioning"]:  # the pipeline's decode_timestep 0, noise scale 0
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        frames = self.vae.decode(video, timestep, return_dict=False)[0]
        frames = self.video_processor.postprocess_video(frames, output_type="pt")  # [B, F, 3, H, W]
        assert isinstance(frames, torch.Tensor)  # output_type "pt"
        audio = LTX2Pipeline._denormalize_audio_latents(
            audio, self.audio_vae.latents_mean, self.audio_vae.latents_std
        )
        audio = LTX2Pipeline._unpack_audio_latents(
            audio, grid.audio_frames, num_mel_bins=self.latent_mel_bins
        )
        mel = self.audio_vae.decode(audio.to(self.audio_vae.dtype), return_dict=False)[0]
        wave = self.vocoder(mel.to(self.vocoder.dtype))  # [B, C, T]
        return frames.float(), wave.float().clamp(-1, 1)

    def compat_key(self, request: Request) -> tuple:
        # The frame count, frame rate and resolution shape both streams' latents (the audio's length).
        s = self.settings
        return request.params.key + (s.num_frames, s.frame_rate)

    def num_tokens(self, request: Request) -> int:
        """Video plus audio tokens: the two self-attentions' sequences (the cross-modal attentions and the
        text cross-attentions grow with the same counts)."""
        g = self.grid(request.params.height, request.params.width)
        return g.frames * g.height * g.width + g.audio_frames


def _vocoder_class(path: str) -> type:
    """The vocoder class the checkpoint names (LTX-2's `LTX2Vocoder`, LTX-2.3's `LTX2VocoderWithBWE`)."""
    from diffusers.pipelines.ltx2 import vocoder

    name = cast(dict, LTX2Pipeline.load_config(path))["vocoder"][1]  # (typed as maybe a tuple)
    return getattr(vocoder, name)
