"""The update's speed settings on the tiny SD3: `model.gradient_checkpointing: auto` decides from measured
memory and changes nothing but memory, `train.compile` computes what the eager update does and does not
recompile from one step to the next, and micro-batches are bucketed for it."""

import copy

import pytest
import torch
from torch import nn

from omnirl import autotune, memory
from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.batching import make_requests
from omnirl.config import RECIPE_DIR
from omnirl.data.prompts import load_prompts
from omnirl.models import get_adapter
from omnirl.ops.diffusion import DiffusionOps, Pair, micro_batches, sampling_params
from omnirl.recipe import load_config, load_recipe
from omnirl.rewards.pool import RewardPool
from omnirl.rollout import compiled
from omnirl.scoring import rollout_and_score
from omnirl.step import UpdateTuning, update

GIB = 2**30


def test_decide_keeps_checkpointing_off_only_where_the_update_fits():
    # 10 GiB peak + 2 GiB of optimizer state + a 4 GiB margin (5% of 80) against what is free.
    fits = autotune.decide(10 * GIB, 20 * GIB, 2 * GIB, 80 * GIB, 8)
    tight = autotune.decide(10 * GIB, 15 * GIB, 2 * GIB, 80 * GIB, 8)
    oom = autotune.decide(None, 100 * GIB, 0, 80 * GIB, 8)
    assert not fits.on and tight.on and oom.on
    assert "10.00 GiB" in fits.reason and "20.00 GiB free" in fits.reason
    assert "ran out of device memory" in oom.reason
    # The line through the peaks of one and two rows predicts eight.
    assert autotune.predicted_peak({1: 5 * GIB, 2: 6 * GIB}, 8) == 12 * GIB
    assert autotune.predicted_peak({1: 5 * GIB}, 1) == 5 * GIB


def test_sleep_decision_keeps_on_the_device_only_what_fits():
    groups = {"offload": 10 * GIB, "optimizer": 1 * GIB, "reference": 0}
    # 80 GiB device, 4 GiB margin: update 30 + 10 fits, rollout 76 + 1 does not.
    awake, reason = autotune.sleep_decision(76 * GIB, 30 * GIB, groups, 80 * GIB)
    assert awake == {"offload"}
    assert "update peak 30.00 GiB" in reason and "10.00 GiB" in reason and "margin 4.00 GiB" in reason
    assert autotune.sleep_decision(30 * GIB, 30 * GIB, groups, 80 * GIB)[0] == {
        "offload",
        "optimizer",
        "reference",
    }
    assert autotune.sleep_decision(30 * GIB, 70 * GIB, groups, 80 * GIB)[0] == {"optimizer", "reference"}


class _Ops:
    """What `memory.Phases` reads of a kind's ops: a rollout-only module, no engine, no reference copy."""

    sleepable = None
    ref_model = None

    def __init__(self):
        self.encoder = nn.Linear(256, 256)

    def offload_modules(self):
        return [self.encoder]


class _Rewards:
    def modules(self):
        return []


def _step(phases: memory.Phases, policy: nn.Module, optimizer) -> dict[str, float]:
    with phases.rollout() as stats:
        pass
    with phases.train(stats):
        policy(torch.randn(2, 64)).sum().backward()
        optimizer.step()
    return stats


# With a 2 GiB margin: 1.5 GiB reserved + the margin fits 3.6 GiB, not 3.2; the 1.0 GiB allocated would fit
# 3.2 too, so the 3.2 case shows that the decision reads the reservation.
@pytest.mark.parametrize("device_gib, kept", [(80, True), (3.6, True), (3.2, False), (1e-6, False)])
def test_auto_sleep_keeps_groups_on_the_device_from_step_1_where_they_fit(monkeypatch, device_gib, kept):
    monkeypatch.setattr(memory, "device_bytes", lambda device: int(device_gib * GIB))
    cpu = torch.device("cpu")
    policy = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(policy.parameters())
    ops = _Ops()
    phases = memory.Phases(memory.Sleeper(cpu, chunk_bytes=4096), optimizer, ops, _Rewards())
    auto = autotune.AutoSleep("auto", phases, cpu)
    weight = ops.encoder.weight.detach().clone()
    assert phases.after_train == auto.decide
    with phases.rollout() as stats:  # step 0 sleeps as true
        # What a GPU's allocator reports; the reservation (fragmentation included) is what counts.
        stats |= {"mem/rollout_peak_gib": 1.0, "mem/train_peak_gib": 1.0}
        stats |= {"mem/rollout_reserved_gib": 1.5, "mem/train_reserved_gib": 1.5}
    with phases.train(stats):
        policy(torch.randn(2, 64)).sum().backward()
        optimizer.step()
        assert stats["mem/train_sleep_gib"] > 0 and phases.sleeper.is_asleep("offload")
    assert phases.after_train is None  # decided at the end of step 0's train phase
    assert phases.awake == ({"offload", "optimizer", "reference"} if kept else set())
    for _ in range(2):
        stats = _step(phases, policy, optimizer)
        assert (stats["mem/rollout_sleep_gib"] == 0) == kept  # AdamW's state
        assert (stats["mem/train_sleep_gib"] == 0) == kept  # the encoder
        assert phases.sleeper.is_asleep("offload") != kept
    # Where every group stays, no sleep will need the pinned host chunks again: they go back.
    assert (phases.sleeper.host_bytes == 0) == kept and (stats["mem/host_gib"] == 0) == kept
    with phases.rollout():
        assert torch.equal(ops.encoder.weight, weight)  # awake and bit-exact either way


