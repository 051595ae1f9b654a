"""BAGEL's text-to-image path (ByteDance-Seed/BAGEL-7B-MoT) in our own code, and its official checkpoint.

No diffusers or transformers class holds BAGEL, so its generation path is written here from the
architecture: a Qwen2-shaped mixture-of-transformers whose every decoder layer holds an understanding
copy (the Qwen2 names) and a generation copy (the same names ending in `_moe_gen`); a token goes through
the copy of its kind, and all tokens of a sequence share one attention. The prompt's *context* (its
every layer's keys and values, understanding copy) is computed once per prompt; the *velocity* runs the
latent tokens through the generation copy against it. The checkpoint is the official layout
(`llm_config.json`, `ema.safetensors`, the FLUX autoencoder `ae.safetensors`, the tokenizer files); every
key of both files is mapped or listed as skipped on purpose (`SKIPPED_PREFIXES`), any other is an error
naming it.

The sequence, the key table and the exports: omnirl/models/bagel/README.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

from omnirl.errors import ConfigError
from omnirl.weights import safe_open

LLM_CONFIG, WEIGHTS, VAE_WEIGHTS = "llm_config.json", "ema.safetensors", "ae.safetensors"
LATENT_CHANNELS = 16  # the FLUX VAE's latent channels
LATENT_PATCH = 2  # a latent token is a 2x2 patch of latent pixels
# The official app builds BAGEL with max_latent_size 64 (1024 px); the checkpoint's position table says it.
MAX_LATENT_SIZE = 64
# Keys of ema.safetensors that text to image never reads, skipped on purpose: the understanding-only
# SigLIP vision tower, its connector and position table, and the text output head (the context's keys and
# values are all the image reads of the prompt).
SKIPPED_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.", "language_model.lm_head.")
# Our top-level modules that the official checkpoint holds under the same names (the rest of ours lives
# under language_model.model.).
OWN_TOP_LEVEL = ("time_embedder.", "vae2llm.", "llm2vae.")
# diffusers' AutoencoderKL config of the FLUX.1 autoencoder (BAGEL's ae.safetensors).
FLUX_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=LATENT_CHANNELS, norm_num_groups=32, sample_size=1024,
    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip


@dataclass
class BagelConfig:
    """The port's shape: the language model's Qwen2 config and the latent position table's side."""

    llm: Qwen2Config
    max_latent_size: int = MAX_LATENT_SIZE
    qk_norm: bool = True  # llm_config.json's qk_norm: the q/k RMS norms exist (BAGEL-7B-MoT: yes)

    @property
    def head_dim(self) -> int:
        return self.llm.hidden_size // self.llm.num_attention_heads

    @classmethod
    def from_pretrained(cls, path: str | Path, subfolder: str | None = None) -> BagelConfig:
        """Read from an official checkpoint directory: llm_config.json, and the position table's side from
        ema.safetensors' header when the weights are there."""
        path = Path(path, subfolder or "")
        raw = json.loads((path / LLM_CONFIG).read_text())
        llm = Qwen2Config.from_dict(raw)
        side = MAX_LATENT_SIZE
        if (path / WEIGHTS).is_file():
            with safe_open(path / WEIGHTS) as f:
                side = math.isqrt(f.get_slice("latent_pos_embed.pos_embed").get_shape()[0])
        return cls(llm=llm, max_latent_size=side, qk_norm=bool(raw.get("qk_norm", True)))


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """The 2-D sin-cos position table [side * side, dim] of a side x side grid, row-major: the first half of
    each row encodes the column, the second half the row, each half [sin(p w), cos(p w)] over frequencies
    w_i = 10000^(-i / (dim / 4))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")

    def half(p: torch.Tensor) -> torch.Tensor:
        angle = p.reshape(-1, 1).double() * omega
        return torch.cat([angle.sin(), angle.cos()], dim=1)

    return torch.cat([half(cols), half(rows)], dim=1).float()


class TimestepEmbedder(nn.Module):
    """sigma -> [cos(sigma f), sin(sigma f)] over 128 frequencies f_i = 10000^(-i / 128), then an MLP."""

    def __init__(self, hidden: int, frequencies: int = 256):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angle = t.float()[:, None] * freqs[None]
        first = cast(nn.Linear, self.mlp[0])  # (torch types a Sequential's items as any Module)
        return self.mlp(torch.cat([angle.cos(), angle.sin()], dim=-1).to(first.weight.dtype))


def routed(und, gen, x: torch.Tensor, mixed: bool) -> torch.Tensor:
    """`und` of the understanding tokens and `gen` of the generation tokens of x [B, T, ...] along dim 1. In
    a velocity sequence (`mixed`) the first and last tokens are the image marks (understanding) and the
    rest are latents (generation); in a context every token is text."""
    if not mixed:
        return und(x)
    marks = und(torch.cat([x[:, :1], x[:, -1:]], dim=1))
    return torch.cat([marks[:, :1], gen(x[:, 1:-1]), marks[:, 1:]], dim=1)


class MoTAttention(nn.Module):
    """Qwen2 attention (biased q/k/v, unbiased o, grouped KV heads) with q/k RMS norms, in two copies."""

    def __init__(self, config: BagelConfig):
        super().__init__()
        llm, hd = config.llm, config.head_dim
        # (typed optional: Qwen2Config fills num_key_value_heads from num_attention_heads when not given)
        assert llm.num_attention_heads is not None and llm.num_key_value_heads is not None
        heads, kv_heads, hidden = int(llm.num_attention_heads), int(llm.num_key_value_heads), llm.hidden_size
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hd
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(hidden, heads * hd))
            setattr(self, f"k_proj{suffix}", nn.Linear(hidden, kv_heads * hd))
            setattr(self, f"v_proj{suffix}", nn.Linear(hidden, kv_heads * hd))
            setattr(self, f"o_proj{suffix}", nn.Linear(heads * hd, hidden, bias=False))
            for name in ("q_norm", "k_norm"):
                norm = Qwen2RMSNorm(hd, eps=llm.rms_norm_eps) if config.qk_norm else nn.Identity()
                setattr(self, f"{name}{suffix}", norm)

    def forward(self, x, cos, sin, mask, past, mixed: bool, causal: bool):
        """x [B, T, D] -> (output [B, T, D], (k, v) [B, kv_heads, T, hd] of these tokens after RoPE).
        `past` (k, v) [B, kv_heads, L, hd] are attended before them; `mask` [B, 1, T, L + T] bool or None."""
        batch = x.shape[0]

        def heads(proj, norm, n):
            return lambda y: norm(proj(y).view(batch, y.shape[1], n, self.head_dim))

        q = routed(heads(self.q_proj, self.q_norm, self.heads),
                   heads(self.q_proj_moe_gen, self.q_norm_moe_gen, self.heads), x, mixed)  # fmt: skip
        k = routed(heads(self.k_proj, self.k_norm, self.kv_heads),
                   heads(self.k_proj_moe_gen, self.k_norm_moe_gen, self.kv_heads), x, mixed)  # fmt: skip
        identity = nn.Identity()
        v = routed(heads(self.v_proj, identity, self.kv_heads),
                   heads(self.v_proj_moe_gen, identity, self.kv_heads), x, mixed)  # fmt: skip
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        new = (k, v.contiguous()) if past is None else (None, None)  # a context's own keys and values
        if past is not None:
            k, v = torch.cat([past[0].to(k.dtype), k], dim=2), torch.cat([past[1].to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(batch, x.shape[1], -1)
        return routed(self.o_proj, self.o_proj_moe_gen, out, mixed), new


class MoTLayer(nn.Module):
    """A Qwen2 decoder layer with the generation copy of everything (`Qwen2MoTDecoderLayer`)."""

    # The norms `__init__` sets by name, each with its generation copy.
    input_layernorm: Qwen2RMSNorm
    input_layernorm_moe_gen: Qwen2RMSNorm
    post_attention_layernorm: Qwen2RMSNorm
    post_attention_layernorm_moe_gen: Qwen2RMSNorm

    def __init__(self, config: BagelConfig):
        super().__init__()
        llm = config.llm
        self.self_attn = MoTAttention(config)
        self.mlp, self.mlp_moe_gen = Qwen2MLP(llm), Qwen2MLP(llm)
        for name in ("input_layernorm", "post_attention_layernorm"):
            for suffix in ("", "_moe_gen"):
                setattr(self, name + suffix, Qwen2RMSNorm(llm.hidden_size, eps=llm.rms_norm_eps))

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None, mixed=False, causal=False):
        """x [B, T, D] -> (x', k, v): the layer's output and its keys and values [B, kv_heads, T, hd]."""
        past = None if past_k is None else (past_k, past_v)
        h = routed(self.input_layernorm, self.input_layernorm_moe_gen, x, mixed)
        attn, (k, v) = self.self_attn(h, cos, sin, mask, past, mixed, causal)
        x = x + attn
        und = lambda y: self.mlp(self.post_attention_layernorm(y))  # noqa: E731
        gen = lambda y: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(y))  # noqa: E731
        return x + routed(und, gen, x, mixed), k, v


class BagelModel(nn.Module):
    """BAGEL's text-to-image path: `forward(mode="context", ...)` and `forward(mode="velocity", ...)`
    (one `forward`, so that FSDP2's hooks see both). Every layer is an FSDP unit (`layers`)."""

    config_class = BagelConfig
    latent_pos_embed: torch.Tensor  # a buffer

    def __init__(self, config: BagelConfig):
        super().__init__()
        llm = config.llm
        self.config = config
        hidden = llm.hidden_size
        self.embed_tokens = nn.Embedding(llm.vocab_size, hidden)
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(llm.num_hidden_layers))
        self.norm = Qwen2RMSNorm(hidden, eps=llm.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(hidden, eps=llm.rms_norm_eps)
        self.time_embedder = TimestepEmbedder(hidden)
        patch = LATENT_PATCH**2 * LATENT_CHANNELS
        self.vae2llm, self.llm2vae = nn.Linear(patch, hidden), nn.Linear(hidden, patch)
        self.register_buffer("latent_pos_embed", sincos_2d(hidden, config.max_latent_size))
        # RoPE per device, made at first use and not a submodule: its inverse frequencies stay float32
        # whatever dtype the model is cast to, and a model built on the meta device has none to restore.
        self.rope: dict[str, Qwen2RotaryEmbedding] = {}
        self.gradient_checkpointing = False

    @classmethod
    def _from_config(cls, config: BagelConfig, **_) -> BagelModel:
        """Built from its config, random weights (as transformers' classes: what a meta build and
        random_init's loader call; the dtype is the default one they set)."""
        return cls(config)

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict:
        """No tensor is kept in another dtype than the model's (random_init reads it as transformers')."""
        return {}

    @classmethod
    def from_pretrained(cls, path: str | Path, torch_dtype: torch.dtype = torch.float32) -> BagelModel:
        """The model of an official checkpoint directory (`load_official`), in `torch_dtype`."""
        with torch.device("meta"):
            model = cls(BagelConfig.from_pretrained(path))
        model.load_state_dict(load_official(Path(path) / WEIGHTS, model, torch_dtype), assign=True)
        return model.eval()

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, hd] of RoPE positions [B, T], in x's dtype."""
        key = str(x.device)
        if key not in self.rope:
            self.rope[key] = Qwen2RotaryEmbedding(self.config.llm).to(x.device)
        return self.rope[key](x, positions)

    def run_layers(self, x, cos, sin, mask, context=None, mixed=False, causal=False):
        """x through every layer; returns x and each layer's keys and values [B, layers, 2, kv, T, hd]."""
        kvs = []
        for i, layer in enumerate(self.layers):
            past = (None, None) if context is None else (context[:, i, 0], context[:, i, 1])
            args = (x, cos, sin, mask, *past, mixed, causal)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, k, v = checkpoint(layer, *args, use_reentrant=False)
            else:
                x, k, v = layer(*args)
            if context is None:
                kvs.append(torch.stack([k, v], dim=1))
        return x, kvs

    def forward(self, mode: str, **inputs) -> torch.Tensor:
        if mode == "context":
            return self.context(**inputs)
        if mode == "velocity":
            return self.velocity(**inputs)
        raise ValueError(f"mode must be 'context' or 'velocity', got {mode!r}")

    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Prompts [B, L] (right-padded, `attention_mask` [B, L] bool) through the understanding copy,
        causal: every layer's keys and values [B, layers, 2, kv_heads, L, hd]."""
        x = self.embed_tokens(input_ids)
        batch, length = input_ids.shape
        positions = torch.arange(length, device=x.device).expand(batch, length)
        cos, sin = self.rotary(x, positions)
        mask = None
        if not attention_mask.all():
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            mask = (causal[None] & attention_mask[:, None, :])[:, None]  # [B, 1, L, L]
        _, kvs = self.run_layers(x, cos, sin, mask, causal=True)
        return torch.stack(kvs, dim=1)

    def velocity(
        self,
        tokens: torch.Tensor,
        sigma: torch.Tensor,
        position_ids: torch.Tensor,
        marks: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        """The velocity [B, S, 64] of latent tokens [B, S, 64] at sigma [B], their patches' position ids
        [S], after the image marks' token ids `marks` [2], attending to the context's keys and values
        [B, layers, 2, kv_heads, L, hd] (right-padded, `context_mask` [B, L] bool; L may be 0)."""
        batch, length = tokens.shape[0], tokens.shape[1] + 2
        dtype = self.vae2llm.weight.dtype
        latents = self.vae2llm(tokens.to(dtype)) + self.time_embedder(sigma)[:, None]
        latents = latents + self.latent_pos_embed[position_ids].to(dtype)
        ends = self.embed_tokens(marks).expand(batch, 2, -1)
        x = torch.cat([ends[:, :1], latents, ends[:, 1:]], dim=1)
        # Every query token sits at the RoPE position after its own context.
        positions = context_mask.sum(dim=1, keepdim=True).expand(batch, length)
        cos, sin = self.rotary(x, positions)
        mask = None
        if not context_mask.all():
            keys = torch.cat([context_mask, context_mask.new_ones(batch, length)], dim=1)
            mask = keys[:, None, None, :]  # [B, 1, 1, L + T], broadcast over heads and queries
        x, _ = self.run_layers(x, cos, sin, mask, context=context, mixed=True)
        # A copy: FSDP2 warns of a unit's output that is a view (a linear's of a 3-D input).
        return self.llm2vae(self.norm_moe_gen(x[:, 1:-1])).clone()


def official_name(name: str) -> str:
    """The official checkpoint's key of one of our parameter or buffer names."""
    if name == "latent_pos_embed":
        return "latent_pos_embed.pos_embed"
    if name.startswith(OWN_TOP_LEVEL):
        return name
    return f"language_model.model.{name}"


def load_official(path: Path, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`model`'s state dict from the official `ema.safetensors` at `path`, in `dtype`: every key is one
    of ours (`official_name`) or starts with one of `SKIPPED_PREFIXES`; an other key, or one of ours the
    file lacks, is a ConfigError naming it."""
    ours = {official_name(k): k for k in model.state_dict()}
    state = {}
    with safe_open(path) as f:
        for key in f.keys():
            if key.startswith(SKIPPED_PREFIXES):
                continue
            if key not in ours:
                raise ConfigError(f"{path}: the key {key} maps to no part of BAGEL's text-to-image path")
            state[ours[key]] = f.get_tensor(key).to(dtype)
    missing = sorted(k for k, name in ours.items() if name not in state)
    if missing:
        raise ConfigError(f"{path}: the checkpoint lacks {missing[0]} ({len(missing)} keys missing)")
    return state


def vae_config(source: dict[str, torch.Tensor]) -> dict:
    """The `AutoencoderKL` config of BFL-layout autoencoder weights: FLUX's (`FLUX_VAE`), with the block
    widths and depth those weights have (the official layout stores no config; a smaller autoencoder of
    the same kind, the tiny test model's, differs only there)."""
    downs = sorted({int(k.split(".")[2]) for k in source if k.startswith("encoder.down.")})
    widths = tuple(source[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in downs)
    depth = len({k.split(".")[4] for k in source if k.startswith("encoder.down.0.block.")})
    return {
        **FLUX_VAE, "down_block_types": ("DownEncoderBlock2D",) * len(downs),
        "up_block_types": ("UpDecoderBlock2D",) * len(downs), "block_out_channels": widths,
        "layers_per_block": depth,
    }  # fmt: skip


def load_vae(path: str | Path, dtype: torch.dtype) -> AutoencoderKL:
    """The FLUX autoencoder of `ae.safetensors` (Black Forest Labs' layout) as diffusers' `AutoencoderKL`,
    converted by diffusers' `convert_ldm_vae_checkpoint`; a key the conversion leaves unread, or one the
    model lacks, is a ConfigError naming it."""
    path = Path(path)
    with safe_open(path) as f:
        source = {k: f.get_tensor(k) for k in f.keys()}
    vae = AutoencoderKL(**vae_config(source))
    converted = convert_ldm_vae_checkpoint(source, vae.config)
    # The conversion drops keys it does not know and renames some it should not: a key is read when its
    # tensor (the same storage; reshaped at most) lands on a parameter of the model.
    wanted = vae.state_dict()
    read = {t.untyped_storage().data_ptr() for k, t in converted.items() if k in wanted}
    unread = sorted(k for k, t in source.items() if t.untyped_storage().data_ptr() not in read)
    if unread:
        raise ConfigError(f"{path}: the key {unread[0]} maps to no part of the FLUX autoencoder")
    missing = sorted(set(wanted) - set(converted))
    if missing:
        raise ConfigError(f"{path}: the autoencoder lacks {missing[0]} ({len(missing)} keys missing)")
    vae.load_state_dict({k: v for k, v in converted.items() if k in wanted}, strict=True)
    for p in vae.parameters():  # (AutoencoderKL.to(dtype) warns about fp32 modules it has none of)
        p.data = p.data.to(dtype)
    return vae.eval()


def bfl_vae_state(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """`vae`'s weights in Black Forest Labs' layout (what `ae.safetensors` holds), the inverse of diffusers'
    conversion: for writing checkpoints in the official layout (the tiny model's, a merged export's)."""
    ups = len(vae.config["up_block_types"])
    rules = [
        (r"\.down_blocks\.(\d+)\.resnets\.", r".down.\1.block."),
        (r"\.down_blocks\.(\d+)\.downsamplers\.0\.", r".down.\1.downsample."),
        (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
        (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
        (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
        (r"\.mid_block\.attentions\.0\.to_q\.", ".mid.attn_1.q."),
        (r"\.mid_block\.attentions\.0\.to_k\.", ".mid.attn_1.k."),
        (r"\.mid_block\.attentions\.0\.to_v\.", ".mid.attn_1.v."),
        (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
        (r"\.conv_shortcut\.", ".nin_shortcut."),
        (r"\.conv_norm_out\.", ".norm_out."),
    ]
    out = {}
    for key, t in vae.state_dict().items():
        name = key
        up = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.(.*)", key)
        if up:
            part = "block" if up.group(2) == "resnets" else "upsample"
            name = f"decoder.up.{ups - 1 - int(up.group(1))}.{part}.{up.group(3)}"
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        if ".attn_1." in name and name.endswith("weight") and t.dim() == 2:
            t = t[:, :, None, None]  # the attention's projections are 1x1 convolutions there
        out[name] = t.contiguous()
    return out


def save_official(
    model: BagelModel,
    vae: AutoencoderKL,
    out_dir: str | Path,
    dtype: torch.dtype,
    skipped: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write `model` (or its state dict `state`) and `vae` in the official layout under `out_dir`:
    llm_config.json, ema.safetensors in `dtype` (with the understanding-only tensors `skipped`, keys under
    `SKIPPED_PREFIXES`, as they were) and ae.safetensors. The tokenizer files are the caller's."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llm = model.config.llm.to_dict()
    llm["qk_norm"] = model.config.qk_norm
    (out / LLM_CONFIG).write_text(json.dumps(llm, indent=2) + "\n")
    state = model.state_dict() if state is None else state
    tensors = {official_name(k): v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file({**tensors, **skipped}, out / WEIGHTS, metadata={"format": "pt"})
    save_file(bfl_vae_state(vae), out / VAE_WEIGHTS, metadata={"format": "pt"})
