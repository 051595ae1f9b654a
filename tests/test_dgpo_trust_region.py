"""DGPO's trust region around an EMA copy of the trained weights, against its reference's definition
(Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py with config/dgpo_wocfg_emaref.py: `clip_dsm`, `clip_kl`,
`use_ema_ref`, `switch_ema_ref`, and `flow_grpo/ema.py`'s `EMAModuleWrapper.step` with the decay
min(0.3, 0.001 * global_step))."""

import pytest
import torch

from omnirl import distributed as D
from omnirl.algos.losses import DGPOInputs, check_dgpo, dgpo_loss, dgpo_margin
from omnirl.config import AlgoConfig, DGPOConfig
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.ops.dgpo import DGPOOps
from omnirl.ops.diffusion import DiffusionOps
from omnirl.recipe import load_config
from tests.support_compare import prompt_requests


def _reference_trust_region_loss(model_v, ema_v, ref_v, target_v, adv, group_ids, cfg):
    """The reference's loss at one time (one process): with use_ema_ref the margins compare with the EMA
    copy's velocity (`ref_dgpo_v = old_v`); with clip_dsm a row whose ratio exp(-dsm + old_dsm) is past
    1 + clip_range (A > 0) or below 1 - clip_range (A <= 0) keeps its dsm value but not its gradient; the
    KL term (beta, against the LoRA off) likewise with clip_kl."""
    beta_dpo, group_size, clip_range, kl_beta, clip_kl = cfg
    batch = model_v.shape[0]
    dsm = (target_v - model_v).square().reshape(batch, -1).mean(dim=1)
    old_dsm = (target_v - ema_v).square().reshape(batch, -1).mean(dim=1)
    ratio = torch.exp(-dsm + old_dsm)
    should_clip = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dsm = torch.where(should_clip, dsm.detach(), dsm)
    # compute_group_dgpo_loss_allreduce(model_v, ref_dgpo_v = ema_v, ..., dsm_loss = dsm)
    ref_dsm = (target_v - ema_v).square().reshape(batch, -1).mean(dim=1)
    term = adv * beta_dpo * (dsm.detach() - ref_dsm.detach()) / group_size
    sums = torch.zeros(int(group_ids.max()) + 1, dtype=term.dtype).scatter_add_(0, group_ids, term)
    loss = (torch.sigmoid(sums)[group_ids].detach() * adv * dsm).mean()
    kl = (model_v - ref_v).square().reshape(batch, -1).mean(dim=1)
    if clip_kl:
        kl = torch.where(should_clip, kl.detach(), kl)
    return loss + kl_beta * kl.mean(), should_clip


@pytest.mark.parametrize("clip_kl", [False, True])
def test_trust_region_loss_equals_its_reference_over_micro_batches(clip_kl):
    """Three groups of 4 rows over two micro-batches: rows of both advantage signs on both sides of the
    clip range; the loss, its gradient and the clipped fraction equal the reference's."""
    gen = torch.Generator().manual_seed(1)
    groups, size, shape, beta, clip_range, kl_beta = 3, 4, (2, 4, 4), 2000.0, 1e-3, 0.01
    n = groups * size
    group_ids = torch.arange(groups).repeat_interleave(size)
    target = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    ref_v = target + 0.3 * torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    ema_v = target + 0.1 * torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    # Per group: a row that moved towards the target (A > 0: clipped), one that moved away (A < 0:
    # clipped), one that moved away with A > 0 (the ratio falls: not clipped), one close to the copy.
    move = torch.tensor([0.3, -0.3, -0.3, 0.0] * groups, dtype=torch.float64).reshape(n, 1, 1, 1)
    near = 0.001 * torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    base = ema_v + move * (target - ema_v) + near
    adv = torch.tensor([1.5, -0.5, 1.2, -0.7] * groups, dtype=torch.float64)
    ref_grad = base.clone().requires_grad_(True)
    expected, should_clip = _reference_trust_region_loss(
        ref_grad, ema_v, ref_v, target, adv, group_ids, (beta, size, clip_range, kl_beta, clip_kl)
    )
    expected.backward()
    assert 0 < int(should_clip.sum()) < n and bool(should_clip[adv > 0].any() and should_clip[adv < 0].any())

    ours = base.clone().requires_grad_(True)
    margins = dgpo_margin(
        ours, ema_v, target, adv, beta, size
    )  # algo.dgpo.ema_ref: the copy is the reference
    weight = torch.sigmoid(torch.zeros(groups, dtype=torch.float64).index_add(0, group_ids, margins.double()))
    algo = AlgoConfig(
        loss="dgpo",
        kl_beta=kl_beta,
        clip_range=clip_range,
        dgpo=DGPOConfig(trust_region=True, clip_kl=clip_kl),
    )
    total, clipped = torch.zeros((), dtype=torch.float64), 0.0
    for idx in (torch.arange(0, n, 2), torch.arange(1, n, 2)):  # micro-batches that split every group
        inputs = DGPOInputs(
            ours[idx], target[idx], adv[idx], weight[group_ids[idx]], torch.ones(len(idx)),
            ref_velocity=ref_v[idx], ema_velocity=ema_v[idx],
        )  # fmt: skip
        loss, metrics = dgpo_loss(inputs, algo, float(n))
        loss.backward()
        total, clipped = total + loss.detach(), clipped + metrics["loss/clip_count"]
    assert torch.allclose(total.float(), expected.detach().float(), rtol=1e-6, atol=1e-9), (total, expected)
    assert ours.grad is not None and ref_grad.grad is not None
    torch.testing.assert_close(ours.grad, ref_grad.grad, rtol=1e-5, atol=1e-9)
    assert clipped == float(should_clip.sum())
    # A clipped row with an advantage but no KL gradient has none at all (clip_kl), else only the KL's.
    row = int(torch.nonzero(should_clip)[0])
    assert (ours.grad[row].abs().max() == 0) == clip_kl


