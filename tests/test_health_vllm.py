"""The update must reach vLLM: the fingerprint of the weights the vLLM worker generated with, before the first
optimizer step and after the next push, must differ, else the run stops with one line.

`Health`'s side runs everywhere (the fingerprints as the engine reports them, in the step's metrics); the
engine's side (`VLLMEngine.fingerprint`: the LoRA slots vLLM computes with) runs with the real vLLM in the
venv of scripts/vllm_cpu_env.sh (marked `vllm`)."""

from __future__ import annotations

import pytest
import torch

from omnirl.health import Health, HealthError
from omnirl.models.base import GenerationParams
from omnirl.recipe import config_for
from tests.test_health import Ops as LoraOps
from tests.test_vllm import HAVE_VLLM, NO_VLLM, image_requests, omni_config


class Engine:
    fingerprints = False


class Ops(LoraOps):
    """What Health reads of the trainer's ops: a policy holding a LoRA, and the rollout engine."""

    def __init__(self):
        super().__init__()
        self.engine = Engine()


def health():
    cfg = config_for("qwen3_omni_thinker")
    cfg.rollout.backend, cfg.lora.target_modules = "vllm", ["to_q"]
    ops = Ops()
    return Health(cfg, ops, None, None), ops.engine


def step(h: Health, i: int, held: float, updates: float) -> None:
    logs = {"vllm/weights_fingerprint": held, "train/updates": updates, "reward/mean": 0.0}
    h.after_step(i, logs, [], None, lambda: None)
    h.stop_if_needed(None)


def test_an_update_that_does_not_reach_vllm_stops():
    h, engine = health()
    assert engine.fingerprints  # the engine reports what it holds after every rollout
    step(h, 0, 12.5, 0.0)  # no optimizer step (every group without reward spread): nothing to compare
    step(h, 1, 12.5, 1.0)  # the rollout before the first optimizer step
    with pytest.raises(HealthError) as e:
        step(h, 2, 12.5, 1.0)  # the push after it left vLLM's weights as they were
    assert str(e.value).startswith(
        "step 2: the first optimizer step did not reach vLLM: the weights it holds"
    )
    assert "(fingerprint 12.5)" in str(e.value)
    assert not engine.fingerprints  # checked once: the engine stops computing it


def test_an_update_that_reaches_vllm_passes():
    h, engine = health()
    step(h, 0, 12.5, 1.0)
    step(h, 1, 12.75, 1.0)
    step(h, 2, 12.75, 1.0)  # checked once, after the first optimizer step only
    assert not engine.fingerprints and h.fatal is None


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
# The MoE engine first: under vLLM 0.26 an MoE engine built after a dense one in the same process finds
# no expert-parallel group.
@pytest.mark.parametrize("mode", ["merged", "lora"])
def test_the_fingerprint_follows_the_weights_vllm_holds(tmp_path, monkeypatch, mode):
    """The fingerprint is steady while the weights are, moves with an update the push carries, and stays
    put when the push carries nothing. lora: a dense Qwen3-VL whose LoRA vLLM serves as an adapter (its LoRA
    slots). merged: the MoE thinker, whose merged weights vLLM's CPU GEMMs hold packed (the layers' outputs
    on a probe input)."""
    from omnirl.rollout.vllm_engine import vllm_engine

    if mode == "lora":
        from omnirl.models.qwen_vl.adapter import QwenVLAdapter
        from omnirl.models.qwen_vl.tiny import make_tiny_qwen_vl

        cfg = omni_config(make_tiny_qwen_vl(tmp_path / "qwen3_vl", "qwen3_vl", head_dim=32), "qwen_vl")
        adapter = QwenVLAdapter(cfg, torch.device("cpu"))
    else:
        from omnirl.models.qwen3_omni_thinker.adapter import Qwen3OmniThinkerAdapter
        from omnirl.testing.k12 import make_tiny_qwen3_omni_k12

        cfg = omni_config(make_tiny_qwen3_omni_k12(tmp_path / "k12", head_dim=32))
        adapter = Qwen3OmniThinkerAdapter(cfg, torch.device("cpu"))
    engine = vllm_engine(adapter, cfg)
    assert engine.mode == mode
    engine.fingerprints = True
    requests = image_requests(1, 2, GenerationParams(max_new_tokens=8))
    held = []
    for change in (False, False, True, "unpushed"):
        if change:
            with torch.no_grad():  # an optimizer step on the LoRA
                for name, p in adapter.model.named_parameters():
                    if "lora_B" in name:
                        p.add_(torch.randn_like(p) * 0.3)
        if change == "unpushed":
            monkeypatch.setattr(engine, "_push_lora", lambda: len(engine.lora_layers))
            monkeypatch.setattr(engine, "_push_weights", lambda full: len(engine.lora_layers))
        engine.generate(requests)
        held.append(engine.stats["vllm/weights_fingerprint"])
    print(f"fingerprints: {held}")
    assert held[0] > 0 and held[1] == held[0] and held[2] != held[1]
    assert held[3] == held[2]  # the trainer's LoRA moved, vLLM's did not: what Health stops on
