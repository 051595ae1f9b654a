"""What every diffusion adapter does the same way around its own classes: checking that model.path holds
the family's pipeline, making its transformer trainable (a peft LoRA over a frozen base, or the whole
model), and writing its LoRA in the family's diffusers format.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch
from diffusers.training_utils import cast_training_params
from torch import nn

from omnirl.config import Config, ConfigError
from omnirl.distributed import place_policy
from omnirl.models.peft_lora import sorted_sets


def check_checkpoint(path: str, pipeline_cls) -> None:
    """`path` (a local directory or a hub id) holds a `pipeline_cls` checkpoint, else a ConfigError."""
    try:
        index = pipeline_cls.load_config(path)
    except OSError as e:
        raise ConfigError(
            f"model.path {path!r} is neither a local diffusers checkpoint (a directory with "
            f"model_index.json) nor a loadable hub id: {e}"
        ) from None
    if index.get("_class_name") != pipeline_cls.__name__:
        raise ConfigError(
            f"model.path {path!r} holds a {index.get('_class_name')}, not a {pipeline_cls.__name__}"
        )


def make_trainable(transformer: nn.Module, cfg: Config, device: torch.device) -> None:
    """LoRA from `cfg.lora` when `model.finetune` is "lora" (base frozen; the adapter in float32 even over
    a bf16 base, since the optimizer updates it), else every weight trainable; then gradient
    checkpointing from `model.gradient_checkpointing`, and onto `device` unless FSDP2 will shard the frozen
    base (`place_policy`: then it stays on the host until `fully_shard` places it)."""
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
    place_policy(transformer, cfg.distributed.frozen_base, device)


def save_lora(pipeline_cls, transformer: nn.Module, out_dir, state_dict: dict | None = None) -> None:
    """Write `transformer`'s LoRA as `out_dir/pytorch_lora_weights.safetensors` in the diffusers format,
    loadable with `pipeline_cls.load_lora_weights`. An FSDP run passes the gathered full state dict."""
    layers = peft.get_peft_model_state_dict(transformer, state_dict=state_dict)
    pipeline_cls.save_lora_weights(
        out_dir,
        transformer_lora_layers=layers,
        # Without it a loader assumes lora_alpha == rank and scales the update wrongly.
        transformer_lora_adapter_metadata=sorted_sets(transformer.peft_config["default"]).to_dict(),
    )
    sort_safetensors_header(Path(out_dir) / "pytorch_lora_weights.safetensors")


def sort_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted. The writer (Rust) puts the keys of
    `__metadata__` in hash-map order, which changes from process to process, so two exports of the same
    weights would differ in their bytes; the tensors' data and offsets stay as they are."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors keeps the data 8-byte aligned
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + size :])
