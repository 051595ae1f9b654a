"""The FP8 rollout (rollout.precision fp8) on CPU, where torch emulates the FP8 matmul: the quantisation
against an fp32 reference, the layers each family keeps in bf16 (by module name, on each tiny family), the
stand-ins swapped in only while the rollout runs and compiled once for all blocks, the rollout correction
applied where and only where the option is on, the recompute path whenever a trained step ran in another
precision than the trainer's, FP8 on the untrained steps only (rollout.fp8.steps untrained) leaving the
trained transitions a bf16 rollout's, and Sol-RL's bf16 regeneration of the selected samples from the same
seeds."""

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from omnirl import distributed as D
from omnirl.batching import make_requests
from omnirl.config import FP8Config, RolloutConfig
from omnirl.data.prompts import load_prompts
from omnirl.errors import ConfigError
from omnirl.models import flow_sde, get_adapter
from omnirl.models.base import SamplingParams
from omnirl.ops.diffusion import DiffusionOps
from omnirl.recipe import load_config
from omnirl.rewards.pool import RewardPool
from omnirl.rollout import compiled as rollout_compiled
from omnirl.rollout.diffusion import DiffusionEngine
from omnirl.rollout.fp8 import FP8_MAX, Float8Linear, Fp8Rollout, dequantise, fp8_linear, quantise_rows
from omnirl.scoring import regenerate_selected, rollout_and_score
from omnirl.step import assign_advantages, update
from tests.support_compare import tiny_config
from tests.test_engine import make_requests as engine_requests
from tests.test_engine import max_diffs, run

# e4m3: 3 mantissa bits, so rounding to nearest is off by at most 2^-4 of the value; below its smallest
# normal (2^-6) the spacing is 2^-9, so at most 2^-10 absolute (in units of the row's scale).
REL, SUBNORMAL = 2.0**-4, 2.0**-10


def test_quantise_rows_is_within_fp8_rounding_of_fp32():
    torch.manual_seed(0)
    # Rows of very different magnitudes, one all zero (a padding row) and one with a single large value.
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 50.0, 1e4, 0.0, 1.0])[:, None]
    x[5, 7] = 300.0
    q, scale = quantise_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    back = dequantise(q, scale)
    bound = torch.maximum(x.abs() * REL, scale * SUBNORMAL)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # The largest magnitude of a row maps to the format's largest value, exactly.
    rows = x.abs().amax(dim=1) > 0
    assert torch.equal(q.float().abs().amax(dim=1)[rows], torch.full((5,), FP8_MAX))
    assert torch.equal(back[4], torch.zeros(64))  # the zero row stays zero, no division by zero
    print(f"max relative error {((back - x).abs() / x.abs().clamp(min=1e-30))[x != 0].max():.3e}")


def test_fp8_linear_is_the_matmul_of_the_quantised_operands():
    """The scaled matmul computes exactly the product of the dequantised activations and weights (up to
    fp32 summation), and lands within FP8 rounding of the unquantised fp32 product."""
    torch.manual_seed(1)
    x = torch.randn(3, 5, 64)  # [..., K]: the leading dims flattened into rows and back
    linear = nn.Linear(64, 32)
    stand_in = Float8Linear(linear)
    stand_in.load(linear)
    y = stand_in(x)
    assert y.shape == (3, 5, 32) and y.dtype == torch.float32
    xq, xs = quantise_rows(x.reshape(-1, 64))
    w = dequantise(stand_in.weight_q, stand_in.weight_scale.t()).double()  # [N, K]
    exact = (dequantise(xq, xs).double() @ w.t() + linear.bias.double()).reshape(3, 5, 32)
    assert (y.double() - exact).abs().max() < 1e-5
    reference = linear(x).double()
    # Each product term is off by at most ~2 * 2^-4 of its magnitude: bound by sum |x| |w|.
    bound = 2.2 * REL * (x.abs().double() @ linear.weight.abs().double().t())
    assert ((y.double() - reference).abs() <= bound).all()
    assert (y.double() - reference).abs().max() > 0  # it is FP8, not the fp32 product
    assert torch.equal(y, fp8_linear(x, stand_in.weight_q, stand_in.weight_scale, linear.bias))


