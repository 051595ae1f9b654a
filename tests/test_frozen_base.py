"""Where the frozen weights live (distributed.frozen_base) and how the rollout reads them
(distributed.rollout_gather), and the memory a rollout needs known before it runs: docs/memory.md."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from benchmarks import frozen_memory
from omnirl import distributed as D
from omnirl import fsdp
from omnirl.batching import make_requests
from omnirl.config import RolloutConfig
from omnirl.data.prompts import load_prompts
from omnirl.errors import ConfigError
from omnirl.memory import GIB, peak_bytes
from omnirl.models import get_adapter
from omnirl.ops.diffusion import DiffusionOps, sampling_params
from omnirl.phase_clock import PhaseClock, recording
from omnirl.recipe import config_for, load_config
from omnirl.rollout.diffusion import DiffusionEngine
from tests.test_train import ROOT, read_jsonl, tiny_cfg, torchrun

RECIPE = ROOT / "yaml/sd3_tiny_flowgrpo.yaml"


@pytest.mark.parametrize(
    "section, overrides, message",
    [
        ({"frozen_base": "sharded"}, [], "distributed.frozen_base: expected one of 'replicate', 'shard'"),
        ({"frozen_base": "shard", "fsdp": False}, [], "needs distributed.fsdp true"),
        ({}, ["--rollout.memory_budget_gib", "-1"], "rollout.memory_budget_gib must be a finite number"),
        ({}, ["--generation.kv_cache_fraction", "1"], "generation.kv_cache_fraction must be a number in"),
        # a bfloat16 base fed the float32 LoRA's inputs stopped at its first conv, mid-rollout
        ({}, ["--model.dtype", "bfloat16"], "distributed.param_dtype float32 with model.dtype bfloat16"),
    ],
)
def test_bad_frozen_base_settings_fail_at_load_in_one_line(tiny_sd3, tmp_path, section, overrides, message):
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["distributed"].update(section)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["--model.path", str(tiny_sd3), *overrides])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_shard_and_offload_train_as_replicate_does_on_two_ranks(tiny_sd3, tmp_path):
    """3 steps of the tiny SD3 recipe (LoRA, with the KL to the LoRA-off reference) on 2 gloo ranks: the
    frozen base sharded (rollout gathering it once per phase, or one unit per forward) and sharded into
    host memory give the replicated base's losses, samples and LoRA weights (fp32), and each rank holds
    half the frozen bytes, as computed from the transformer's shapes."""
    settings = ["--run.steps", "3", "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
                "--sampling.num_steps", "4", "--algo.kl_beta", "0.01", "--log.image_every", "1"]  # fmt: skip
    runs = {
        "replicate": [],
        "shard": ["--distributed.frozen_base", "shard"],
        "shard_unit": ["--distributed.frozen_base", "shard", "--distributed.rollout_gather", "unit"],
        "offload": ["--distributed.frozen_base", "offload", "--distributed.rollout_gather", "unit"],
    }
    out = {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        r = torchrun(
            2, RECIPE, "--model.path", str(tiny_sd3), "--run.output_dir", str(run_dir), *settings, *extra
        )
        mode = extra[1] if extra else "replicate"
        assert f"frozen weights: {mode}," in r.stdout
        lora = load_file(run_dir / "lora/pytorch_lora_weights.safetensors")
        samples = [np.asarray(Image.open(run_dir / f"samples/step_{s:06d}.png")) for s in range(2)]
        out[name] = (read_jsonl(run_dir / "metrics.jsonl"), lora, samples)
    base_metrics, base_lora, base_samples = out["replicate"]
    moved = max(v.abs().max().item() for k, v in base_lora.items() if "lora_B" in k)
    assert moved > 1e-5
    for name, (metrics, lora, samples) in out.items():
        for m, b in zip(metrics, base_metrics):
            for key in ("loss/policy", "loss/kl", "train/grad_norm", "reward/mean", "reward/std"):
                assert m[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (name, m["step"], key)
        assert lora.keys() == base_lora.keys()
        for k in lora:
            assert (lora[k] - base_lora[k]).abs().max().item() <= 1e-5 * moved, (name, k)
        for s, b in zip(samples, base_samples):
            assert np.abs(s.astype(int) - b.astype(int)).max() <= 1, name  # 8-bit rounding of equal images

    # The frozen bytes each rank holds: the whole transformer replicated, half of it sharded (FSDP2 pads
    # dim 0 to a multiple of the ranks), as benchmarks.frozen_memory computes from the shapes alone.
    rows = frozen_memory.main(["--path", str(tiny_sd3), "--ranks", "1", "2", "--dtype", "float32"])
    whole, half = rows[0]["replicate_bytes"], rows[1]["shard_bytes"]
    assert whole / 2 <= half <= whole / 2 * 1.01
    for name, (metrics, _, _) in out.items():
        expected = whole if name == "replicate" else half
        for m in metrics:
            assert m["mem/frozen_bytes/rank0"] == m["mem/frozen_bytes/rank1"] == expected, name
            assert m["mem/frozen_device_bytes"] == expected  # on CPU the device is the host


# Every adapter with the tiny checkpoint (a conftest fixture) it is built from here.
ADAPTER_CHECKPOINTS = {
    "sd3": "tiny_sd3",
    "qwen_image": "tiny_qwen_image",
    "qwen_image_edit": "tiny_qwen_image_edit",
    "wan": "tiny_wan_a14b",  # two experts
    "qwen_vl": "tiny_qwen_vl_2_5",
    "qwen3_omni_thinker": "tiny_qwen3_omni_thinker",
}


@pytest.mark.parametrize("name", ADAPTER_CHECKPOINTS)
def test_a_sharded_frozen_base_stays_on_the_host_until_fsdp2_places_it(name, request):
    """Each adapter is given the meta device as its device, which the host can tell apart on CPU. With the
    frozen base sharded or offloaded the policy (LoRA and base, both Wan experts) stays on the host where it
    was loaded, for `fully_shard` to move one unit at a time; replicated, it moves to the device as before.
    The frozen modules outside the policy (text encoders, VAE) go to the device in every mode."""
    adapter_cls = get_adapter(name)
    for frozen_base in ("replicate", "shard", "offload"):
        cfg = config_for(name)
        cfg.model.path = str(request.getfixturevalue(ADAPTER_CHECKPOINTS[name]))
        cfg.distributed.frozen_base = frozen_base
        if adapter_cls.kind == "omni":
            cfg.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
        adapter = adapter_cls(cfg, torch.device("meta"))
        policy = {p.device.type for p in adapter.policy.parameters()}
        assert policy == {"meta" if frozen_base == "replicate" else "cpu"}, (frozen_base, policy)
        assert any("lora_" in n for n, _ in adapter.policy.named_parameters())
        if adapter_cls.kind == "diffusion":
            others = {p.device.type for m in adapter.offload_modules() for p in m.parameters()}
            assert others == {"meta"}, (frozen_base, others)


@pytest.mark.slow
def test_fully_shard_finds_a_sharded_base_on_the_host_on_two_ranks(tiny_sd3, tiny_wan_a14b, tiny_qwen_vl_2_5):
    """The trainer's order on 2 gloo ranks (adapter, kind ops, `shard`), with the meta device standing for
    the device: every `fully_shard` call of a sharded or offloaded frozen base finds its unit's parameters
    still on the host (a LoRA's base; a full fine-tune's actor and the reference copy made from it; both
    Wan experts; an omni model), so nothing between loading and sharding moved the policy to the device,
    and the reference copy is wrapped in the policy's units (tests/_load_placement.py)."""
    from tests.test_distributed import two_ranks

    paths = [str(tiny_sd3), str(tiny_wan_a14b), str(tiny_qwen_vl_2_5)]
    assert two_ranks("tests/_load_placement.py", *paths).count("load placement OK") == 2


def test_sharded_bytes_pads_dim0_as_fsdp2_does():
    assert fsdp.sharded_bytes([((5, 3), 4), ((), 2), ((4,), 2)], 2) == 3 * 3 * 4 + 1 * 2 + 2 * 2
    assert fsdp.sharded_bytes([((5, 3), 4)], 1) == 60


@pytest.mark.slow
def test_a_max_num_seqs_that_cannot_fit_fails_before_the_rollout(tiny_sd3, tmp_path):
    """A measured per-request cost (a rollout of one row and one of two, live tensor bytes on CPU) against
    rollout.memory_budget_gib: 8 requests per batch do not fit, the error names the largest
    max_num_seqs that does before any batch runs, and that value runs within the budget."""
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "8",
                   "--sampling.num_steps", "3")  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    assert len(requests) == 8
    roomy = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0))
    clock = PhaseClock(dist.device, prefix="time/")
    with recording(clock):
        reference = roomy.generate(requests)
    first = clock.totals()  # the probes timed whole, their decodes not counted as the step's
    assert first["time/memory_probe_s"] > 0 and first["time/vae_decode_s"] > 0
    with recording(clock):
        roomy.generate(requests[:2])
    assert "time/memory_probe_s" not in clock.totals()  # measured once per key
    (fixed, per_row, top), = roomy.row_cost.values()  # fmt: skip
    assert per_row > 0 and fixed >= 0 and top == 2  # SD3 decodes in one piece: probed at 1 and 2 rows
    # What 8 rows really take, against the estimate extrapolated from 1 and 2 rows.
    real = peak_bytes(lambda: adapter.rollout(requests), dist.device)
    estimate = fixed + 8 * per_row
    print(f"fixed {fixed} B, {per_row} B per request; 8 rows: {real} B measured, {estimate} B estimated")
    assert 0.9 * estimate <= real <= 1.1 * estimate

    budget = fixed + 3.5 * per_row  # room for 3 requests
    tight = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, memory_budget_gib=budget / GIB))
    done = []
    with pytest.raises(ValueError) as e:
        tight.generate(requests, on_batch=done.append)
    assert "the largest rollout.max_num_seqs that fits is 3" in str(e.value)
    assert str(e.value).startswith("rollout.max_num_seqs 8 does not fit")
    assert done == []  # failed before any batch was generated
    fits = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=3, memory_budget_gib=budget / GIB)).generate(
        requests
    )
    for a, b in zip(fits, reference):
        assert torch.allclose(a.output.image, b.output.image, atol=1e-5)

    # The recipe's setting reaches the engine.
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.memory_budget_gib", "0.5")
    assert DiffusionOps(cfg, adapter).engine.memory_budget == 0.5 * GIB


