"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): the diffusion adapter of its text-to-image path.

How the adapter is built, what it takes from the libraries and what it writes out: README.md beside it
(`omnirl/models/bagel/README.md`, "The adapter").
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, cast

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer

from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.errors import ConfigError
from omnirl.fsdp import DTYPES, compute_dtype, load_pretrained, place_policy
from omnirl.models.bagel.port import (
    LATENT_CHANNELS,
    LATENT_PATCH,
    LLM_CONFIG,
    SKIPPED_PREFIXES,
    VAE_WEIGHTS,
    WEIGHTS,
    BagelConfig,
    BagelModel,
    load_vae,
    official_name,
    save_official,
)
from omnirl.models.base import Output, Request, StepHook, Trajectory
from omnirl.models.diffusers_setup import DiffusionBase, trajectories
from omnirl.models.flow_sde import WindowedSampler, host_rows, phase, to_host
from omnirl.models.peft_lora import peft_config, sorted_sets
from omnirl.ranges import POSITIVE
from omnirl.weights import load_safetensors, safe_open

DECODE_ROWS = 16  # images the VAE decodes at once
LORA_FILE = "adapter_model.safetensors"  # peft's
# A full fine-tune trains these besides the generation copy (`*_moe_gen`): what only generation reads.
GENERATION_MODULES = ("time_embedder.", "vae2llm.", "llm2vae.")


@dataclass
class BagelSettings:
    cfg_image_scale: float = 1.0
    """Image guidance scale (1 = off). For text to image the image-unconditional context is the
    conditional one, so a scale above 1 rescales the text-guided velocity around the conditional one."""
    cfg_interval: list[float] = field(default_factory=lambda: [0.4, 1.0])
    """Guidance applies where lo < sigma <= hi (the official inference's default [0.4, 1.0]); elsewhere the
    conditional velocity alone."""
    timestep_shift: float = 3.0
    """The schedule's shift s: sigma = s t / (1 + (s - 1) t) over t = linspace(1, 0, num_steps + 1)."""

    RANGES: ClassVar[dict] = {
        "cfg_image_scale": ((lambda v: math.isfinite(v) and v >= 1), "a finite number >= 1 (1 = off)"),
        "cfg_interval": (lambda v: len(v) == 2 and 0 <= v[0] < v[1] <= 1, "[lo, hi] with 0 <= lo < hi <= 1"),
        "timestep_shift": POSITIVE,
    }