def test_clip_kl_needs_the_trust_region():
    with pytest.raises(ConfigError, match="algo.dgpo.clip_kl"):
        check_dgpo(AlgoConfig(loss="dgpo", dgpo=DGPOConfig(clip_kl=True)))


@pytest.fixture
def ops(tiny_sd3, tmp_path):
    overrides = [
        "--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "out"),
        "--algo.dgpo.trust_region", "true", "--algo.dgpo.ema_rollout_after", "2",
    ]  # fmt: skip
    cfg = load_config("sd3_tiny_dgpo", overrides)
    dist = D.init_distributed()
    return DGPOOps(cfg, get_adapter("sd3")(cfg, dist.device))


@pytest.mark.slow
def test_ema_copy_follows_every_optimizer_step_as_the_reference(ops, monkeypatch):
    """EMAModuleWrapper.step with decay min(0.3, 0.001 s) after each optimizer step s: ema += (1 - d)
    (theta - ema); another optimizer's step leaves it; the rollout samples with it once more than
    algo.dgpo.ema_rollout_after steps were taken; it is the run's state."""
    params = ops.trainable()
    ops.ema()  # made before the first optimizer step, as update_rows does
    expected = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.5)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
    gen = torch.Generator().manual_seed(0)
    state = ops.state()
    assert set(state) == {"dgpo_optimizer_steps"} | {
        f"dgpo_ema.{n}" for n, p in ops.policy.named_parameters() if p.requires_grad
    }
    assert ops.step_params(0).lora == "policy"
    for step in [0, 1, 2, 299, 300, 450]:  # the decay's growth and its cap at 0.3
        state["dgpo_optimizer_steps"].fill_(step)  # as a resumed run's state
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        other.param_groups[0]["params"][0].grad = torch.ones(3)
        other.step()
        decay = min(0.3, 0.001 * step)
        for e, p in zip(expected, params):
            e.add_((1 - decay) * (p.detach() - e))
        for e, mine in zip(expected, ops.ema()):
            torch.testing.assert_close(mine, e, rtol=0, atol=1e-6)
        assert int(ops.state()["dgpo_optimizer_steps"]) == step + 1
    assert max((p - e).abs().max().item() for p, e in zip(params, ops.ema())) > 1e-3  # a lagging copy
    assert ops.step_params(0).lora == "ema"
    # The rollout runs with the copy's weights swapped in, and the policy's are back after it.
    before = [p.detach().clone() for p in params]
    monkeypatch.setattr(DiffusionOps, "generate", lambda self, requests, on_done: [p.clone() for p in params])
    inside = ops.generate(prompt_requests(ops.step_params(0), ["a cat"], [""]), None)
    for seen, e, p, b in zip(inside, ops.ema(), params, before):
        assert torch.equal(seen, e) and torch.equal(p, b)


@pytest.mark.slow
def test_tiny_dgpo_with_the_trust_region_under_torchrun_fsdp(tiny_sd3, tmp_path):
    """sd3_tiny_dgpo with every setting of the EMA copy on 2 ranks (FSDP2: the copy's values swapped into
    sharded parameters): it trains, logs the clipped fraction and the copy's decay, the second step samples
    with the copy, and the copy is saved with the checkpoint."""
    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    r = torchrun(
        2, ROOT / "yaml/sd3_tiny_dgpo.yaml", "--model.path", str(tiny_sd3), "--run.output_dir", str(out),
        "--run.steps", "2", "--log.image_every", "0", "--algo.dgpo.trust_region", "true",
        "--algo.dgpo.ema_ref", "true", "--algo.dgpo.clip_kl", "true", "--algo.kl_beta", "0.01",
        "--algo.dgpo.ema_rollout_after", "0", "--checkpoint.every", "2",
    )  # fmt: skip
    assert "Traceback" not in r.stderr
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["train/updates"] == 1 and m["train/grad_norm"] > 0 and 0 <= m["loss/clip_frac"] <= 1
        assert m["dgpo/ema_decay"] == pytest.approx(0.001 * (m["step"] + 1))  # after step + 1 optimizer steps
        assert 0 < m["dgpo/group_weight"] < 1
    from tests.test_checkpoint_resume import dcp_keys

    keys = dcp_keys(out / "checkpoints/step_000002")
    lora = {k.removeprefix("model.") for k in keys if k.startswith("model.") and "lora_" in k}
    ema = {k.removeprefix("extra.dgpo_ema.") for k in keys if k.startswith("extra.dgpo_ema.")}
    assert ema == lora and lora and "extra.dgpo_optimizer_steps" in keys  # every LoRA tensor, by its name