def test_block_sweep_runs_the_qwen_image_block_in_fp8():
    """benchmarks/fp8_block on a tiny block, eager (the GPU runs it compiled too): the FP8 model runs every
    case, near the bf16 one and not equal to it; a malformed case is one clear error."""
    from benchmarks import fp8_block

    cases = fp8_block.parse_cases("1:6,2:5:m")
    assert cases == [(1, 6, False), (2, 5, True)]
    result = fp8_block.block_sweep(D.local_device(), cases, tiny=True, grid=4, compile=False)
    for row in result.values():
        assert row["eager"] == "ok" and 0 < row["eager_mean_rel"] < 0.05, row
    assert result["2:5:m"]["text_rows"] == 10
    with pytest.raises(SystemExit, match="'2:x' is not REQUESTS:TEXT_TOKENS"):
        fp8_block.parse_cases("1:6,2:x")


def test_a_device_without_fp8_matmuls_fails_with_one_line_naming_it(monkeypatch):
    D.check_fp8_matmul(torch.device("cpu"))  # emulated: the tests run here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"device cuda:0 \(NVIDIA A100-SXM4-80GB\) has no FP8") as e:
        D.check_fp8_matmul(torch.device("cuda", 0))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    D.check_fp8_matmul(torch.device("cuda", 0))


# The stated rule per family: every linear layer of a block runs FP8 except these (by name in the block).
KEPT_BF16 = {
    "sd3": {"norm1.linear", "norm1_context.linear"},
    "qwen_image": {"img_mod.1", "txt_mod.1"},
    "qwen_image_edit": {"img_mod.1", "txt_mod.1"},
    "wan": set(),
    "flux": {"norm1.linear", "norm1_context.linear", "norm.linear"},  # double blocks; single blocks
}


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
@pytest.mark.parametrize(
    "family,fixture",
    [
        ("sd3", "tiny_sd3"),
        ("qwen_image", "tiny_qwen_image"),
        ("qwen_image_edit", "tiny_qwen_image_edit"),
        ("wan", "tiny_wan_ti2v"),
        ("wan", "tiny_wan_a14b"),
        ("flux", "tiny_flux"),
    ],
)
def test_each_family_keeps_its_stated_layers_in_bf16(family, fixture, request):
    """On each tiny family with a LoRA: inside the rollout the blocks' linear layers are FP8 stand-ins
    except the family's stated ones that the block has (FLUX's two block kinds have different ones) and the
    LoRA's own A / B (a LoRA layer's base runs FP8); nothing outside the blocks changes; after it every
    original layer is back."""
    adapter = get_adapter(family)(tiny_config(family, request.getfixturevalue(fixture)), torch.device("cpu"))
    assert set(adapter.fp8_keep_bf16) == KEPT_BF16[family]
    blocks = adapter.fsdp_units()
    linears = {id(m): m for m in adapter.policy.modules() if isinstance(m, nn.Linear)}
    fp8 = Fp8Rollout(blocks, adapter.fp8_keep_bf16)
    kept = set()
    with fp8.swapped():
        everywhere = [m for m in adapter.policy.modules() if isinstance(m, Float8Linear)]
        for block in blocks:
            names = {n: m for n, m in block.named_modules()}
            quantised = {
                n.removesuffix(".base_layer") for n, m in names.items() if isinstance(m, Float8Linear)
            }
            plain = {n for n, m in names.items() if isinstance(m, nn.Linear) and "lora_" not in n}
            lora_bases = {n.removesuffix(".base_layer") for n in names if n.endswith(".base_layer")}
            assert plain == KEPT_BF16[family] & set(names)
            kept |= plain
            assert quantised and not quantised & KEPT_BF16[family]
            assert lora_bases and lora_bases <= quantised  # the LoRA's frozen base runs FP8
            lora = [m for n, m in names.items() if n.endswith((".lora_A.default", ".lora_B.default"))]
            assert lora and all(type(m) is nn.Linear for m in lora)  # the LoRA branch stays as it is
        assert (
            len(everywhere)
            == len(fp8.layers)
            == sum(len([m for m in b.modules() if isinstance(m, Float8Linear)]) for b in blocks)
        )
    assert kept == KEPT_BF16[family]  # every stated layer is one the blocks have
    assert not any(isinstance(m, Float8Linear) for m in adapter.policy.modules())
    assert {id(m) for m in adapter.policy.modules() if isinstance(m, nn.Linear)} == set(linears)