def bagel_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """[num_steps + 1] float32, 1 down to 0: BAGEL's shifted schedule over num_steps + 1 points."""
    t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, h, w] -> tokens [B, h/2 * w/2, 4C], each 2x2 patch ordered (row, column, channel)."""
    b, c, h, w = latents.shape
    p = LATENT_PATCH
    x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `patchify`: tokens [B, S, 4C] -> latents [B, C, h, w]."""
    b, p = tokens.shape[0], LATENT_PATCH
    x = tokens.reshape(b, h // p, w // p, p, p, -1).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, -1, h, w)


def collate_context(rows: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt contexts [layers, 2, kv, L_i, hd] -> ([B, layers, 2, kv, L, hd] zero-padded at the end,
    [B, L] bool mask), L the longest (or `length`)."""
    length = max(r.shape[3] for r in rows) if length is None else length
    padded = [torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[3])) for r in rows]
    positions = torch.arange(length, device=rows[0].device)
    return torch.stack(padded), torch.stack([positions < r.shape[3] for r in rows])


class BagelAdapter(DiffusionBase):
    """The `DiffusionAdapter` for BAGEL checkpoints in the official layout (`port.py`).

    BAGEL has no diffusers pipeline: it subclasses the family-independent `DiffusionBase` (the policy and
    its trainable parameters, the batch checks, the LoRA off), checks its own checkpoint layout
    (`check_path`), and writes its LoRA in peft's format over the official module names and its merged
    export in the official layout."""

    kind = "diffusion"  # the trainer's ops for this adapter (omnirl.ops.OPS)
    modalities = frozenset({"image"})
    Settings = BagelSettings
    fp8_keep_bf16 = ()
    memory_probe_rows = DECODE_ROWS  # the decode's chunk
    # The FLUX VAE's 8x downsampling times the 2x2 latent patches (the tiny model's VAE: 2x).
    pixel_multiple = 16

    @classmethod
    def check_path(cls, path: str) -> None:
        check_layout(path)

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        path = cfg.model.path
        self.settings: BagelSettings = cfg.family
        self.transformer = load_pretrained(BagelModel, path, torch_dtype=self.transformer_dtype)
        self.vae = load_vae(Path(path) / VAE_WEIGHTS, DTYPES[cfg.model.dtype]).requires_grad_(False)
        self.vae.to(device)  # pyright: ignore[reportArgumentType] (diffusers' `to`: the unbound Module.to)
        self.vae_scale_factor = 2 ** (len(self.vae.config["block_out_channels"]) - 1)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        ids = self.tokenizer.convert_tokens_to_ids(
            ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
        )
        self.bos, self.eos = ids[:2]
        self.marks = torch.tensor(ids[2:], device=device)
        self.lora_count = make_trainable(self.transformer, cfg, device)

    def offload_modules(self) -> list[nn.Module]:
        return [self.vae]

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.transformer.layers)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The context's tokens: <|im_start|>, the prompt's own (no special token added), <|im_end|>."""
        return [self.bos, *self.tokenizer.encode(prompt, add_special_tokens=False), self.eos]

    def prompt_problem(self, row: PromptRow) -> str | None:
        """Why the row's prompt cannot run: its context (`prompt_ids`) and the image's query position after
        it are more positions than the language model has (its max_position_embeddings; the official
        inference does not truncate), or None."""
        tokens = len(self.prompt_ids(row.prompt))
        limit = cast(BagelConfig, self.transformer.config).llm.max_position_embeddings
        if tokens < limit:
            return None
        return (
            f"the prompt ({len(row.prompt)} characters) is {tokens} context tokens; with the image's query "
            f"position after them that is more than the language model's {limit} positions "
            f"(max_position_embeddings): shorten it"
        )

    def compat_key(self, request: Request) -> tuple:
        return request.params.key  # contexts are padded to the batch's longest: nothing to add

    def num_tokens(self, request: Request) -> int:
        """The row's query tokens (its latent tokens and the two image marks) and the context it attends."""
        p, f = request.params, self.vae_scale_factor * LATENT_PATCH
        return (p.height // f) * (p.width // f) + 2 + len(self.prompt_ids(request.prompt))

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Each prompt's context [layers, 2, kv_heads, L_i, hd] on the device (each distinct prompt once)."""
        unique = list(dict.fromkeys(prompts))
        ids = [self.prompt_ids(p) for p in unique]
        length = max(len(i) for i in ids)
        input_ids = torch.tensor([i + [self.eos] * (length - len(i)) for i in ids], device=self.device)
        mask = torch.tensor([[j < len(i) for j in range(length)] for i in ids], device=self.device)
        context = self.transformer(mode="context", input_ids=input_ids, attention_mask=mask)
        rows = {p: context[u, :, :, :, : len(i)] for u, (p, i) in enumerate(zip(unique, ids))}
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
        """The guided velocity [B, C, h, w] float32 for latents [B, C, h, w] at per-row sigmas [B] and the
        rows' contexts (`embeds`: "context" [B, layers, 2, kv, L, hd], "context_mask" [B, L]).

        The rollout and the trainer both call this. The conditional and text-unconditional rows go through
        one forward with `fused_cfg` (the empty context padded and masked), else two. `policy` runs another
        module of the same architecture (the trainer's frozen reference copy)."""
        model = policy if policy is not None else self.transformer
        dtype = compute_dtype(model, self.transformer_dtype)  # the model's inputs: FSDP's root does not cast
        batch, _, h, w = latents.shape
        tokens = patchify(latents).to(dtype)
        # torch types module attributes as Tensor | Module: the policy (or its copy) is a BagelModel
        side, f = cast(BagelConfig, model.config).max_latent_size, LATENT_PATCH
        rows = torch.arange(h // f, device=latents.device)[:, None]
        position_ids = (rows * side + torch.arange(w // f, device=latents.device)).reshape(-1)
        context, mask = embeds["context"].to(dtype), embeds["context_mask"]

        def forward(x, sigma, ctx, ctx_mask):
            out = model(mode="velocity", tokens=x, sigma=sigma, position_ids=position_ids, marks=self.marks,
                        context=ctx, context_mask=ctx_mask)  # fmt: skip
            return out.float()

        s = self.settings
        lo, hi = s.cfg_interval
        active = (sigmas > lo) & (sigmas <= hi) & (guidance_scale > 1)  # [B] rows guided at their sigma
        if not bool(active.any()):
            return unpatchify(forward(tokens, sigmas, context, mask), h, w)
        empty, empty_mask = context[:, :, :, :, :0], mask[:, :0]
        if fused_cfg:
            padded = torch.zeros_like(context)
            v_cond, v_uncond = forward(
                torch.cat([tokens, tokens]), torch.cat([sigmas, sigmas]), torch.cat([context, padded]),
                torch.cat([mask, torch.zeros_like(mask)]),
            ).chunk(2)  # fmt: skip
        else:
            v_cond = forward(tokens, sigmas, context, mask)
            v_uncond = forward(tokens, sigmas, empty, empty_mask)
        scale = torch.where(active, guidance_scale, 1.0)[:, None, None]
        v_text = v_uncond + scale * (v_cond - v_uncond)
        image_scale = torch.where(active, s.cfg_image_scale, 1.0)[:, None, None]
        v = v_cond + image_scale * (v_text - v_cond)  # the image-unconditional velocity is v_cond here
        ratio = v_cond.flatten(1).norm(dim=1) / (v.flatten(1).norm(dim=1) + 1e-8)
        renorm = torch.where(active, ratio.clamp(0, 1), 1.0)[:, None, None]
        return unpatchify(v * renorm, h, w)

    @torch.no_grad()
    def rollout(self, requests: list[Request], on_step: StepHook | None = None) -> list[Trajectory]:
        """Generate a packed batch: one transformer forward per denoising step (two without `fused_cfg`),
        the prompts' contexts computed once first. Each request's own generator draws its initial latents,
        its window start and its step noise, on the host: its sample does not depend on its batch."""
        p = requests[0].params
        self.check_batch(requests, self.vae_scale_factor * LATENT_PATCH)
        f = self.vae_scale_factor
        shift = self.settings.timestep_shift
        sigmas = bagel_sigmas(p.num_steps, shift)
        sampler = WindowedSampler(
            requests,
            (LATENT_CHANNELS, p.height // f, p.width // f),
            sigmas,
            self.device,
            shift,
            on_step=on_step,
        )
        latents = sampler.initial_latents  # [B, C, h, w]
        with phase("encode"):
            rows = self.encode([r.prompt for r in requests])  # [layers, 2, kv, L_i, hd] each
            context, mask = collate_context(rows)
            embeds = {"context": context, "context_mask": mask}
        for i in sampler.steps():
            with phase("transformer"):
                v = self.velocity(latents, sampler.sigma(i), embeds, p.guidance_scale, p.fused_cfg)
            latents = sampler.step(i, v, latents)
        images = self.decode(latents)
        rows = host_rows(rows)  # one copy for the batch
        (latents,) = to_host([latents])
        outputs = [Output(image=im) for im in images]
        samples = [{"context": r} for r in rows]  # unpadded: batch_embeds pads
        return trajectories(requests, sampler, sampler.host_sigmas, samples, outputs, latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Images [3, H, W] in [0, 1] on the host of latents [B, C, h, w]: de-normalised as the FLUX
        autoencoder's decode (z / scale + shift) and decoded in the VAE's own dtype, in chunks."""
        with phase("vae_decode"):
            config = self.vae.config
            z = latents.to(self.device).float() / config["scaling_factor"] + config["shift_factor"]
            chunks = [
                self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0] for x in z.split(DECODE_ROWS)
            ]
            images = (torch.cat(chunks).float() * 0.5 + 0.5).clamp(0, 1)  # [B, 3, H, W]
        return list(to_host([images])[0])

    def batch_embeds(
        self, embeds: list[dict[str, torch.Tensor]], bucketed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Pad each context to the longest of the micro-batch, with its mask (`bucketed` as well: the
        context lengths have no buckets, so a compiled update meets each new longest context)."""
        context, mask = collate_context([e["context"] for e in embeds])
        return {"context": context, "context_mask": mask}

    def trained_modules(self) -> dict[str, nn.Module]:
        return {"policy": self.transformer}

    def export_lora(self, out_dir: str | Path, state_dict: dict | None = None) -> None:
        """Write the LoRA as a peft adapter (adapter_config.json + adapter_model.safetensors) whose module
        names are the official checkpoint's (`language_model.model.layers.N.self_attn.q_proj_moe_gen`, ...).
        An FSDP run passes the gathered full state dict."""
        if not self.lora:
            raise ValueError("export_lora needs model.finetune 'lora'")
        layers = peft.get_peft_model_state_dict(self.transformer, state_dict=state_dict)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = sorted_sets(peft_config(self.transformer)["default"])
        config.target_modules = sorted({official_name(n) for n in lora_module_names(self.transformer)})
        config.save_pretrained(str(out))
        tensors = {
            f"base_model.model.{lora_official_name(k)}": v.detach().cpu().contiguous()
            for k, v in layers.items()
        }
        save_file(tensors, out / LORA_FILE, metadata={"format": "pt"})

    def export_merged(self, out_dir: str | Path, dtype: torch.dtype) -> None:
        """The official layout of model.path in `dtype` with the trained weights in it: the LoRA fused into
        its base (`merge_lora`), or the fully fine-tuned model in place of the base."""
        if self.lora:
            with tempfile.TemporaryDirectory() as tmp:
                self.export_lora(tmp)
                self.merge_lora(self.model_path, Path(tmp), out_dir, dtype)
            return
        write_like(self.model_path, out_dir, self.transformer, dtype)

    @classmethod
    def lora_files(cls, model_path: str) -> dict[str, str]:
        return {"policy": LORA_FILE}

    @classmethod
    def merge_lora(cls, model_path: str, lora_dir: Path, out_dir: str | Path, dtype: torch.dtype) -> None:
        """The official layout of `model_path` in `dtype` with the peft LoRA of `lora_dir` fused into the
        weights it adapts (W += alpha / r * B A, in float32)."""
        file, config_file = Path(lora_dir) / LORA_FILE, Path(lora_dir) / "adapter_config.json"
        try:  # (typed as the base class)
            config = cast(peft.LoraConfig, peft.LoraConfig.from_pretrained(str(lora_dir)))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{config_file}: not a peft LoRA config ({e})") from None
        lora = load_safetensors(file)
        model = BagelModel.from_pretrained(model_path, torch.float32)
        ours = {official_name(k): k for k in model.state_dict()}
        params = dict(model.named_parameters())
        scale = config.lora_alpha / config.r
        for key, a in lora.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = lora.get(key.replace(".lora_A.", ".lora_B."))
            name = ours.get(f"{module}.weight")
            if b is None or name is None:
                what = "has no lora_B pair" if b is None else "adapts no weight of this BAGEL"
                raise ConfigError(f"{file}: {key} {what}: a LoRA of another model?")
            weight = params[name]
            if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                raise ConfigError(
                    f"{file}: {key} updates a {b.shape[0]}x{a.shape[1]} weight; this BAGEL's {module} is "
                    f"{weight.shape[0]}x{weight.shape[1]}: a LoRA of another model?"
                )
            with torch.no_grad():
                weight += scale * (b.float() @ a.float())
        write_like(model_path, out_dir, model, dtype)


def write_like(model_path: str, out_dir: str | Path, model: BagelModel, dtype: torch.dtype) -> None:
    """`model` in the official layout of `model_path` under `out_dir`: its weights in ema.safetensors in
    `dtype` beside the source's understanding-only tensors, the source's autoencoder and tokenizer files."""
    src, out = Path(model_path), Path(out_dir)
    with safe_open(src / WEIGHTS) as f:
        skipped = {k: f.get_tensor(k) for k in f.keys() if k.startswith(SKIPPED_PREFIXES)}
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    save_official(model, load_vae(src / VAE_WEIGHTS, torch.float32), out, dtype, skipped, state)
    shutil.copy(src / VAE_WEIGHTS, out / VAE_WEIGHTS)  # as it was, byte for byte
    for name in src.iterdir():
        if name.is_file() and name.name not in (WEIGHTS, VAE_WEIGHTS, LLM_CONFIG):
            shutil.copy(name, out / name.name)


def check_layout(path: str) -> None:
    """model.path is a directory in the official layout, else a ConfigError naming what is missing."""
    if not Path(path).is_dir():
        raise ConfigError(
            f"model.path {path!r} is not a directory (a BAGEL checkpoint in the official layout)"
        )
    for name in (LLM_CONFIG, WEIGHTS, VAE_WEIGHTS, "tokenizer_config.json"):
        if not (Path(path) / name).is_file():
            raise ConfigError(
                f"model.path {path!r} has no {name}: not a BAGEL checkpoint in the official layout"
            )


def lora_module_names(model: nn.Module) -> list[str]:
    """The names of the modules a LoRA is bound to."""
    return [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def lora_official_name(key: str) -> str:
    """A peft LoRA key of ours (`layers.0.self_attn.q_proj_moe_gen.lora_A.weight`) under the official name."""
    module, _, rest = key.partition(".lora_")
    return f"{official_name(module)}.lora_{rest}"


def make_trainable(model: BagelModel, cfg: Config, device: torch.device) -> int:
    """Only the generation pathway trains. LoRA (`model.finetune` lora): peft layers on the modules of
    `lora.target_modules` (peft's suffix match: name the generation copies, `q_proj_moe_gen`,
    `mlp_moe_gen.gate_proj`, ...), in float32 over the frozen base; a target that binds a module of the
    understanding copy is a ConfigError (it would change the kept contexts), and so is one that binds none.
    Full: the generation copy (`*_moe_gen`), the timestep embedder and the latent embed / unembed train,
    the understanding copy stays frozen. Returns the number of modules the LoRA bound (0 for full). Then
    gradient checkpointing (`model.gradient_checkpointing`, applied only where gradients are computed) and
    onto `device` unless FSDP2 shards the frozen base (`place_policy`)."""
    model.requires_grad_(False)
    count = 0
    if cfg.model.finetune == "lora":
        config = peft.LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,  # pyright: ignore[reportArgumentType] (peft types it int)
            target_modules=cfg.lora.target_modules,
            init_lora_weights=True if cfg.lora.init == "default" else "gaussian",
            lora_dropout=cfg.lora.dropout,
        )
        try:
            peft.inject_adapter_in_model(config, model)
        except ValueError as e:  # peft: "Target modules ... not found in the base model"
            raise ConfigError(
                f"lora.target_modules {cfg.lora.target_modules} bind no module of BAGEL: {e}"
            ) from None
        names = lora_module_names(model)
        count = len(names)
        if not count:
            raise ConfigError(f"lora.target_modules {cfg.lora.target_modules} bind no module of BAGEL")
        understanding = [n for n in names if "_moe_gen" not in n]
        if understanding:
            raise ConfigError(
                f"lora.target_modules bind {understanding[0]}, a module of the understanding pathway: only "
                "the generation copies (*_moe_gen) may train, since the prompts' contexts are kept"
            )
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
                p.requires_grad_(True)
    else:
        for name, p in model.named_parameters():
            if "_moe_gen" in name or name.startswith(GENERATION_MODULES):
                p.requires_grad_(True)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing is True  # auto: omnirl.autotune
    place_policy(model, cfg.distributed.frozen_base, device)
    return count