# The recipes that force gradient checkpointing, each for a measurement (docs/update.md): the thinker's
# update does not fit without it.
FORCED_CHECKPOINTING = {"mmk12": True, "mmk12_tiny": True}


def test_recipes_force_checkpointing_only_where_measured():
    """Every other shipped recipe leaves model.gradient_checkpointing at auto, which decides from the
    update's measured memory; a recipe that forces it by habit slows its update where memory would allow."""
    forced = {}
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        value = load_recipe(path.stem)[0].model.gradient_checkpointing
        if value != "auto":
            forced[path.stem] = value
    assert forced == FORCED_CHECKPOINTING


def test_checkpointing_values_parse_from_recipe_and_command_line(tmp_path):
    assert load_config("sd3_tiny_flowgrpo", []).model.gradient_checkpointing == "auto"
    for args, want in (
        (["--model.gradient_checkpointing", "false"], False),
        (["--model.gradient_checkpointing", "true"], True),
        (["--model.gradient_checkpointing"], True),
        (["--model.gradient_checkpointing=auto"], "auto"),
    ):
        assert load_config("sd3_tiny_flowgrpo", args).model.gradient_checkpointing == want, args
    # The recipe's own value; its model path is a folder the quickstart builds: any folder stands in.
    assert load_config("mmk12_tiny", ["--model.path", str(tmp_path)]).model.gradient_checkpointing is True


def test_set_checkpointing_finds_every_kind_of_block_owner():
    class Port(nn.Module):  # BAGEL's port: a flag of its own
        def __init__(self):
            super().__init__()
            self.gradient_checkpointing = False
            self.layer = nn.Linear(2, 2)

    port = nn.ModuleDict({"a": Port(), "b": Port()})  # held in a container, as Wan A14B's experts are
    autotune.set_checkpointing(port, True)
    assert all(m.gradient_checkpointing is True for m in port.values())
    with pytest.raises(TypeError, match="no checkpointing"):
        autotune.set_checkpointing(nn.Linear(2, 2), True)


def test_micro_batches_are_bucketed_for_a_compiled_update():
    pad = object()
    pairs = [Pair(pad, 0, 1.0) for _ in range(11)]  # pyright: ignore[reportArgumentType]
    plain = micro_batches(pairs, 4, pad)  # pyright: ignore[reportArgumentType]
    bucketed = micro_batches(pairs, 4, pad, bucket=True)  # pyright: ignore[reportArgumentType]
    assert [len(mb) for mb in plain] == [4, 4, 3]
    assert [len(mb) for mb in bucketed] == [4, 4, 4]
    assert [p.weight for p in bucketed[-1]] == [1.0, 1.0, 1.0, 0.0]  # the padding row weighs nothing


def rollout(tiny_sd3, tmp_path, *overrides, stats=None):
    cfg = load_config(
        "sd3_tiny_flowgrpo",
        ["--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "out"),
         "--rollout.prompts_per_step", "2", "--rollout.group_size", "3", "--optim.micro_batch_size", "4",
         *overrides],
    )  # fmt: skip
    dist = D.init_distributed()
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, dist.device)
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, sampling_params(cfg))
    pool = RewardPool(cfg.reward.weights, 1, 60)
    ops = DiffusionOps(cfg, adapter)
    trajs, _ = rollout_and_score(ops, pool, requests, stats)
    pool.close()
    adv, keep, _ = group_advantages(
        torch.tensor([t.reward for t in trajs]), torch.tensor([t.request.group_id for t in trajs]), 5.0, False
    )
    for t, a in zip(trajs, adv.tolist()):
        t.advantage = a
    return cfg, ops, trajs, keep


