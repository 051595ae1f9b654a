"""The Wan adapter on tiny random-init Wan2.2 checkpoints of both layouts (TI2V-5B: one transformer with
per-token timesteps; T2V-A14B: two experts switched at boundary_ratio), against diffusers' own WanPipeline.
fp32 on CPU: everything must agree to 1e-5 (docs/architecture.md, invariants)."""

import dataclasses
import functools

import pytest
import torch
from diffusers import WanPipeline

from omnirl.config import RolloutConfig
from omnirl.config_checks import check_values
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.memory import GIB, peak_bytes
from omnirl.models import get_adapter
from omnirl.models.base import Request, SamplingParams
from omnirl.models.flow_sde import flow_step
from omnirl.models.wan.adapter import LORA_FILE, LORA_FILE_2, WanAdapter
from omnirl.recipe import config_for
from omnirl.rollout.diffusion import DiffusionEngine
from tests.support_compare import (
    export_lora_twice,
    initial_latents,
    load_pipeline,
    max_diff,
    packed_serial_diffs,
    perturb_lora,
    prompt_requests,
    tiny_config,
)

PROMPTS = ["a red cat", "two dogs in the snow", "a lighthouse at night", "waves"]
NEGATIVES = ["blurry", "", "low quality", ""]
GUIDANCE, GUIDANCE_2 = 4.0, 3.0
STEPS = 6  # with shift 5: sigmas 1, .96, .91 (transformer), .83, .71, .5 (transformer_2)
HEIGHT, WIDTH, FRAMES = 32, 48, 9  # latents [4, 3, 4, 6]


def make_adapter(path, guidance_2=None, **lora) -> WanAdapter:
    cfg = tiny_config("wan", path, **lora)
    cfg.family.num_frames = FRAMES
    cfg.family.guidance_scale_2 = guidance_2
    return WanAdapter(cfg, torch.device("cpu"))


def make_requests(params: SamplingParams, n: int = len(PROMPTS)) -> list[Request]:
    return prompt_requests(params, PROMPTS[:n], NEGATIVES[:n])


def noise_free(guidance: float = GUIDANCE) -> SamplingParams:
    return SamplingParams(HEIGHT, WIDTH, STEPS, guidance, 0.0, "sde", 0, (0, 1))


def run_pipeline(pipe, adapter, requests, output_type, guidance_2=None):
    """The reference: WanPipeline from the same initial latents the adapter draws per request."""
    extra = {"guidance_scale_2": guidance_2} if guidance_2 is not None else {}
    return pipe(
        prompt=[r.prompt for r in requests],
        negative_prompt=[r.negative_prompt for r in requests],
        guidance_scale=requests[0].params.guidance_scale,
        num_inference_steps=requests[0].params.num_steps,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        latents=initial_latents(requests, adapter.latent_shape(HEIGHT, WIDTH)),
        max_sequence_length=adapter.max_sequence_length,
        output_type=output_type,
        **extra,
    ).frames


@pytest.fixture(scope="module")
def ti2v(tiny_wan_ti2v):
    return make_adapter(tiny_wan_ti2v)