@pytest.mark.slow
def test_a_compiled_rollout_probes_its_memory_eagerly(tiny_sd3, tmp_path, monkeypatch):
    """The memory probes of a compiled rollout (1 and 2 rows for SD3) run the blocks' eager forwards: only
    the real batch's size compiles (dynamo's counters; its 'eager' backend, which traces as inductor
    would), and the probes measure what an eager engine's measure."""
    from torch._dynamo.utils import counters

    from omnirl.rollout import compiled as rollout_compiled

    monkeypatch.setattr(rollout_compiled, "COMPILE_BACKEND", "eager")
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "4",
                   "--sampling.num_steps", "3")  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    plain = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0))
    reference = plain.generate(requests)
    start = counters["stats"]["unique_graphs"]
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0, compile=True))
    out = engine.generate(requests)
    assert counters["stats"]["unique_graphs"] - start == 2  # the two block variants at 4 rows, nothing else
    assert engine.row_cost == plain.row_cost and engine.row_cost  # probed, and as the eager engine probes
    assert all("forward" not in vars(m) for m in adapter.fsdp_units())  # the compiled forwards swapped out
    for a, b in zip(out, reference, strict=True):
        assert torch.allclose(a.output.image, b.output.image, atol=1e-5)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize(
    "window, extra, probe_steps",
    [
        (2, [], 4),
        # Flow-DPPO records each trained step's mean too; DPM-Solver++ 2M keeps the last data prediction
        (2, ["--algo.loss", "flow_dppo", "--sampling.ode_solver", "dpm2"], 4),
        (0, [], 8),  # a window of every step: records for all of them, so the probes keep every step
    ],
)
def test_the_memory_probes_denoise_only_the_window_and_still_give_the_peak(
    tiny_sd3, tmp_path, window, extra, probe_steps
):
    """The probes run a trained window's steps and two more, not the whole schedule: 8 steps with a window
    of 2 (placed anywhere in [0, 5)), SD3's probes of 1 and 2 rows run 4 steps each, so the transformer
    runs 4 + 4 + 8 forwards (CFG fused) where whole probes ran 8 + 8 + 8; and the line through their peaks
    still gives the peak of the full 8-step rollout of 8 rows (what the rollout holds across steps, the
    window's records, does not depend on the number of steps): within 32 bytes of 6.4 MB, 208 with
    Flow-DPPO's means and dpm2, exact for a window of every step (whose probes run every step)."""
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "8",
                   "--sampling.num_steps", "8", "--sampling.sde_window_size", str(window),
                   "--sampling.sde_window_range", "0", "5", *extra)  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    forwards = []
    hook = adapter.policy.register_forward_pre_hook(lambda *_: forwards.append(1))
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0))
    try:
        engine.generate(requests)
    finally:
        hook.remove()
    assert len(forwards) == probe_steps + probe_steps + 8
    (fixed, per_row, top), = engine.row_cost.values()  # fmt: skip
    real = peak_bytes(lambda: adapter.rollout(requests), dist.device)
    estimate = fixed + 8 * per_row
    print(f"8 rows, 8 steps: {real} B measured, {estimate} B from probes of {probe_steps} steps")
    assert top == 2 and 0.9 * estimate <= real <= 1.1 * estimate