def updated(cfg, ops, trajs, keep, steps=1, tuning=None):
    """The LoRA after `steps` updates on the same samples, from the same start; the last update's metrics."""
    policy = ops.policy
    start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    tuning = tuning or UpdateTuning(cfg, ops)
    for step in range(steps):
        logs = update(cfg, ops, opt, copy.deepcopy(trajs), keep, step, tuning)
    after = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for n, p in policy.named_parameters():
            p.copy_(start[n])
    return after, logs


@pytest.mark.slow
def test_auto_checkpointing_decides_by_measured_memory_and_changes_no_result(tiny_sd3, tmp_path, monkeypatch):
    stats = {}  # the rollout's memory check, measured on CPU within a budget, logged as its own part
    cfg, ops, trajs, keep = rollout(
        tiny_sd3, tmp_path, "--algo.kl_beta", "0.04", "--rollout.memory_budget_gib", "1", stats=stats
    )
    assert 0 < stats["time/memory_probe_s"] < stats["time/generate_s"] and stats["time/vae_decode_s"] > 0
    assert cfg.model.gradient_checkpointing == "auto"
    policy = ops.policy
    assert not policy.is_gradient_checkpointing  # built without it: the first update decides

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 50)  # everything fits: off
    off, logs_off = updated(cfg, ops, trajs, keep)
    assert logs_off["train/gradient_checkpointing"] == 0.0 and not policy.is_gradient_checkpointing
    assert logs_off["time/train_memory_probe_s"] > 0  # the probe, timed apart from the update's forward

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 10)  # nothing fits: on
    on, logs_on = updated(cfg, ops, trajs, keep)
    assert logs_on["train/gradient_checkpointing"] == 1.0 and policy.is_gradient_checkpointing

    # Neither the probe nor checkpointing changes the update: the same LoRA as with checkpointing
    # turned off by hand (the probe's gradients are dropped and the random state is restored).
    autotune.set_checkpointing(policy, False)
    plain, _ = updated(cfg, ops, trajs, keep, tuning=UpdateTuning(load_config(
        "sd3_tiny_flowgrpo", ["--model.path", str(tiny_sd3), "--model.gradient_checkpointing", "false",
                              "--algo.kl_beta", "0.04"]
    ), ops))  # fmt: skip
    for n in plain:
        torch.testing.assert_close(off[n], plain[n], rtol=0, atol=1e-6)
        torch.testing.assert_close(on[n], plain[n], rtol=0, atol=1e-6)
    assert any(not torch.equal(plain[n], p.detach()) for n, p in policy.named_parameters() if n in plain)
    for part in ("forward", "backward", "optimizer", "kl_reference"):
        assert logs_off[f"time/train_{part}_s"] > 0


@pytest.mark.slow
def test_compiled_update_equals_eager_and_compiles_once(tiny_sd3, tmp_path, monkeypatch):
    # The "eager" backend: dynamo's graphs without inductor's slow CPU code generation (what recompiles is
    # decided by dynamo's guards before any backend runs).
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    cfg, ops, trajs, keep = rollout(
        tiny_sd3, tmp_path, "--model.gradient_checkpointing", "false", "--algo.kl_beta", "0.04"
    )  # the KL reference pass (LoRA off) compiles too
    eager, _ = updated(cfg, ops, trajs, keep, steps=2)
    cfg_c = copy.deepcopy(cfg)
    cfg_c.train.compile = True
    ops.cfg = cfg_c
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    tuning = UpdateTuning(cfg_c, ops)
    _, logs = updated(cfg_c, ops, trajs, keep, steps=1, tuning=tuning)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "nothing ran compiled"
    compiled_lora, _ = updated(cfg_c, ops, trajs, keep, steps=2, tuning=tuning)  # steps 0 and 1 again
    assert counters["stats"]["unique_graphs"] == graphs, "a later step compiled again"
    for n in eager:
        torch.testing.assert_close(compiled_lora[n], eager[n], rtol=0, atol=1e-5)
    # The swap is undone after the update: the rollout and anything else run the plain forwards.
    assert all("forward" not in vars(m) for m, _ in tuning.compiled)