@pytest.fixture(scope="module")
def a14b(tiny_wan_a14b):
    return make_adapter(tiny_wan_a14b, guidance_2=GUIDANCE_2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_noise_free_rollout_is_the_pipeline_sampler(layout, request):
    adapter = request.getfixturevalue(layout)
    path = request.getfixturevalue(f"tiny_wan_{layout}")
    if layout == "a14b":  # the schedule crosses the boundary: both experts run
        sig = adapter.sigmas(STEPS)[:-1]
        assert (sig >= 0.875).any() and (sig < 0.875).any()
    pipe = load_pipeline(WanPipeline, path)
    requests = make_requests(noise_free(), n=2)
    trajs = adapter.rollout(requests)
    g2 = GUIDANCE_2 if layout == "a14b" else None
    ref_latents = run_pipeline(pipe, adapter, requests, "latent", g2)
    ref_videos = run_pipeline(pipe, adapter, requests, "pt", g2)
    d_latents = max_diff(torch.stack([t.final_latents for t in trajs]), ref_latents)
    d_videos = max_diff(torch.stack([t.output.video for t in trajs]), ref_videos)
    print(f"{layout}: pipeline vs rollout: latents {d_latents:.2e}, videos {d_videos:.2e}")
    assert trajs[0].output.video.shape == (FRAMES, 3, HEIGHT, WIDTH)
    assert d_latents < 1e-5 and d_videos < 1e-5


@pytest.mark.slow
def test_a14b_guidance_1_guides_neither_expert_as_the_pipeline(a14b, tiny_wan_a14b):
    """WanPipeline guides only when guidance_scale > 1, for both experts: at guidance 1 its
    guidance_scale_2 (3 here) has no effect, and the low-noise expert runs unguided too."""
    pipe = load_pipeline(WanPipeline, tiny_wan_a14b)
    requests = make_requests(noise_free(guidance=1.0), n=2)
    assert not a14b.guided(1.0) and a14b.guidance_2(1.0) == 1.0 and a14b.guidance_2(GUIDANCE) == GUIDANCE_2
    trajs = a14b.rollout(requests)
    ref = run_pipeline(pipe, a14b, requests, "latent", GUIDANCE_2)
    assert max_diff(torch.stack([t.final_latents for t in trajs]), ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_packed_rollout_equals_serial(layout, request):
    adapter = request.getfixturevalue(layout)
    params = SamplingParams(HEIGHT, WIDTH, STEPS, GUIDANCE, 0.7, "sde", 2, (0, 5))
    requests = make_requests(params)
    packed = adapter.rollout(requests)
    serial = [adapter.rollout([r])[0] for r in requests]
    starts = [int(t.step_indices[0]) for t in packed]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got starts {starts}"
    d_latents, d_logprobs = packed_serial_diffs(packed, serial, adapter.latent_shape(HEIGHT, WIDTH))
    print(f"{layout} packed vs serial: starts {starts}, latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_recomputed_logprob_equals_rollout(layout, request):
    adapter = request.getfixturevalue(layout)
    params = SamplingParams(HEIGHT, WIDTH, STEPS, GUIDANCE, 0.7, "sde", 3, (0, 4))
    trajs = adapter.rollout(make_requests(params))
    # Every (sample, trained step) pair in one batch, as the trainer stacks them: rows at different sigmas,
    # for A14B rows of both experts in one call.
    k = len(trajs[0].step_indices)
    steps = torch.cat([t.step_indices for t in trajs])
    sigmas = trajs[0].sigmas
    if layout == "a14b":
        high = sigmas[steps] >= 0.875
        assert high.any() and (~high).any(), f"the micro-batch should hold rows of both experts: {steps}"
    x = torch.cat([t.latents for t in trajs])
    x_next = torch.cat([t.next_latents for t in trajs])
    embeds = {key: torch.stack([t.embeds[key] for t in trajs for _ in range(k)]) for key in trajs[0].embeds}
    recorded = torch.cat([t.logprobs for t in trajs])
    with torch.no_grad():
        for fused in (True, False):
            v = adapter.velocity(x, sigmas[steps], embeds, GUIDANCE, fused_cfg=fused)
            out = flow_step(
                v, x, sigmas[steps], sigmas[steps + 1], float(sigmas[1]), 0.7, "sde", prev_sample=x_next
            )
            diff = max_diff(out.logprob, recorded)
            print(f"{layout} recomputed vs rollout log-prob (fused_cfg={fused}): max {diff:.2e}")
            assert diff < 1e-5


def test_policy_and_lora_cover_both_experts(a14b, ti2v):
    # One module of both experts, not a ModuleDict (torch 2.11's fully_shard refuses every ModuleDict).
    experts = a14b.policy
    assert not isinstance(experts, (torch.nn.ModuleDict, torch.nn.ModuleList))
    assert set(experts.keys()) == {"transformer", "transformer_2"} and len(experts) == 2
    assert experts["transformer_2"] is dict(experts.named_children())["transformer_2"]
    names = [n for n, _ in a14b.policy.named_parameters() if "lora_" in n]
    assert any(n.startswith("transformer.") for n in names) and any(
        n.startswith("transformer_2.") for n in names
    )
    assert len(a14b.trainable_parameters()) == 2 * len(ti2v.trainable_parameters())
    assert a14b.modalities == frozenset({"video"})
    # Latent tokens after patching: 3 frames x 2 x 3.
    req = make_requests(noise_free(), 1)[0]
    assert ti2v.num_tokens(req) == 3 * 2 * 3
    assert FRAMES in a14b.compat_key(req)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ti2v", "a14b"])
def test_exported_lora_loads_into_the_pipeline(layout, request, tmp_path):
    path = request.getfixturevalue(f"tiny_wan_{layout}")
    g2 = GUIDANCE_2 if layout == "a14b" else None
    adapter = make_adapter(path, guidance_2=g2, rank=4, alpha=8.0)  # alpha != rank: the scale must travel
    perturb_lora(adapter, 0.05)
    export_lora_twice(adapter, tmp_path, (LORA_FILE, LORA_FILE_2) if layout == "a14b" else (LORA_FILE,))

    pipe = load_pipeline(WanPipeline, path)
    requests = make_requests(noise_free(), n=2)
    base = run_pipeline(pipe, adapter, requests, "latent", g2)
    pipe.load_lora_weights(tmp_path)
    if layout == "a14b":
        pipe.load_lora_weights(tmp_path, weight_name=LORA_FILE_2, load_into_transformer_2=True)
    ref_latents = run_pipeline(pipe, adapter, requests, "latent", g2)
    trajs = adapter.rollout(requests)
    d_latents = max_diff(torch.stack([t.final_latents for t in trajs]), ref_latents)
    change = max_diff(ref_latents, base)
    print(f"{layout}: LoRA changes pipeline by {change:.2e}; vs rollout: latents {d_latents:.2e}")
    assert change > 1e-2 and d_latents < 1e-5


def test_registered_and_bad_frames(tiny_wan_ti2v):
    assert get_adapter("wan") is WanAdapter
    cfg = tiny_config("wan", tiny_wan_ti2v)
    cfg.family.num_frames = 8
    with pytest.raises(ValueError, match="num_frames"):
        WanAdapter(cfg, torch.device("cpu"))
    cfg.family.num_frames, cfg.family.decode_rows = 9, 0
    with pytest.raises(ConfigError, match="family.decode_rows must be an integer >= 1, got 0"):
        check_values(cfg)


@pytest.mark.slow
def test_memory_probe_starts_where_the_decode_chunk_is_full(ti2v, monkeypatch):
    """The VAE decodes `decode_rows` (2) videos at a time, so a rollout's peak (live tensor bytes on CPU)
    grows by a whole decode from 1 to 2 rows and by little after. The engine measures at 2 and 4 rows
    (`memory_probe_rows`) and accepts and refuses max_num_seqs as the measured peaks of the batches say,
    where the line through 1 and 2 rows would have refused both. A key whose batches are small is measured
    at their size, and again when a larger batch of it comes; `check_memory` runs the probes alone."""
    assert ti2v.memory_probe_rows == ti2v.settings.decode_rows == 2
    params = SamplingParams(HEIGHT, WIDTH, 2, GUIDANCE, 0.7, "sde", 1, (0, 2))
    requests = prompt_requests(params, PROMPTS * 2, NEGATIVES * 2)
    cpu = torch.device("cpu")
    peak = {n: peak_bytes(functools.partial(ti2v.rollout, requests[:n]), cpu) for n in (1, 2, 6, 7, 8)}
    one_two = peak[2] - peak[1]  # what the line through 1 and 2 rows charges every request

    def old_fits(budget: float) -> int:
        return int((budget - (peak[1] - one_two)) // one_two)

    probes = []
    rollout = ti2v.rollout
    monkeypatch.setattr(ti2v, "rollout", lambda batch, *a: probes.append(len(batch)) or rollout(batch, *a))

    budget = 1.01 * peak[8]  # 8 requests fit
    engine = DiffusionEngine(ti2v, RolloutConfig(max_num_seqs=8, memory_budget_gib=budget / GIB))
    assert len(engine.generate(requests)) == 8
    assert probes == [2, 4, 8]  # the two probes, then the batch
    ((fixed, per_row, top),) = engine.row_cost.values()
    print(f"peaks {peak}; measured: {fixed} B + {per_row} B per request; 1-vs-2 rows: {one_two} B")
    assert top == 4 and fixed + 8 * per_row == pytest.approx(peak[8], rel=1e-3)
    assert engine.stats["row_gib"] == per_row / GIB and per_row < one_two / 4
    assert old_fits(budget) < 8

    budget = (peak[6] + peak[7]) / 2  # 6 requests fit, 7 do not
    probes.clear()
    with pytest.raises(ValueError, match="the largest rollout.max_num_seqs that fits is 6$"):
        DiffusionEngine(ti2v, RolloutConfig(max_num_seqs=8, memory_budget_gib=budget / GIB)).generate(
            requests
        )
    assert probes == [2, 4] and old_fits(budget) < 6

    # Batches of at most 2k rows: the probe runs at their size, never more rows than the batch holds.
    probes.clear()
    engine = DiffusionEngine(ti2v, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0))
    for n in (1, 3, 8):
        engine.generate(requests[:n])
    assert probes == [1, 1] + [2, 3, 3] + [2, 4, 8]

    # check_memory runs the probes a generate would, and nothing else; a key measured at its largest
    # batch is not measured again.
    probes.clear()
    engine = DiffusionEngine(ti2v, RolloutConfig(max_num_seqs=8, memory_budget_gib=1.0))
    engine.check_memory(requests[:4])
    assert probes == [2, 4]
    engine.generate(requests[:4])
    assert probes == [2, 4, 4]


@pytest.mark.slow
def test_group_shared_initial_noise_and_random_step_subsets(ti2v):
    """DanceGRPO's sampling: a group's samples start from the same latents (its own seed) and part after
    the first SDE step; trained steps a random subset; packed still equals serial."""
    params = SamplingParams(
        HEIGHT, WIDTH, STEPS, GUIDANCE, 1.2, "dance_sde", 3, (0, 5), shared_initial_noise=True,
        sde_window_schedule="dance",
    )  # fmt: skip
    # Two groups of two; the group seed is the group's, the sample seed the sample's.
    requests = [
        Request(PROMPTS[0], g, i, derive_seed(7, 0, i), params, group_seed=derive_seed(7, 0, -1 - g))
        for i, g in enumerate([0, 0, 1, 1])
    ]
    packed = ti2v.rollout(requests)
    serial = [ti2v.rollout([r])[0] for r in requests]
    subsets = [t.step_indices.tolist() for t in packed]
    assert all(len(s) == 3 and s == sorted(s) and max(s) < 5 for s in subsets)
    assert any(s != list(range(s[0], s[0] + 3)) for s in subsets), subsets  # not all contiguous
    d = max(max_diff(a.next_latents, b.next_latents) for a, b in zip(packed, serial))
    d_lp = max(max_diff(a.logprobs, b.logprobs) for a, b in zip(packed, serial))
    assert d < 1e-5 and d_lp < 1e-5, (d, d_lp)
    assert all(torch.isfinite(t.logprobs).all() and torch.all(t.logprobs != 0) for t in packed)
    # Step 0 is deterministic (ODE) unless trained: compare where both rows enter their first SDE step.
    from omnirl.models.flow_sde import WindowedSampler

    sampler = WindowedSampler(requests, ti2v.latent_shape(HEIGHT, WIDTH), ti2v.sigmas(STEPS), "cpu")
    x0 = sampler.initial_latents
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[2], x0[3]) and not torch.equal(x0[0], x0[2])
    assert max_diff(packed[0].final_latents, packed[1].final_latents) > 1e-3
    # A window fixed at step 1: the group's rows enter their first SDE step equal and leave it apart.
    fixed = SamplingParams(
        HEIGHT, WIDTH, STEPS, GUIDANCE, 1.2, "dance_sde", 2, (1, 3), shared_initial_noise=True
    )  # fmt: skip
    a, b = ti2v.rollout([dataclasses.replace(r, params=fixed) for r in requests[:2]])
    assert a.step_indices.tolist() == b.step_indices.tolist() == [1, 2]
    assert torch.equal(a.latents[0], b.latents[0])
    assert max_diff(a.next_latents[0], b.next_latents[0]) > 1e-3


@pytest.mark.slow
def test_trainer_logprob_of_a_micro_batch_of_both_experts(a14b):
    """The trainer's recomputation (`ops.diffusion.pair_logprob`) of one micro-batch holding rows of both
    experts equals the rollout's log-probs."""
    from omnirl.ops.diffusion import Pair, pair_logprob

    params = SamplingParams(HEIGHT, WIDTH, STEPS, GUIDANCE, 0.7, "sde", 0, (0, 1))
    trajs = a14b.rollout(make_requests(params, n=2))
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]  # every step but the last
    sig = trajs[0].sigmas[:-1]
    assert (sig >= 0.875).any() and (sig < 0.875).any()
    with torch.no_grad():
        lp = pair_logprob(a14b, pairs, params).logprob
    recorded = torch.stack([p.traj.logprobs[p.k] for p in pairs])
    print(f"pair_logprob vs rollout, both experts in one micro-batch: {max_diff(lp, recorded):.2e}")
    assert max_diff(lp, recorded) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, layout",
    [("wan22_ti2v_tiny_dancegrpo", "ti2v"), ("wan22_a14b_tiny_flowgrpo_lora", "a14b")],
)
def test_tiny_recipes_under_torchrun_fsdp(recipe, layout, request, tmp_path):
    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    path = request.getfixturevalue(f"tiny_wan_{layout}")
    r = torchrun(
        2, ROOT / f"yaml/{recipe}.yaml", "--model.path", str(path), "--run.output_dir", str(out),
        "--run.steps", "2", "--log.image_every", "1",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1] and all(m["train/updates"] == 1 for m in metrics)
    assert all(m["train/grad_norm"] > 0 for m in metrics)
    lora = ["pytorch_lora_weights.safetensors"] + (
        ["pytorch_lora_weights_transformer_2.safetensors"] if layout == "a14b" else []
    )
    assert all((out / "lora" / f).is_file() for f in lora)
    assert (out / "samples/step_000001_0.mp4").is_file()
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_experts_under_fsdp_with_rows_of_one_expert_per_rank(tiny_wan_a14b):
    import os
    import subprocess
    import sys

    from tests.test_train import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run(
        [*cmd, "tests/_wan_experts_fsdp.py", str(tiny_wan_a14b)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert r.stdout.count("experts OK") == 2


def test_group_seeds_come_from_the_group_alone():
    """A group's samples share its seed, which depends on (run seed, step, the prompt's place in the step)
    only: not on the rank that runs it; validation draws its initial noise per sample."""
    from omnirl import distributed as D
    from omnirl.batching import make_requests as step_requests
    from omnirl.data.prompts import PromptRow
    from omnirl.ops.diffusion import sampling_params

    cfg = config_for("wan")
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 3
    cfg.sampling.shared_initial_noise = True
    rows = [PromptRow(f"prompt {i}") for i in range(8)]
    params = sampling_params(cfg)
    assert params.shared_initial_noise and not sampling_params(cfg, ode=True).shared_initial_noise

    def seeds(step, world):
        out = []
        for rank in range(world):
            dist = D.DistInfo(rank, world, rank, torch.device("cpu"), None)
            out += step_requests(cfg, rows, step, dist, params)[0]
        return out

    one, two = seeds(0, 1), seeds(0, 2)
    assert [(r.group_seed, r.seed) for r in one] == [(r.group_seed, r.seed) for r in two]
    by_group = {}
    for r in one:
        by_group.setdefault(r.group_id, set()).add(r.group_seed)
    assert all(len(s) == 1 for s in by_group.values()) and len({s.pop() for s in by_group.values()}) == 4
    assert {r.group_seed for r in one}.isdisjoint({r.seed for r in one})
    assert {r.group_seed for r in one}.isdisjoint({r.group_seed for r in seeds(1, 1)})


@pytest.mark.slow
def test_bf16_fsdp_units_recompute_in_their_forward_dtypes(tiny_wan_a14b, tmp_path, monkeypatch):
    """A gradient-checkpointed unit under FSDP2 with param_dtype bfloat16 recomputes in the dtypes its
    forward ran in. FSDP2 of torch 2.11 casts a unit's float inputs in the forward but not in the
    recompute (its pre-forward hook returns before the cast during the backward; later versions cast
    there too), and Wan's rotary embedding is float32: the recompute differed and torch.utils.checkpoint
    refused the backward. The units cast their inputs themselves (`fsdp.cast_inputs`). Here FSDP2's
    hook is made to behave as 2.11's; one row of each expert, a full fine-tune (every parameter sharded);
    the gradients equal those without checkpointing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from omnirl import fsdp

    pre_forward = FSDPState._pre_forward

    def pre_forward_of_torch_2_11(self, module, args, kwargs):
        if self._training_state != TrainingState.PRE_BACKWARD:
            return pre_forward(self, module, args, kwargs)
        groups = getattr(self, "_fsdp_param_groups", None)  # torch 2.13; 2.11 has one group or None
        if groups is None:
            groups = [g for g in [self._fsdp_param_group] if g is not None]
        for group in groups:  # the recompute: unshard, no cast
            if not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()
        return args, kwargs

    monkeypatch.setattr(FSDPState, "_pre_forward", pre_forward_of_torch_2_11)

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        cfg = config_for("wan")
        cfg.model.path, cfg.model.dtype, cfg.family.num_frames = str(tiny_wan_a14b), "bfloat16", FRAMES
        cfg.family.guidance_scale_2, cfg.model.gradient_checkpointing = GUIDANCE_2, checkpointing
        cfg.model.finetune = "full"
        adapter = WanAdapter(cfg, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        fsdp.apply_fsdp(adapter.policy, adapter.fsdp_units(), mesh, "bfloat16", "float32")
        latents = torch.randn(2, *adapter.latent_shape(HEIGHT, WIDTH), generator=gen).to(torch.bfloat16)
        sigma = adapter.sigmas(STEPS)[[0, 4]]  # 1.0 (transformer) and 0.71 (transformer_2)
        embeds = adapter.encode(["a red cat", "waves"], ["", ""])
        adapter.velocity(latents, sigma, embeds, GUIDANCE).float().square().mean().backward()
        return {n: p.grad.full_tensor() for n, p in adapter.policy.named_parameters() if p.grad is not None}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        plain, checkpointed = grads(False), grads(True)
    finally:
        dist.destroy_process_group()
    assert {n.split(".")[0] for n in plain} == {"transformer", "transformer_2"}, sorted(plain)[:4]
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():
        assert g.abs().sum() > 0 or "blocks" not in name, name
        assert max_diff(g, checkpointed[name]) <= 1e-6 * max(1.0, float(g.abs().max())), name
