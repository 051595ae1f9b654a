"""Making a diffusers transformer trainable: a peft LoRA over a frozen base, or the whole model.

Shared by the diffusion adapters (each loads its own transformer class, then calls this).
"""

from __future__ import annotations

import peft
import torch
from diffusers.training_utils import cast_training_params
from torch import nn

from omnirl.config import Config


def make_trainable(transformer: nn.Module, cfg: Config, device: torch.device) -> None:
    """LoRA from `cfg.lora` when `model.finetune` is "lora" (base frozen; the adapter in float32 even over
    a bf16 base, since the optimizer updates it), else every weight trainable; then gradient
    checkpointing from `model.gradient_checkpointing`, and onto `device`."""
    if cfg.model.finetune == "lora":
        transformer.requires_grad_(False)
        transformer.add_adapter(
            peft.LoraConfig(
                r=cfg.lora.rank,
                lora_alpha=cfg.lora.alpha,
                target_modules=cfg.lora.target_modules,
                init_lora_weights=True if cfg.lora.init == "default" else "gaussian",
                lora_dropout=cfg.lora.dropout,
            )
        )
        cast_training_params(transformer, torch.float32)
    else:
        transformer.requires_grad_(True)
    if cfg.model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.to(device)