@pytest.mark.slow
def test_no_budget_on_cpu_measures_nothing(tiny_sd3, tmp_path):
    """On CPU without rollout.memory_budget_gib there is no device memory to check against: no probe."""
    if D.device_type() != "cpu":
        pytest.skip("on an accelerator the free memory is the budget")
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "1", "--rollout.group_size", "2",
                   "--sampling.num_steps", "2")  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8))
    engine.generate(requests)
    assert engine.row_cost == {}


@pytest.mark.slow
def test_unit_gather_prefetches_one_unit_and_pads_short_ranks(tiny_sd3):
    """rollout_gather unit: at most the running block and the next one's prefetched all-gather are
    gathered, and a rank with fewer batches runs padding batches so both run the same forwards
    (tests/_unit_gather.py)."""
    from tests.test_distributed import two_ranks

    assert two_ranks("tests/_unit_gather.py", str(tiny_sd3)).count("unit gather OK") == 2


@pytest.mark.slow
def test_omni_shard_and_offload_train_as_replicate_does(tiny_qwen3_omni_thinker_k12, tmp_path):
    """The tiny MMK12 recipe (GSPO, LoRA) for 2 steps (an update in step 0; step 1, whose rollout samples
    from the updated LoRA, has no group with reward spread): the thinker's base sharded on 2 ranks and
    offloaded to host memory on 2 ranks (the rollout gathering it onto the device once per phase), and
    offloaded on 1 rank and streamed one unit per forward (no CUDA graph), give the replicated base's
    responses, losses and LoRA weights on as many ranks."""
    settings = ["--model.path", str(tiny_qwen3_omni_thinker_k12), "--log.no-tensorboard", "--run.steps", "2",
                "--validation.every", "0", "--rollout.prompts_per_step", "2",
                "--log.image_every", "1"]  # fmt: skip
    runs = {
        (2, "replicate"): [],
        (2, "shard"): ["--distributed.frozen_base", "shard"],
        (2, "offload"): ["--distributed.frozen_base", "offload"],
        (1, "replicate"): [],
        (1, "offload"): ["--distributed.frozen_base", "offload", "--distributed.rollout_gather", "unit"],
    }

    def train(key):
        (nproc, name), extra = key, runs[key]
        run_dir = tmp_path / f"{name}{nproc}"
        torchrun(nproc, ROOT / "yaml/mmk12_tiny.yaml", *settings, "--run.output_dir", str(run_dir), *extra)
        texts = [(run_dir / f"samples/step_{s:06d}.txt").read_text() for s in range(2)]
        lora = load_file(run_dir / "lora/adapter_model.safetensors")
        return read_jsonl(run_dir / "metrics.jsonl"), lora, texts

    out = {key: train(key) for key in runs if key[0] == 2}
    with ThreadPoolExecutor(2) as pool:  # the two one-process runs side by side, a core each
        ones = [key for key in runs if key[0] == 1]
        out.update(zip(ones, pool.map(train, ones)))
    for nproc, name in [(2, "shard"), (2, "offload"), (1, "offload")]:
        metrics, lora, texts = out[nproc, name]
        base_metrics, base_lora, base_texts = out[nproc, "replicate"]
        assert texts == base_texts
        for m, b in zip(metrics, base_metrics):
            assert m.get("train/updates") == b.get("train/updates") == (None if m["step"] == 1 else 2)
            for key in ("loss/policy", "train/grad_norm", "reward/mean"):
                if key in b:
                    assert m[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (name, m["step"], key)
        moved = max(v.abs().max().item() for k, v in base_lora.items() if "lora_B" in k)
        assert moved > 1e-6
        for k in lora:
            assert (lora[k] - base_lora[k]).abs().max().item() <= 1e-5 * moved, (name, k)
    half = out[2, "shard"][0][0]["mem/frozen_bytes/rank1"]
    assert out[2, "offload"][0][0]["mem/frozen_bytes/rank1"] == half
    assert (
        out[2, "replicate"][0][0]["mem/frozen_bytes/rank1"] / 2
        <= half
        < 0.51 * out[1, "offload"][0][0]["mem/frozen_bytes"]
    )


@pytest.mark.slow
def test_unit_gather_of_an_omni_model_needs_one_rank(tiny_qwen3_omni_thinker_k12, monkeypatch):
    """The generation engine's ranks decode different numbers of steps: per-unit gathering, a collective
    in every forward, is refused on several ranks before the model loads, and accepted on one."""
    from omnirl.ops import check_before_loading

    overrides = ["--model.path", str(tiny_qwen3_omni_thinker_k12), "--distributed.frozen_base", "offload",
                 "--distributed.rollout_gather", "unit"]  # fmt: skip
    check_before_loading(load_config("mmk12_tiny", overrides))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rollout_gather unit with an omni model needs one rank, got 2"):
        check_before_loading(load_config("mmk12_tiny", overrides))
