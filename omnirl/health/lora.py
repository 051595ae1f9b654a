"""The LoRA proof: what the LoRA bound, counted where it matters, and whether an update reaches the rollout.

- `census`: the peft LoRA layers of the policy, counted per expert (Wan 2.2 A14B's `transformer` and
  `transformer_2`), per stream (LTX-2's video and audio; the cross-attention between them counted apart)
  and per copy (BAGEL's generation copy, `*_moe_gen`, against its understanding copy), and per target of
  `lora.target_modules` (peft's suffix match).
- `check_census`: a target that matches no LoRA layer, or an expert, stream or copy left without one, is a
  `ConfigError` (one `error:` line, exit status 2) before the first step. peft itself refuses only a
  target list that binds nothing at all: one dropped target among several passes it silently.
- `fingerprint`: a few numbers of the LoRA's effective update (sum of |B A| entries per layer group) of
  the module the rollout runs, taken before and after the first optimizer step: unchanged, the rollout
  would sample from the same policy for the whole run.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from omnirl.config import Config
from omnirl.errors import ConfigError


def lora_layers(module: nn.Module) -> dict[str, LoraLayer]:
    """Qualified name -> peft LoRA layer of `module` (the layers that hold an adapter)."""
    return {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer) and m.lora_A}


def stream_of(adapter: str, name: str) -> str | None:
    """The stream (LTX-2) or copy (BAGEL) a LoRA layer belongs to; None for a family without either."""
    parts = name.split(".")
    if adapter == "ltx2":
        if any(p.startswith(("audio_to_video", "video_to_audio")) for p in parts):
            return "cross"
        return "audio" if any(p.startswith("audio_") for p in parts) else "video"
    if adapter == "bagel":
        return "generation" if "_moe_gen" in name else "understanding"
    return None


# The streams and copies that must each hold LoRA layers, per family.
REQUIRED_STREAMS = {"ltx2": ("video", "audio"), "bagel": ("generation",)}


def matches(target: str, name: str) -> bool:
    """peft's suffix match of a `target_modules` entry against a module's qualified name."""
    return name == target or name.endswith("." + target)


def census(cfg: Config, trained: dict[str, nn.Module]) -> dict[str, Any]:
    """The LoRA layers of the trained components `trained` (the adapter's `trained_modules()`): counts per
    component ('experts'), per stream or copy ('streams'), per target ('targets') and in all ('total')."""
    adapter = cfg.model.adapter
    experts: dict[str, int] = {}
    streams: dict[str, int] = {s: 0 for s in REQUIRED_STREAMS.get(adapter, ())}
    targets = {t: 0 for t in cfg.lora.target_modules}
    for component, module in trained.items():
        names = list(lora_layers(module))
        experts[component] = len(names)
        for n in names:
            if (s := stream_of(adapter, n)) is not None:
                streams[s] = streams.get(s, 0) + 1
            for t in targets:
                targets[t] += matches(t, n) or matches(t, f"{component}.{n}")
    return {"experts": experts, "streams": streams, "targets": targets, "total": sum(experts.values())}


def check_census(cfg: Config, counts: dict[str, Any]) -> None:
    """A ConfigError naming the first target that bound nothing, or the expert / stream left without LoRA."""
    unbound = [t for t, n in counts["targets"].items() if n == 0]
    if unbound and counts["total"]:
        raise ConfigError(
            f"lora.target_modules: {unbound[0]!r} matches no module of model.adapter {cfg.model.adapter!r} "
            f"(the others bind {counts['total']} layers): a LoRA without it trains less than the recipe "
            "names; fix or remove the entry"
        )
    if not counts["total"]:
        raise ConfigError(
            f"lora.target_modules {cfg.lora.target_modules} bind no module of model.adapter "
            f"{cfg.model.adapter!r}: the run would train nothing"
        )
    experts = counts["experts"]
    if len(experts) > 1 and (empty := [e for e, n in experts.items() if n == 0]):
        raise ConfigError(
            f"lora.target_modules {cfg.lora.target_modules} bind no module of the expert {empty[0]!r} "
            f"(LoRA layers per expert: {experts}): it would sample its noise range untrained"
        )
    required = REQUIRED_STREAMS.get(cfg.model.adapter, ())
    if empty := [s for s in required if counts["streams"].get(s, 0) == 0]:
        raise ConfigError(
            f"lora.target_modules {cfg.lora.target_modules} bind no module of the {empty[0]} "
            f"{'copy' if cfg.model.adapter == 'bagel' else 'stream'} (LoRA layers per stream: "
            f"{counts['streams']}): name its modules too"
        )


def describe(counts: dict[str, Any]) -> str:
    """The census as one line for the log."""
    parts = [f"{counts['total']} LoRA layers"]
    if len(counts["experts"]) > 1:
        parts.append("per expert " + ", ".join(f"{k} {v}" for k, v in counts["experts"].items()))
    if counts["streams"]:
        parts.append("per stream " + ", ".join(f"{k} {v}" for k, v in counts["streams"].items()))
    parts.append("per target " + ", ".join(f"{k} {v}" for k, v in counts["targets"].items()))
    return "; ".join(parts)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


@torch.no_grad()
def fingerprint(trained: dict[str, nn.Module], full: bool) -> dict[str, float]:
    """Per trained component: the sum of |B A| (LoRA: the effective weight change of every layer) or of
    the trained parameters' values (full fine-tune), in float64. Collective under FSDP2 (every rank calls
    it): sharded tensors are gathered one at a time."""
    out: dict[str, float] = {}
    for component, module in trained.items():
        total = 0.0
        if full:
            for p in module.parameters():
                if p.requires_grad:
                    total += float(_full(p).double().abs().sum())
        else:
            for layer in lora_layers(module).values():
                for name in layer.lora_A:
                    a = _full(cast(torch.Tensor, layer.lora_A[name].weight)).double()
                    b = _full(cast(torch.Tensor, layer.lora_B[name].weight)).double()
                    if a.dim() == 2:
                        total += float((b @ a).abs().sum())
                    else:  # a convolution's LoRA: the sizes of both factors
                        total += float(b.abs().sum() * a.abs().sum())
        out[component] = total
    return out