STEPS = 4
KEY = SamplingParams(32, 32, STEPS, 4.5, 0.7, "sde", 2, (0, 4))


@pytest.fixture(scope="module")
def sd3(tiny_sd3):
    return get_adapter("sd3")(tiny_config("sd3", tiny_sd3), torch.device("cpu"))


def fp8_rollout(steps: str = "all", **rollout) -> RolloutConfig:
    """The rollout section of an FP8 engine of 4 requests a batch whose `steps` run FP8."""
    return RolloutConfig(max_num_seqs=4, precision="fp8", fp8=FP8Config(steps=steps), **rollout)


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
def test_fp8_rollout_is_close_to_bf16_and_leaves_the_policy_alone(sd3):
    """The FP8 rollout's samples are near the policy's own (same seeds) but not equal to them; the policy's
    weights are untouched; a LoRA run's frozen base is quantised once per run, its trainable layers (here
    made trainable to check) at every rollout."""
    requests = engine_requests([KEY] * 3)
    before = {n: p.detach().clone() for n, p in sd3.policy.named_parameters()}
    fp8_engine = DiffusionEngine(sd3, fp8_rollout())
    fp8, _, _ = run(fp8_engine, requests)
    reference, _, _ = run(DiffusionEngine(sd3, RolloutConfig(max_num_seqs=4)), requests)
    # A rollout's log-prob of its own step depends on its noise alone (the same seeds): the gap shows when
    # the trainer scores the FP8 transitions (test_correction_weights_...), not here.
    d_latents, _ = max_diffs(fp8, reference)
    print(f"fp8 vs fp32 rollout: latents {d_latents:.2e}")
    assert 1e-4 < d_latents < 0.5
    assert all(torch.equal(p, before[n]) for n, p in sd3.policy.named_parameters())
    stand_ins = fp8_engine.fp8.stand_ins
    frozen = [s.weight_q for s in stand_ins]
    again, _, _ = run(fp8_engine, requests)
    assert all(s.weight_q is w for s, w in zip(stand_ins, frozen))  # quantised once: the base is frozen
    assert max(max_diffs(again, fp8)) == 0
    with fp8_engine.in_bf16():  # the policy's own precision in the same engine
        assert max(max_diffs(run(fp8_engine, requests)[0], reference)) == 0
    # A trainable weight is quantised from its current value at every rollout, and dropped after it.
    layer, stand_in = fp8_engine.fp8.layers[0][2], stand_ins[0]
    layer.weight.requires_grad_(True)
    try:
        with torch.no_grad():
            layer.weight.mul_(2.0)
        run(fp8_engine, requests[:1])
        assert stand_in.weight_q is None  # not held through training
        with fp8_engine.fp8.swapped():
            assert torch.equal(stand_in.weight_q, quantise_rows(layer.weight.detach())[0])
        with torch.no_grad():
            layer.weight.div_(2.0)
    finally:
        layer.weight.requires_grad_(False)


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
def test_fp8_rollout_compiles_one_code_for_all_blocks(sd3, monkeypatch):
    """Compiled (dynamo's decisions, the 'eager' backend as in test_engine), the FP8 stand-ins compile
    once per block variant, not once per block, and a second rollout (the stand-ins loaded again) does not
    recompile."""
    monkeypatch.setattr(rollout_compiled, "COMPILE_BACKEND", "eager")
    start = counters["stats"]["unique_graphs"]
    engine = DiffusionEngine(sd3, fp8_rollout(compile=True))
    compiled, _, _ = run(engine, engine_requests([KEY] * 4))
    assert counters["stats"]["unique_graphs"] - start == 2  # the tiny SD3's two block variants
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, _, _ = run(engine, engine_requests([KEY] * 3))
    eager, _, _ = run(DiffusionEngine(sd3, fp8_rollout()), engine_requests([KEY] * 4))
    assert max(max_diffs(compiled, eager)) < 1e-5
    # FP8 on the untrained steps only: the blocks' code in both precisions, switched per step without
    # compiling again. The FP8 code is the one compiled above (dynamo's cache is the forward's); the bf16
    # one is new (unless an earlier test compiled it).
    start = counters["stats"]["unique_graphs"]
    engine = DiffusionEngine(sd3, fp8_rollout("untrained", compile=True))
    run(engine, engine_requests([KEY] * 4))
    assert counters["stats"]["unique_graphs"] - start <= 2
    first = engine_requests([dataclasses.replace(KEY, sde_window_range=(0, 2))] * 4)  # steps 0-1 trained
    with torch._dynamo.config.patch(error_on_recompile=True):
        run(engine, engine_requests([KEY] * 3))
        untrained, _, _ = run(engine, first)
    # Compiled too, the trained steps run the bf16 code: their records are a compiled bf16 rollout's.
    bf16, _, _ = run(DiffusionEngine(sd3, RolloutConfig(max_num_seqs=4, compile=True)), first)
    for a, b in zip(untrained, bf16):
        for field in ("latents", "next_latents", "logprobs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert (a.final_latents - b.final_latents).abs().max() > 1e-4


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
def test_fp8_on_untrained_steps_leaves_the_trained_ones_in_bf16(sd3):
    """rollout.fp8.steps untrained: a step that trains some row of the batch runs the policy's own layers,
    the others the FP8 stand-ins (counted on one layer). With every row's window at steps 0-1 the trained
    transitions and their log-probs equal a bf16 rollout's from the same seeds, bit for bit, while the
    final samples (steps 2-3 in FP8) do not; with windows drawn per row the FP8 steps are exactly those no
    row of the batch trains, and the weights are quantised once for the whole rollout."""
    first = dataclasses.replace(KEY, sde_window_range=(0, 2))
    requests = engine_requests([first] * 3)
    engine = DiffusionEngine(sd3, fp8_rollout("untrained"))
    (_, _, layer), stand_in = engine.fp8.layers[0], engine.fp8.stand_ins[0]
    calls = {"bf16": 0, "fp8": 0}

    def counter(key):
        return lambda *_: calls.__setitem__(key, calls[key] + 1)

    hooks = [layer.register_forward_hook(counter("bf16")), stand_in.register_forward_hook(counter("fp8"))]
    try:
        untrained, _, rows = run(engine, requests)
    finally:
        for h in hooks:
            h.remove()
    per_step = len(rows) // STEPS  # transformer forwards per step
    assert calls == {"bf16": 2 * per_step, "fp8": (STEPS - 2) * per_step}
    reference, _, _ = run(DiffusionEngine(sd3, RolloutConfig(max_num_seqs=4)), requests)
    everywhere, _, _ = run(DiffusionEngine(sd3, fp8_rollout()), requests)
    for a, b, c in zip(untrained, reference, everywhere):
        assert a.step_indices.tolist() == [0, 1]
        for field in ("latents", "next_latents", "logprobs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert (a.final_latents - b.final_latents).abs().max() > 1e-4  # steps 2-3 ran in FP8
        assert (c.logprobs - b.logprobs).abs().max() > 0 or (c.next_latents - b.next_latents).abs().max() > 0

    # Windows drawn per row: FP8 exactly at the steps no row of the batch trains.
    requests = engine_requests([KEY] * 2)
    switched = []
    use = engine.fp8.use
    loads = []
    load = Float8Linear.load

    def spy_load(self, linear):
        loads.append(self)
        return load(self, linear)

    engine.fp8.use = lambda fp8: (switched.append(fp8), use(fp8))[1]
    Float8Linear.load = spy_load
    try:
        layer.weight.requires_grad_(True)  # a trainable weight is quantised at every rollout: once each
        trajs, _, _ = run(engine, requests)
    finally:
        Float8Linear.load = load
        layer.weight.requires_grad_(False)
    trained = {int(i) for t in trajs for i in t.step_indices}
    expected = [i not in trained for i in range(STEPS)]
    assert any(expected) and not all(expected)
    assert switched == [True, *expected, False]  # entering the rollout, each step, leaving it
    assert loads == [stand_in]


@pytest.mark.slow  # a tiny model's rollout
def test_fp8_on_untrained_steps_refuses_a_loop_that_bypasses_the_sampler(sd3, monkeypatch):
    """A denoising loop that does not step through `sampler.steps()` would run its trained steps in FP8
    unnoticed: the engine stops after that batch with one line naming the adapter."""
    monkeypatch.setattr(flow_sde.WindowedSampler, "steps", lambda self: iter(range(self.num_steps)))
    engine = DiffusionEngine(sd3, fp8_rollout("untrained"))
    with pytest.raises(RuntimeError, match=r"SD3Adapter.rollout does not step through sampler.steps\(\)"):
        engine.generate(engine_requests([KEY]))
    assert not engine.fp8.active  # the original layers are back


def tiny_cfg(tiny_sd3, tmp_path, *overrides):
    return load_config(
        "sd3_tiny_flowgrpo",
        [
            "--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "out"),
            "--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--sampling.num_steps", "3",
            *overrides,
        ],
    )  # fmt: skip


def test_fp8_recomputes_old_logprobs_and_refuses_the_rollouts(tiny_sd3, tmp_path):
    """The trainer recomputes the old log-probs and corrects exactly when some trained step runs in FP8:
    rollout.fp8.steps all (the fp8 defaults override the recipe's old_logprob rollout only where the recipe
    does not set it: the tiny recipe sets it, so the command line must), not with fp8.steps untrained (the
    default: the trained steps run in bf16) nor in bf16; Sol-RL and DiffusionNFT explore in FP8 at every
    step."""
    fp8 = ("--rollout.precision", "fp8")
    untrained = tiny_cfg(tiny_sd3, tmp_path, *fp8)
    assert untrained.rollout.fp8.steps == "untrained"
    assert untrained.algo.old_logprob == "rollout" and untrained.algo.correction == "none"
    with pytest.raises(ConfigError, match="algo.old_logprob rollout: with rollout.precision fp8 and"):
        tiny_cfg(tiny_sd3, tmp_path, *fp8, "--rollout.fp8.steps", "all")
    cfg = tiny_cfg(tiny_sd3, tmp_path, *fp8, "--rollout.fp8.steps", "all", "--algo.old_logprob", "recompute")
    assert cfg.algo.correction == "tis"
    assert tiny_cfg(tiny_sd3, tmp_path).algo.old_logprob == "rollout"
    # Sol-RL trains on bf16 regenerations: the rollout's own log-probs are the trainer's.
    sol = tiny_cfg(tiny_sd3, tmp_path, *fp8, "--rollout.fp8.select", "1")
    assert sol.algo.old_logprob == "rollout" and sol.algo.correction == "none"
    assert sol.rollout.fp8.steps == "all"  # it explores in FP8 at every step
    for args, match in [
        (["--rollout.fp8.select", "1"], "rollout.fp8.select needs rollout.precision fp8"),
        ([*fp8, "--rollout.fp8.select", "2"], "fewer than rollout.group_size"),
        ([*fp8, "--rollout.fp8.select", "1", "--rollout.fp8.steps", "untrained"],
         "rollout.fp8.steps untrained: rollout.fp8.select explores"),
        ([*fp8, "--rollout.fp8.steps", "all", "--algo.old_logprob", "recompute",
          "--distributed.rollout_gather", "unit"], "needs distributed.rollout_gather phase"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            tiny_cfg(tiny_sd3, tmp_path, *args)


@pytest.mark.parametrize("setting", [None, "false"])
def test_fast_accumulation_reaches_every_fp8_gemm(tiny_sd3, tmp_path, monkeypatch, setting):
    """rollout.fp8.fast_accum (on unless the recipe turns it off) is the `use_fast_accum` of every scaled
    matmul the FP8 rollout's blocks run: the FP8 rollout of one request counted at the GEMM."""
    args = ("--rollout.fp8.fast_accum", setting) if setting else ()
    every_step = ("--rollout.fp8.steps", "all", "--algo.old_logprob", "recompute")
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.precision", "fp8", *every_step, *args)
    assert cfg.rollout.fp8.fast_accum == (setting is None)
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    assert ops.engine.fp8 is not None and ops.engine.fp8.stand_ins
    seen = []
    scaled_mm = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs["use_fast_accum"])
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    ops.engine.generate(ops.requests(load_prompts(cfg.data.train_path), 0, dist)[:1])
    # Every stand-in at each of the recipe's 3 steps (CFG fused: one forward a step).
    assert len(seen) >= cfg.sampling.num_steps * len(ops.engine.fp8.stand_ins)
    assert set(seen) == {setting is None}


def test_a_refused_fp8_gemm_names_the_batch_and_the_way_out(tiny_sd3, tmp_path, monkeypatch):
    """cuBLASLt refusing the FP8 GEMM of a batch (seen on an H200 for a compiled 2-request Qwen-Image batch)
    stops the rollout with one line naming the batch's size and rollout.precision bf16; any other error
    passes through as it is."""
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.precision", "fp8")
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    requests = ops.requests(load_prompts(cfg.data.train_path), 0, dist)[:2]

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(`"
        )

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.raises(RuntimeError, match=r"^FP8 rollout: cuBLASLt refused an FP8 GEMM of a batch of 2 req"):
        ops.engine.generate(requests)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="^other$"):
        ops.engine.generate(requests)


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
@pytest.mark.parametrize(
    "precision,level", [("fp8", "token"), ("fp8", "sequence"), ("bf16", "token"), ("fp8-untrained", "token")]
)
def test_correction_weights_apply_where_and_only_where_fp8_is_on(tiny_sd3, tmp_path, precision, level):
    """An update after an FP8 rollout of every step recomputes the old log-probs in the trainer's
    precision and passes each row's truncated ratio min(exp(old - rollout), C) (per row, or per sample at
    the sequence level) to the loss; after a rollout whose trained steps ran in the trainer's precision
    (bf16, or FP8 on the untrained steps only) the same recipe passes no weights, and the trainer's
    log-probs of the unchanged policy equal the rollout's."""
    steps = "untrained" if precision == "fp8-untrained" else "all"
    cfg = tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.precision", precision.removesuffix("-untrained"),
        "--rollout.fp8.steps", steps, "--algo.old_logprob", "recompute",
        "--algo.correction", "tis", "--algo.correction_level", level,
        "--algo.correction_threshold", "1.00002",
        "--model.gradient_checkpointing", "false",  # no auto probe: the spy below sees the update's rows
    )  # fmt: skip
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    assert ops.correct == (precision == "fp8")
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, ops.requests(load_prompts(cfg.data.train_path), 0, dist))
    pool.close()
    keep, _ = assign_advantages(cfg, trajs)
    keep[:] = True
    seen = []
    loss_fn = ops.loss_fn

    def spy(inputs, algo, normaliser):
        seen.append(inputs.is_weight)
        return loss_fn(inputs, algo, normaliser)

    ops.loss_fn = spy
    recomputed = []
    recompute = ops.recompute_old

    def spy_recompute(pairs, pad):
        out = recompute(pairs, pad)
        recomputed.extend(pairs)
        return out

    ops.recompute_old = spy_recompute
    opt = torch.optim.AdamW([p for p in ops.policy.parameters() if p.requires_grad], lr=1e-3)
    logs = update(cfg, ops, opt, trajs, keep, 0)
    assert recomputed and all(p.old is not None for p in recomputed)  # the recompute path ran
    gap = logs["consistency/logprob_abs_diff_max"]
    per_step = [logs[f"consistency/t{t:02d}/logprob_abs_diff_mean"] for t in range(2)]
    print(f"{precision}: trainer vs rollout gap max {gap:.2e}, per step {per_step}")
    if precision != "fp8":
        assert all(w is None for w in seen) and "correction/weight_mean" not in logs and gap < 1e-5
        return
    assert gap > 2e-5  # the FP8 rollout's log-probs are not the trainer's
    weights = torch.tensor([p.is_weight for p in recomputed])
    log_rho = torch.tensor([p.old - float(p.traj.logprobs[p.k]) for p in recomputed], dtype=torch.float64)
    if level == "sequence":
        sums = {}
        for p, lr in zip(recomputed, log_rho.tolist()):
            sums[id(p.traj)] = sums.get(id(p.traj), 0.0) + lr
        log_rho = torch.tensor([sums[id(p.traj)] for p in recomputed], dtype=torch.float64)
    expected = torch.exp(log_rho.clamp(max=math.log(1.00002)))
    assert torch.allclose(weights.double(), expected, rtol=1e-6)
    assert (weights < 1).any() and (log_rho > math.log(1.00002)).any()  # some below 1, some truncated at C
    passed = torch.cat([w for w in seen if w is not None])
    assert sorted(passed.tolist()) == pytest.approx(sorted(weights.tolist()))
    assert logs["correction/clip_frac"] > 0 and logs["correction/weight_mean"] < 1.00002


@pytest.mark.slow  # tiny models and their rollouts: more than a few seconds on 2 cores
def test_sol_rl_regenerates_the_best_and_worst_in_bf16_from_the_same_seeds(tiny_sd3, tmp_path):
    """Sol-RL: of each FP8 group the best and the worst sample are generated again in the policy's
    precision from the same requests: equal to a bf16 rollout of those requests, unlike the FP8 ones."""
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.precision", "fp8", "--rollout.fp8.select", "1")
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, ops.params)
    pool = RewardPool(cfg.reward.weights, 1, 60)
    explored, _ = rollout_and_score(ops, pool, requests)
    stats: dict[str, float] = {}
    trajs, per_reward = regenerate_selected(ops, pool, explored, 1, stats)
    pool.close()
    expect = []
    for g in {t.request.group_id for t in explored}:
        ranked = sorted((t for t in explored if t.request.group_id == g), key=lambda t: t.reward)
        expect += [ranked[0].request.index, ranked[-1].request.index]
    assert [t.request.index for t in trajs] == sorted(expect) and len(trajs) == 4
    assert len(per_reward["jpeg_compressibility"]) == 4 and all(math.isfinite(t.reward) for t in trajs)
    assert stats["time/regenerate_s"] > 0 and math.isfinite(stats["rollout/explore_reward_mean"])
    bf16 = DiffusionEngine(ops.adapter, RolloutConfig(max_num_seqs=32)).generate([t.request for t in trajs])
    assert max(max_diffs(trajs, bf16)) == 0
    fp8 = [t for t in explored if t.request.index in expect]
    assert max(max_diffs(fp8, bf16)) > 1e-4


def test_flow_losses_weight_the_policy_term_by_the_correction():
    """flow_grpo and flow_dppo multiply each row's policy term (not its KL) by its correction weight;
    weights of 1 change nothing."""
    from omnirl.algos.losses import RowInputs, flow_dppo_loss, flow_grpo_loss
    from omnirl.config import AlgoConfig, FlowDPPOConfig

    torch.manual_seed(2)
    lp, old, adv = torch.randn(6) * 1e-3, torch.randn(6) * 1e-3, torch.randn(6)
    w, c, kl = torch.tensor([1.0, 1, 1, 1, 1, 0]), torch.tensor([0.5, 1, 2, 0.9, 1.1, 3]), torch.rand(6)
    algo = AlgoConfig(clip_range=1e-3, kl_beta=0.1)
    base, _ = flow_grpo_loss(RowInputs(lp, old, adv, w, kl=kl), algo, 5.0)
    weighted, _ = flow_grpo_loss(RowInputs(lp, old, adv, w, kl=kl, is_weight=c), algo, 5.0)
    ratio = torch.exp(lp - old)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-3, 1 + 1e-3))
    assert weighted.item() == pytest.approx(((w * c * policy).sum() + 0.1 * (w * kl).sum()).item() / 5.0)
    assert base.item() == pytest.approx(((w * policy).sum() + 0.1 * (w * kl).sum()).item() / 5.0)
    ones, _ = flow_grpo_loss(RowInputs(lp, old, adv, w, kl=kl, is_weight=torch.ones(6)), algo, 5.0)
    assert ones.item() == base.item()
    d = torch.zeros(6)  # inside the trust region: nothing masked, the policy term is -A r
    dppo, _ = flow_dppo_loss(
        RowInputs(lp, old, adv, w, is_weight=c, divergence=d),
        AlgoConfig(flow_dppo=FlowDPPOConfig(tau=1e-5)),
        5.0,
    )
    assert dppo.item() == pytest.approx((w * c * -adv * ratio).sum().item() / 5.0)


@pytest.mark.parametrize("spec", ["2:compiled:fp8", "2:fp8:untrained:exact", "2:split"])
def test_every_benchmark_cell_builds_the_engine_its_options_name(sd3, spec):
    """A benchmark cell's engine (the one `rollout_packing`'s timed cells and its --interleave pairs both
    build) has the precision, FP8 steps and accumulation its spec names: an FP8 cell never times bf16."""
    from benchmarks.packing_cells import parse_cell

    cell = parse_cell(spec)
    engine = cell.engine(sd3)
    assert engine.pad == cell.compile and (engine.fp8 is not None) == ("fp8" in spec)
    if engine.fp8 is not None:
        assert engine.fp8_untrained_only == ("untrained" in spec)
        assert {s.fast_accum for s in engine.fp8.stand_ins} == {"exact" not in spec}