@pytest.mark.slow
def test_kl_reference_pass_collates_no_embeddings_of_its_own(tiny_sd3, tmp_path, monkeypatch):
    """The KL reference pass (LoRA off) reads the micro-batch's inputs the policy's forward built: an
    update with algo.kl_beta > 0 collates each micro-batch's text embeddings as often as one without."""
    cfg, ops, trajs, keep = rollout(
        tiny_sd3, tmp_path, "--model.gradient_checkpointing", "false", "--algo.kl_beta", "0.04"
    )
    calls = []
    collate = ops.adapter.batch_embeds
    monkeypatch.setattr(ops.adapter, "batch_embeds", lambda *a, **k: calls.append(1) or collate(*a, **k))
    _, logs = updated(cfg, ops, trajs, keep)
    with_kl = len(calls)
    assert with_kl > 0 and logs["time/train_kl_reference_s"] > 0  # the reference pass ran
    cfg0 = copy.deepcopy(cfg)
    cfg0.algo.kl_beta = 0.0
    ops.cfg = cfg0
    calls.clear()
    _, logs0 = updated(cfg0, ops, trajs, keep)
    assert "time/train_kl_reference_s" not in logs0 or logs0["time/train_kl_reference_s"] == 0
    assert len(calls) == with_kl


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fp8_frozen_linear_forward_and_activation_gradient_within_fp8_rounding():
    from omnirl.train_fp8 import Float8FrozenLinear

    torch.manual_seed(0)
    linear = nn.Linear(256, 128).requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    fp8 = Float8FrozenLinear(linear)
    y = fp8(x)
    g = torch.randn_like(y)
    y.backward(g)
    x64 = x.detach().double().requires_grad_()
    y64 = nn.functional.linear(x64, linear.weight.double(), linear.bias.double())
    y64.backward(g.double())
    assert x.grad is not None and x64.grad is not None
    # e4m3 keeps 3 mantissa bits: each product is off by up to 1/16, a 256-long sum by a few percent.
    for got, want in ((y, y64), (x.grad, x64.grad)):
        assert 1e-4 < rel(got, want) < 0.06  # quantised (not the bf16 path), within FP8 rounding
    # The frozen weight gets no gradient, and a zero (padding) row stays zero.
    assert linear.weight.grad is None
    torch.testing.assert_close(fp8(torch.zeros(2, 256)), linear.bias.expand(2, -1))


@pytest.mark.slow
def test_fp8_update_runs_the_frozen_base_in_fp8_and_trains_the_lora(tiny_sd3, tmp_path):
    from omnirl.ops.diffusion import pair_logprob
    from omnirl.train_fp8 import Float8FrozenLinear

    cfg, ops, trajs, keep = rollout(tiny_sd3, tmp_path, "--model.gradient_checkpointing", "false")
    policy = ops.policy
    fp8_cfg = copy.deepcopy(cfg)
    fp8_cfg.train.precision = "fp8"
    tuning = UpdateTuning(fp8_cfg, ops)
    assert tuning.fp8 is not None and tuning.fp8.layers
    assert all(not linear.weight.requires_grad for _, _, linear in tuning.fp8.layers)  # the base only
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    with torch.no_grad():
        ref = pair_logprob(ops.adapter, pairs, ops.params).mean
        with tuning.running():
            assert sum(isinstance(m, Float8FrozenLinear) for m in policy.modules()) == len(tuning.fp8.layers)
            got = pair_logprob(ops.adapter, pairs, ops.params).mean
    assert not any(isinstance(m, Float8FrozenLinear) for m in policy.modules())  # put back after
    # The step's mean through the FP8 base against the fp32 one: within FP8 rounding, and not equal.
    assert 1e-5 < rel(got, ref) < 0.05
    ops.cfg = fp8_cfg
    fp8_lora, logs = updated(fp8_cfg, ops, trajs, keep, tuning=tuning)
    ops.cfg = cfg
    plain, _ = updated(cfg, ops, trajs, keep)
    names = list(plain)
    moved = [n for n in names if not torch.equal(fp8_lora[n], dict(policy.named_parameters())[n].detach())]
    assert moved, "the FP8 update trained nothing"
    # One AdamW step from the same start moves each LoRA tensor in nearly the same direction.
    start = dict(policy.named_parameters())
    cos = [
        nn.functional.cosine_similarity(
            (fp8_lora[n] - start[n].detach()).flatten(), (plain[n] - start[n].detach()).flatten(), dim=0
        ).item()
        for n in moved
    ]
    assert min(cos) > 0.9, cos
