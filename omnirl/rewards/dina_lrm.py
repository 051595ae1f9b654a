"""DiNa-LRM (diffusion-native latent reward model, HKUST-C4G/diffusion-rm) in-process on SD3.5: it scores
a sample's clean latents with the first blocks of SD3.5-Medium's own MM-DiT under a LoRA of its own, and a
small head, so no image is decoded and no second prompt encoding runs.

`DinaLRM` is the reward (`reward.paths.dina_lrm`: the published repository as downloaded); with a LoRA
policy it runs the policy's own blocks under a second peft adapter, with full fine-tuning a frozen copy
of them; `RewardHead` is the published head. It scores in the trainer's thread after the rollout, every
rank at once.

How it works: docs/rewards.md#dina-lrm
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import peft
import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from torch.distributed.fsdp import FSDPModule

from omnirl import distributed as D
from omnirl import fsdp
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.models.base import Latent
from omnirl.models.peft_lora import adapter_active
from omnirl.weights import load_safetensors, torch_load

if TYPE_CHECKING:
    from omnirl.models.sd3.adapter import SD3Adapter

CONFIG, LORA_DIR, HEAD = "config.json", "checkpoint/backbone_lora", "checkpoint/rm_head.pt"
LORA_FILE = "adapter_model.safetensors"
ADAPTER = "dina_lrm"  # the reward's peft adapter in the policy
NOISE_U = 0.4  # the re-noising level the published recipe scores at
NOISE_STREAM = -7  # derive_seed's step slot of the reward's noise: apart from the rollout's own draws
PREFIX = "base_model.model."  # peft's prefix of the saved adapter's keys


class FiLMAdapter(nn.Module):
    """One block's tokens projected and modulated by the timestep embedding (the reference's FiLM layer
    adapter; parameter names kept, so rm_head.pt loads as it is)."""

    def __init__(self, in_dim: int, emb_dim: int, hidden: int, out_dim: int, use_proj_in: bool):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, hidden) if in_dim != hidden or use_proj_in else nn.Identity()
        self.layer_embed = nn.Parameter(torch.zeros(1, 1, hidden))
        self.cond_mlp = nn.Sequential(
            nn.Linear(emb_dim, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, 2 * hidden)
        )
        self.proj = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.cond_mlp(t_emb)[:, None].chunk(2, dim=-1)  # [B, 1, hidden] each
        return self.proj(self.proj_in(x) * (1 + gamma) + beta + self.layer_embed)  # [B, N, out_dim]


class CrossAttention(nn.Module):
    """Queries attending to visual tokens and, when `text`, to text tokens in a second attention whose
    output is added; a token-wise sigmoid gate on the values when `gated` (the reference's block)."""

    def __init__(self, dim: int, heads: int, text: bool, gated: bool):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_v = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.norm_t = nn.RMSNorm(dim) if text else None
        self.to_q, self.to_k_vis, self.to_v_vis = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
        )
        self.to_k_text = nn.Linear(dim, dim) if text else None
        self.to_v_text = nn.Linear(dim, dim) if text else None
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))
        gate = lambda: nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))  # noqa: E731
        self.gate_vis = gate() if gated else None
        self.gate_text = gate() if gated and text else None

    def attend(self, q, k, v) -> torch.Tensor:
        split = lambda x: x.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731  [B, H, L, d]
        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(2)

    def context(self, tokens, norm, to_k, to_v, gate) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = norm(tokens)
        v = to_v(tokens)
        return to_k(tokens), v if gate is None else v * torch.sigmoid(gate(tokens))

    def forward(self, queries, visual, text=None) -> torch.Tensor:
        q = self.to_q(self.norm_q(queries))
        out = self.attend(q, *self.context(visual, self.norm_v, self.to_k_vis, self.to_v_vis, self.gate_vis))
        if self.norm_t is not None and text is not None:
            ctx = self.context(text, self.norm_t, self.to_k_text, self.to_v_text, self.gate_text)
            out = out + self.attend(q, *ctx)
        return queries + self.to_out(out)


