"""Qwen3-Omni thinkers of a given shape with random weights (`write_random_thinker`), in the released
checkpoint's layout. Its shape is an argument, so `RANDOM` names no fixed checkpoint: the measuring runs
pass the shape they measure (scripts/gpu/two_gpu_runs.py, benchmarks/generate_throughput.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnirl.models.random_init import RANDOM_INIT_FILE

RANDOM: dict = {}


def write_random_thinker(
    out_dir: Path, device: torch.device, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
    head_dim: int, moe_intermediate: int, experts: int, experts_per_tok: int, dtype: str, head_scale: float,
    weights: bool = True,
) -> Path:  # fmt: skip
    """A random-init Qwen3-Omni thinker of the given text-model shape (vision / audio towers tiny: the
    prompts are text), saved as OUT_DIR/random_thinker with the tiny model's tokenizer and processor files
    in the layout of the released checkpoint (Qwen/Qwen3-Omni-30B-A3B-Instruct): a
    `Qwen3OmniMoeForConditionalGeneration` config (the tiny talker and code2wav beside this thinker) and the
    thinker's weights under `thinker.`, so that the Qwen3-Omni adapter loads it as `model.path` and vLLM
    serves it with its own Qwen3-Omni thinker class, as it serves the real model (a thinker-only config is
    not one of vLLM's architectures: it falls back to its generic transformers backend). With the keys vLLM
    reads that transformers does not save (`tiny.add_vllm_config_keys`). Embedding rows beyond the
    tokenizer's vocabulary are never in a prompt but can be sampled, as with the real model. `head_scale`
    multiplies the random lm_head (a random model's output is near uniform: this sharpens it).

    `weights=False` writes the config and those files only, with `RANDOM_INIT_FILE` holding `head_scale`:
    a run whose adapter loads through `random_init_loader` then builds the thinker itself (in its dtype,
    where the frozen-base placement puts it), so the full-size thinker (61 GB in bf16) is never written,
    read back, nor built in float32."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from omnirl.fsdp import DTYPES
    from omnirl.models.qwen3_omni_thinker.tiny import add_vllm_config_keys, make_tiny_qwen3_omni
    from omnirl.weights import load_safetensors

    tiny = make_tiny_qwen3_omni(out_dir / "tiny")
    full = json.loads((tiny / "config.json").read_text())
    tiny_cfg = full["thinker_config"]
    text = dict(
        tiny_cfg["text_config"],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=moe_intermediate,
        num_experts=experts,
        num_experts_per_tok=experts_per_tok,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[24, 20, 20], mrope_interleaved=True
        ),
        max_position_embeddings=65536,
    )
    vision = dict(tiny_cfg["vision_config"], out_hidden_size=hidden)
    audio = dict(tiny_cfg["audio_config"], output_dim=hidden)
    ids = {k: v for k, v in tiny_cfg.items() if k.endswith("token_id")}
    config = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, **ids)
    config.dtype = DTYPES[dtype]
    path = out_dir / "random_thinker"
    path.mkdir(parents=True, exist_ok=True)
    full["thinker_config"] = config.to_dict()
    full_config = Qwen3OmniMoeConfig.from_dict({k: v for k, v in full.items() if k != "transformers_version"})
    full_config.dtype = DTYPES[dtype]
    full_config.save_pretrained(path)
    add_vllm_config_keys(path)
    _copy_processor_files(tiny, path)
    if not weights:
        (path / RANDOM_INIT_FILE).write_text(json.dumps({"head_scale": head_scale}) + "\n")
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config)
        model = model.to(DTYPES[dtype])  # pyright: ignore[reportArgumentType] (`to`: see bagel.public_config)
    if head_scale != 1.0:
        model.lm_head.weight.data *= head_scale
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        model.save_pretrained(tmp)  # the thinker's checkpoint names, then under `thinker.`
        del model
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors = {f"thinker.{k}": v for k, v in load_safetensors(shard).items()}
            save_file(tensors, path / shard.name, metadata={"format": "pt"})
        index = Path(tmp, "model.safetensors.index.json")
        if index.is_file():
            data = json.loads(index.read_text())
            data["weight_map"] = {f"thinker.{k}": v for k, v in data["weight_map"].items()}
            (path / index.name).write_text(json.dumps(data, indent=2) + "\n")
    return path


def _copy_processor_files(tiny: Path, path: Path) -> None:
    """The tiny thinker's tokenizer, processor and generation files, into a random thinker's folder. The
    processor's class is named in its config, as the released checkpoint's preprocessor_config.json does: a
    thinker-only config's model_type (qwen3_omni_moe_thinker) maps to no processor in AutoProcessor, which
    then returns the bare tokenizer (vLLM refuses that for a multimodal model)."""
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    for name in names:
        (path / name).write_bytes((tiny / name).read_bytes())
    processor = json.loads((tiny / "preprocessor_config.json").read_text())
    processor["processor_class"] = "Qwen3OmniMoeProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
