"""The frozen weights each rank holds under `distributed.frozen_base`, computed from a model's shapes on the
meta device (no weights, no device, a few seconds on CPU): what the trainer logs as mem/frozen_bytes and
mem/frozen_device_bytes, for full-size models before a GPU run.

    python -m benchmarks.frozen_memory [--model qwen3_omni_thinker qwen_image sd3] [--ranks 1 2 4 8]
                                       [--path DIFFUSERS_DIR] [--dtype bfloat16] [--out FILE.json]

Per model and number of ranks N: replicate holds the whole base on every rank's device; shard holds 1/N
of it (FSDP2 splits dim 0 of every parameter into N chunks of ceil(dim0 / N) rows,
`omnirl.fsdp.sharded_bytes`); offload holds the same 1/N in host memory and on the device only what
a forward has gathered: the root's own parameters (not in any unit; gathered for the whole forward) and
two units at most (the running one and the next one's prefetched all-gather), whole, not 1/N. The LoRA,
its gradients and optimizer state, activations and the KV cache come on top (docs/mmk12.md, memory plan).
`--path` reads a diffusers transformer's config (`DIR/transformer`, e.g. a tiny checkpoint), which
`tests/test_frozen_base.py` checks against a CPU run's accounting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from omnirl.fsdp import DTYPES, sharded_bytes

GIB = 2**30

# Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker (docs/mmk12.md, "Memory plan": 31.7 B parameters).
THINKER_TEXT = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8, vocab_size=152064,
    intermediate_size=768, tie_word_embeddings=False,
)  # fmt: skip
THINKER_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048)
THINKER_AUDIO = dict(encoder_layers=32, d_model=1280, encoder_attention_heads=20, encoder_ffn_dim=5120,
                     output_dim=2048)  # fmt: skip


def build(model: str, path: str | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """The model on the meta device and its FSDP units, as its adapter's `fsdp_units` names them."""
    with torch.device("meta"):
        if model == "qwen3_omni_thinker":
            from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

            config = Qwen3OmniMoeThinkerConfig(
                text_config=THINKER_TEXT, vision_config=THINKER_VISION, audio_config=THINKER_AUDIO
            )
            m = Qwen3OmniMoeThinkerForConditionalGeneration(config)
            body = m.model
            return m, [*body.language_model.layers, body.visual, body.audio_tower, m.lm_head]
        if model == "qwen_image":
            from diffusers import QwenImageTransformer2DModel

            m = QwenImageTransformer2DModel()  # its defaults are Qwen-Image's
        elif model == "sd3":
            from diffusers import SD3Transformer2DModel

            from omnirl.models.sd3.public_config import SD35_TRANSFORMER

            m = SD3Transformer2DModel(**SD35_TRANSFORMER)
        elif model == "path":
            from diffusers import SD3Transformer2DModel

            m = SD3Transformer2DModel.from_config(
                SD3Transformer2DModel.load_config(path, subfolder="transformer")
            )
        else:
            raise SystemExit(f"error: --model {model!r}: one of qwen3_omni_thinker, qwen_image, sd3")
    return m, list(m.transformer_blocks)


def table(model: nn.Module, units: list[nn.Module], ranks: list[int], dtype: torch.dtype) -> list[dict]:
    """One row per number of ranks: the bytes per rank of each placement (all parameters frozen: a
    LoRA's base; the LoRA's own parameters are not in a meta-built model)."""
    size = torch.empty((), dtype=dtype).element_size()
    shapes = [(tuple(p.shape), size) for p in model.parameters()]
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() * size for p in model.parameters() if id(p) not in in_units)
    unit_bytes = sorted((sum(p.numel() for p in u.parameters()) * size for u in units), reverse=True)
    gathered = root + sum(unit_bytes[:2])
    whole = sharded_bytes(shapes, 1)
    rows = []
    for n in ranks:
        shard = sharded_bytes(shapes, n)
        rows.append({
            "ranks": n, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
            "replicate_device_gib": whole / GIB, "shard_device_gib": shard / GIB,
            "offload_host_gib": shard / GIB, "offload_device_gib": gathered / GIB,
            "replicate_bytes": whole, "shard_bytes": shard, "offload_device_bytes": gathered,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen3_omni_thinker", "qwen_image", "sd3"])
    p.add_argument("--path", help="a diffusers checkpoint whose transformer/ to count (instead of --model)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    models = ["path"] if a.path else a.model
    out = []
    head = "| model | ranks | params (B) | replicate: device GiB | shard: device GiB |"
    print(head + " offload: host / device GiB |\n|---|---|---|---|---|---|")
    for name in models:
        model, units = build(name, a.path)
        for row in table(model, units, a.ranks, DTYPES[a.dtype]):
            row = {"model": a.path or name, "dtype": a.dtype, **row}
            out.append(row)
            print(f"| {row['model']} | {row['ranks']} | {row['params_b']:.2f} "
                  f"| {row['replicate_device_gib']:.2f} | {row['shard_device_gib']:.2f} "
                  f"| {row['offload_host_gib']:.2f} / {row['offload_device_gib']:.2f} |")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