class RewardHead(nn.Module):
    """DiNa-LRM's head: per-block FiLM adapters, learned queries cross-attending to visual and text tokens,
    then to visual tokens alone, a feed-forward residual, one output per query averaged (the reference's
    RewardHead with its defaults: width = the transformer's, no input projection)."""

    def __init__(self, dim: int, n_visual: int, n_text: int, options: dict[str, Any]):
        """`options`: the config's `reward_head` (width -1: the transformer's; num_queries, num_attn_heads,
        use_proj_in, out_dim)."""
        super().__init__()
        width = dim if options.get("width", -1) == -1 else options["width"]
        out, use_proj_in = width // 4, options.get("use_proj_in", False)
        num_queries, heads = options.get("num_queries", 4), options.get("num_attn_heads", 8)
        self.layer_adapters_visual = nn.ModuleList(
            FiLMAdapter(dim, dim, width, out, use_proj_in) for _ in range(n_visual)
        )
        self.layer_adapters_text = nn.ModuleList(
            FiLMAdapter(dim, dim, width, out, use_proj_in) for _ in range(n_text)
        )
        self.agg_visual = nn.Linear(n_visual * out, width)
        self.agg_text = nn.Linear(n_text * out, width) if n_text else None
        self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, width))
        self.attn1 = CrossAttention(width, heads, text=n_text > 0, gated=True)
        self.attn2 = CrossAttention(width, heads, text=False, gated=False)
        self.norm_ff = nn.RMSNorm(width)
        self.ff = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.0)
        )
        self.head = nn.Linear(width, options.get("out_dim", 1))

    def forward(
        self, visual: list[torch.Tensor], text: list[torch.Tensor], t_emb: torch.Tensor
    ) -> torch.Tensor:
        """[B, out] of the tokens [B, N, dim] after each configured block and the timestep embedding
        [B, dim]."""
        vis = self.agg_visual(
            torch.cat([a(x, t_emb) for a, x in zip(self.layer_adapters_visual, visual)], -1)
        )
        txt = None
        if self.agg_text is not None:
            txt = self.agg_text(torch.cat([a(x, t_emb) for a, x in zip(self.layer_adapters_text, text)], -1))
        queries = self.query_tokens.expand(len(vis), -1, -1)
        queries = self.attn2(self.attn1(queries, vis, txt), vis)
        queries = queries + self.ff(self.norm_ff(queries))
        return self.head(queries).mean(dim=1)


class Backbone(nn.Module):
    """A frozen copy of the transformer's embedders and first `n` blocks (full fine-tuning: the policy's
    own blocks change as it trains)."""

    def __init__(self, transformer: nn.Module, n: int):
        super().__init__()
        self.pos_embed = copy.deepcopy(transformer.pos_embed)
        self.time_text_embed = copy.deepcopy(transformer.time_text_embed)
        self.context_embedder = copy.deepcopy(transformer.context_embedder)
        blocks = transformer.transformer_blocks
        assert isinstance(blocks, nn.ModuleList), type(blocks)
        self.transformer_blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks[:n])


def read_config(path: Path) -> dict[str, Any]:
    """The `model` section of the checkpoint's config.json, checked for what this port runs."""
    model = json.loads((path / CONFIG).read_text())["model"]
    if not model.get("use_lora", False) or model.get("freeze_backbone", False):
        raise ConfigError(f"{path / CONFIG}: only the backbone-LoRA layout (use_lora true) is supported")
    if model.get("use_logistic", False):
        raise ConfigError(
            f"{path / CONFIG}: use_logistic true is not supported (the published model has false)"
        )
    return model


def lora_modules(
    path: Path, transformer: nn.Module, n: int
) -> tuple[peft.LoraConfig, dict[str, torch.Tensor]]:
    """The saved adapter's config and tensors by the policy's module name, after checking that its keys are
    exactly the LoRA pairs of the modules its config targets in the first `n` blocks."""
    config = peft.LoraConfig.from_pretrained(str(path / LORA_DIR))
    assert isinstance(config, peft.LoraConfig)  # LoraConfig.from_pretrained builds its own class
    assert isinstance(config, peft.LoraConfig)
    if config.use_dora or config.use_rslora:
        raise ConfigError(f"{path / LORA_DIR}: a DoRA / rsLoRA adapter is not supported")
    first = re.compile(r"transformer_blocks\.(\d+)\.")
    targets = [
        name
        for name, module in transformer.named_modules()
        if isinstance(module, (nn.Linear, LoraLayer))
        and ".lora_" not in name
        and not name.endswith(".base_layer")
        and (m := first.match(name)) is not None
        and int(m.group(1)) < n
        and check_target_module_exists(config, name)
    ]
    expected = {f"{PREFIX}{name}.lora_{ab}.weight" for name in targets for ab in "AB"}
    state = load_safetensors(path / LORA_DIR / LORA_FILE)
    check_keys(path / LORA_DIR / LORA_FILE, set(state), expected)
    return config, {k.removeprefix(PREFIX): v for k, v in state.items()}


def check_keys(file: Path, found: set[str], expected: set[str]) -> None:
    """Every key of `file` is one the model has and none is missing, else one ConfigError naming a key."""
    for keys, what in (
        (sorted(expected - found), "missing key"),
        (sorted(found - expected), "unexpected key"),
    ):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise ConfigError(f"{file}: {what} {keys[0]!r}{more}")


class DinaLRM:
    modality = "latent"
    batch_size = 8  # samples per forward

    def __init__(self, path: str | None, adapter: SD3Adapter, cfg: Any):
        """`adapter`: the run's SD3 adapter, read through its declared members (`transformer`, `scheduler`,
        `policy`, `lora`, `transformer_dtype`, `vae_scale_factor`, `max_sequence_length`, `device`)."""
        root = Path(path) if path is not None else None
        missing = [
            f for f in (CONFIG, f"{LORA_DIR}/{LORA_FILE}", HEAD) if root is None or not (root / f).is_file()
        ]
        if missing:
            raise ConfigError(
                "reward dina_lrm needs reward.paths.dina_lrm: the DiNa-LRM model directory (config.json, "
                f"checkpoint/backbone_lora/, checkpoint/rm_head.pt); {path!r} lacks {missing[0]}"
            )
        assert root is not None
        if cfg.model.adapter != "sd3":
            raise ConfigError(f"reward dina_lrm scores SD3.5 latents: model.adapter is {cfg.model.adapter!r}")
        self.adapter, self.sampling = adapter, cfg.sampling
        self.per_unit = cfg.distributed.rollout_gather == "unit"
        model = read_config(root)
        self.n = int(model["num_transformer_layers"])
        self.visual_idx, self.text_idx = list(model["visual_head_idx"]), list(model["text_head_idx"])
        transformer = adapter.transformer
        if not max(self.visual_idx + self.text_idx) <= self.n <= len(transformer.transformer_blocks) - 1:
            raise ConfigError(
                f"{root / CONFIG}: head blocks {self.visual_idx}, {self.text_idx} of {self.n} do not fit"
            )

        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        head = RewardHead(dim, len(self.visual_idx), len(self.text_idx), model.get("reward_head", {}))
        state = torch_load(root / HEAD)
        check_keys(root / HEAD, set(state), set(head.state_dict()))
        head.load_state_dict(state)
        self.head = head.float().eval().requires_grad_(False).to(adapter.device)  # small: kept in float32

        # With a LoRA policy the base is frozen and the reward's LoRA goes into it; else into a frozen copy.
        self.copy = None if adapter.lora else Backbone(transformer, self.n).requires_grad_(False)
        target = transformer if self.copy is None else self.copy
        config, lora = lora_modules(root, target, self.n)
        trainable = {name: p.requires_grad for name, p in target.named_parameters()}
        active = {name: m.active_adapters for name, m in target.named_modules() if isinstance(m, LoraLayer)}
        injected = peft.LoraConfig(
            r=config.r,
            lora_alpha=config.lora_alpha,
            target_modules=sorted({k.rsplit(".lora_", 1)[0] for k in lora}),
            lora_dropout=0.0,
        )
        with warnings.catch_warnings():  # peft warns that the model has an adapter already: the policy's
            warnings.simplefilter("ignore", UserWarning)
            peft.inject_adapter_in_model(injected, target, adapter_name=ADAPTER)
        params = dict(target.named_parameters())
        with torch.no_grad():
            for (
                key,
                value,
            ) in lora.items():  # transformer_blocks.0.attn.to_q.lora_A.weight -> ...lora_A.dina_lrm.weight
                param = params[key.replace(".weight", f".{ADAPTER}.weight")]
                param.copy_(value.to(param.dtype)).requires_grad_(False)
        # peft activates a new adapter and makes it trainable: the policy's layers are put back as they were
        for name, module in target.named_modules():
            if isinstance(module, LoraLayer):
                module._active_adapter = active.get(name, [])
        for name, p in target.named_parameters():
            p.requires_grad_(trainable.get(name.replace(".base_layer", ""), False) and ADAPTER not in name)
        if self.copy is not None:
            self.copy.to(adapter.device, dtype=fsdp.DTYPES[cfg.model.dtype])

        # (from_config is typed as maybe a tuple: with return_unused_kwargs)
        scheduler = cast(Any, FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config))
        sigmas, timesteps = scheduler.sigmas, scheduler.timesteps  # set by the scheduler's constructor
        assert sigmas is not None and timesteps is not None
        at = int((torch.as_tensor(sigmas) - NOISE_U).abs().argmin())
        self.sigma, self.timestep = float(sigmas[at]), float(timesteps[at])

    def modules_and_dtype(self) -> tuple[nn.Module, torch.dtype]:
        """The module that holds the embedders and blocks the reward runs, and its compute dtype."""
        if self.copy is not None:
            return self.copy, next(self.copy.parameters()).dtype
        policy = self.adapter.policy
        return policy, fsdp.compute_dtype(policy, self.adapter.transformer_dtype)

    @torch.no_grad()
    def raw_scores(self, latents: list[Latent]) -> torch.Tensor:
        """The head's output [B] float32 for samples on the host (one forward; no gathering done here)."""
        module, dtype = self.modules_and_dtype()
        owner: Any = module  # SD3's transformer (or the reward's copy): its parts are read by name
        device = self.adapter.device
        x0 = torch.stack([s.latents for s in latents]).float()  # [B, C, h, w]
        gens = [torch.Generator().manual_seed(derive_seed(s.seed, NOISE_STREAM, 0)) for s in latents]
        noise = torch.stack([torch.randn(s.latents.shape, generator=g) for s, g in zip(latents, gens)])
        x = ((1 - self.sigma) * x0 + self.sigma * noise).to(device, dtype)
        text = torch.stack([s.embeds["prompt_embeds"] for s in latents]).to(device, dtype)  # [B, 77 + L, D]
        pooled = torch.stack([s.embeds["pooled_prompt_embeds"] for s in latents]).to(device, dtype)  # [B, P]
        timestep = torch.full((len(latents),), self.timestep, device=device)
        all_blocks = owner.transformer_blocks
        assert isinstance(all_blocks, nn.ModuleList), type(all_blocks)
        blocks = list(all_blocks[: self.n])
        with adapter_active(blocks, ADAPTER):
            hidden = owner.pos_embed(x)  # [B, N, dim]
            temb = owner.time_text_embed(timestep, pooled)  # [B, dim]; float32 timesteps, as the pipeline
            context = owner.context_embedder(text)  # [B, 77 + L, dim]
            visual = [hidden] if 0 in self.visual_idx else []
            texts = [context] if 0 in self.text_idx else []
            for i, block in enumerate(blocks, start=1):
                context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
                visual += [hidden] if i in self.visual_idx else []
                texts += [context] if i in self.text_idx else []
        f32 = lambda xs: [t.float() for t in xs]  # noqa: E731
        return self.head(f32(visual), f32(texts), temb.float())[:, 0].cpu()

    def __call__(
        self, latents: list[Latent], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        chunks = [latents[s : s + self.batch_size] for s in range(0, len(latents), self.batch_size)]
        if self.per_unit:  # each block's forward is a collective: every rank runs as many
            n = torch.tensor([len(chunks)])
            D.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
            chunks += [[self.dummy()] for _ in range(int(n) - len(chunks))]
        scores = []
        with self.weights():
            for chunk in chunks:
                scores.append(self.raw_scores(chunk))
        raw = torch.cat(scores)[: len(latents)] if scores else torch.zeros(0)
        return ((raw + 10) / 10).tolist()  # the published normalisation, raw x 0.1 + 1

    @contextlib.contextmanager
    def weights(self):
        """The policy's weights gathered as the rollout gathers them (its own copy needs nothing)."""
        policy = self.adapter.policy
        if self.copy is not None:
            yield
            return
        with fsdp.gathered_weights(policy, per_unit=self.per_unit), root_gathered(policy, self.per_unit):
            yield

    def dummy(self) -> Latent:
        """A padding sample of the recipe's shapes (its score is dropped)."""
        a, t = self.adapter, self.adapter.transformer.config
        s = self.sampling
        shape = (t.in_channels, s.height // a.vae_scale_factor, s.width // a.vae_scale_factor)
        embeds = {
            "prompt_embeds": torch.zeros(77 + a.max_sequence_length, t.joint_attention_dim),
            "pooled_prompt_embeds": torch.zeros(t.pooled_projection_dim),
        }
        return Latent(torch.zeros(shape), embeds, 0)


@contextlib.contextmanager
def root_gathered(policy: nn.Module, gather: bool):
    """The root unit's own parameters (the embedders) gathered, when the rollout gathers one unit per
    forward: the reward calls the embedders directly, outside the root's forward that would gather them."""
    if not gather or not isinstance(policy, FSDPModule):
        yield
        return
    policy.unshard()
    try:
        yield
    finally:
        policy.reshard()
