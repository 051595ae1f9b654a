"""The trainer end to end on the tiny SD3: updates move only the LoRA, the recipe runs under torchrun with
FSDP2, and a rank whose groups all have zero spread neither hangs nor biases the gradient."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.batching import make_requests
from omnirl.data.prompts import load_prompts, step_prompt_indices
from omnirl.distributed import derive_seed
from omnirl.models import get_adapter
from omnirl.ops import check_before_loading
from omnirl.ops.diffusion import DiffusionOps, Pair, pair_logprob, sampling_params
from omnirl.ops.nft import NFTOps
from omnirl.recipe import load_config
from omnirl.rewards.pool import RewardPool
from omnirl.scoring import rollout_and_score
from omnirl.step import assign_advantages, update

ROOT = Path(__file__).resolve().parent.parent


def tiny_cfg(tiny_sd3, tmp_path, *overrides):
    return load_config(
        "sd3_tiny_flowgrpo",
        ["--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "out"), *overrides],
    )


@pytest.mark.slow
def test_update_moves_lora_only_and_recomputed_logprobs_match(tiny_sd3, tmp_path):
    cfg = tiny_cfg(tiny_sd3, tmp_path, "--rollout.prompts_per_step", "2", "--rollout.group_size", "4")
    dist = D.init_distributed()
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, dist.device)
    rows = load_prompts(cfg.data.train_path)
    requests, _ = make_requests(cfg, rows, 0, dist, sampling_params(cfg))
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(DiffusionOps(cfg, adapter), pool, requests)
    pool.close()

    # For the unchanged policy the trainer's recomputed log-prob equals the rollout's (fp32, 1e-5).
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    with torch.no_grad():
        lp = pair_logprob(adapter, pairs, trajs[0].request.params).logprob
    rollout_lp = torch.stack([p.traj.logprobs[p.k] for p in pairs])
    diff = (lp - rollout_lp).abs()
    print(f"recompute vs rollout log-prob: mean |diff| {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.max() < 1e-5

    adv, keep, _ = group_advantages(
        torch.tensor([t.reward for t in trajs]), torch.tensor([t.request.group_id for t in trajs]), 5.0, False
    )
    for t, a in zip(trajs, adv.tolist()):
        t.advantage = a
    model = adapter.policy
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    update(cfg, DiffusionOps(cfg, adapter), opt, trajs, keep, 0)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert moved and moved <= lora, f"moved non-LoRA parameters: {moved - lora}"
    assert len(moved) >= len(lora) // 2


@pytest.mark.slow
def test_overlapped_scoring_equals_scoring_after_the_rollout(tiny_sd3, tmp_path):
    """rollout_and_score hands each finished batch to the reward pool while later batches still denoise:
    the rewards it sets are those of scoring every sample once the whole rollout is done."""
    cfg = tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--rollout.max_num_seqs", "2",
    )  # fmt: skip
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    pool = RewardPool(cfg.reward.weights, 2, 60)
    submitted: list[int] = []
    submit = pool.submit

    def submit_and_count(outputs, *a, **k):
        submitted.append(len(outputs))
        return submit(outputs, *a, **k)

    pool.submit = submit_and_count
    stats: dict[str, float] = {}
    trajs, per_reward = rollout_and_score(
        ops, pool, ops.requests(load_prompts(cfg.data.train_path), 0, dist), stats
    )
    assert submitted == [2, 2, 2, 2]  # one batch at a time, the first while three more were to denoise
    serial = pool.score(
        [t.output for t in trajs], [t.request.prompt for t in trajs], [t.request.metadata for t in trajs]
    )
    pool.close()
    np.testing.assert_array_equal(np.array([t.reward for t in trajs]), serial.total)
    for name, scores in per_reward.items():
        np.testing.assert_array_equal(np.sort(scores), np.sort(serial.per_reward[name]))
    assert stats["time/generate_s"] > 0 and stats["time/score_wait_s"] >= 0


@pytest.mark.slow
def test_reused_rollout_logprobs_give_the_recomputed_update(tiny_sd3, tmp_path):
    """algo.old_logprob rollout (the default) reuses the rollout's log-probs as the old policy's instead of
    a recompute pass: from the same samples and LoRA the update gives the same gradients and moves the
    LoRA the same (fp32), over two mini-batches, so the second one's clipped ratios, taken against a
    policy one optimizer step newer, read the same old log-probs too."""
    args = ("--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--optim.mini_batches", "2")
    cfg = tiny_cfg(tiny_sd3, tmp_path, *args)
    dist = D.init_distributed()
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, dist.device)
    ops = DiffusionOps(cfg, adapter)
    model = adapter.policy
    with torch.no_grad():  # a LoRA whose B is not zero, so every LoRA parameter has a gradient
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, ops.requests(load_prompts(cfg.data.train_path), 0, dist))
    pool.close()
    for i, t in enumerate(trajs):
        t.advantage = [1.0, -1.0][i % 2] * (1 + i / 8)

    moved, grads, logs = {}, {}, {}
    for mode in ("rollout", "recompute"):
        ops.cfg = tiny_cfg(tiny_sd3, tmp_path, *args, "--algo.old_logprob", mode)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(start[n])
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        first: dict[str, torch.Tensor] = {}
        step_once = opt.step

        def step_and_keep_the_first_gradients(*a, first=first, step_once=step_once, **k):
            if not first:
                first.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return step_once(*a, **k)

        opt.step = step_and_keep_the_first_gradients
        logs[mode] = update(ops.cfg, ops, opt, trajs, torch.ones(len(trajs), dtype=torch.bool), 0)
        grads[mode] = first
        moved[mode] = {n: p.detach() - start[n] for n, p in model.named_parameters() if p.requires_grad}
    assert logs["rollout"]["train/updates"] == logs["recompute"]["train/updates"] == 2
    assert "time/train_recompute_s" not in logs["rollout"] or logs["rollout"]["time/train_recompute_s"] == 0
    assert grads["rollout"].keys() == grads["recompute"].keys() and len(grads["rollout"]) == len(start)
    for n, g in grads["rollout"].items():
        torch.testing.assert_close(g, grads["recompute"][n], rtol=1e-5, atol=1e-7)
    scale = max(d.abs().max().item() for d in moved["recompute"].values())
    assert scale > 1e-4  # the first optimizer step moved the LoRA: the second mini-batch's ratios are not 1
    for n, d in moved["rollout"].items():
        torch.testing.assert_close(d, moved["recompute"][n], rtol=1e-5, atol=1e-5 * scale)
    assert logs["rollout"]["loss/clip_frac"] == pytest.approx(logs["recompute"]["loss/clip_frac"])


@pytest.mark.slow
def test_dppo_records_the_rollout_mean_and_logs_per_timestep_consistency(tiny_sd3, tmp_path):
    """flow_dppo: the rollout records each trained step's mean (mu_old) and it equals the trainer's
    recomputation for the unchanged policy (fp32, 1e-5), so DPPO needs no old-policy pass; the update logs
    the divergence, the mask, and the trainer-vs-rollout gap per trained timestep index."""
    cfg = tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--sampling.num_steps", "4", "--algo.loss", "flow_dppo", "--optim.epochs", "2",
    )  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    ops = DiffusionOps(cfg, adapter)
    assert ops.params.record_mean
    requests, _ = make_requests(cfg, load_prompts(cfg.data.train_path), 0, dist, ops.params)
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, requests)
    pool.close()
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(len(t.logprobs))]
    assert len(pairs) == 8 * 3  # window 0: every step but the last
    with torch.no_grad():
        mean = pair_logprob(adapter, pairs, ops.params).mean
    recorded = torch.stack([p.traj.means[p.k] for p in pairs])
    diff = (mean - recorded).abs().max().item()
    print(f"recorded vs recomputed step mean: max |diff| {diff:.2e}")
    assert diff < 1e-5

    keep, _ = assign_advantages(cfg, trajs)
    opt = torch.optim.AdamW([p for p in adapter.policy.parameters() if p.requires_grad], lr=1e-2)
    logs = update(cfg, ops, opt, trajs, keep, 0)
    print({k: v for k, v in logs.items() if k.startswith(("dppo/", "consistency/"))})
    assert logs["train/updates"] == 2  # two passes over the rollout
    assert 0 <= logs["dppo/mask_frac"] == logs["loss/clip_frac"] <= 1
    assert logs["dppo/mask_frac"] == pytest.approx(logs["dppo/mask_pos_frac"] + logs["dppo/mask_neg_frac"])
    assert logs["dppo/kl_new_old_max"] >= logs["dppo/kl_new_old"] > 0  # the second pass moved the mean
    assert logs["consistency/pairs"] == len(pairs) and logs["consistency/logprob_abs_diff_max"] < 1e-5
    for t in range(3):
        assert (
            logs[f"consistency/t{t:02d}/logprob_abs_diff_mean"]
            <= logs[f"consistency/t{t:02d}/logprob_abs_diff_max"]
        )
        assert logs[f"consistency/t{t:02d}/logprob_abs_diff_max"] < 1e-5
    assert "consistency/t03/logprob_abs_diff_max" not in logs  # the last step is not trained


@pytest.mark.slow
def test_dppo_with_recomputed_old_policy(tiny_sd3, tmp_path):
    """With old_logprob recompute the rollout records no means: the recompute pass gives DPPO's mu_old."""
    cfg = tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--sampling.num_steps", "3", "--algo.loss", "flow_dppo", "--algo.old_logprob", "recompute",
        "--optim.mini_batches", "2",
    )  # fmt: skip
    dist = D.init_distributed()
    ops = DiffusionOps(cfg, get_adapter("sd3")(cfg, dist.device))
    assert not ops.params.record_mean
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, ops.requests(load_prompts(cfg.data.train_path), 0, dist))
    pool.close()
    assert all(t.means is None for t in trajs)
    for i, t in enumerate(trajs):
        t.advantage = [1.0, -1.0][i % 2]
    opt = torch.optim.AdamW([p for p in ops.policy.parameters() if p.requires_grad], lr=1e-2)
    logs = update(cfg, ops, opt, trajs, torch.ones(4, dtype=torch.bool), 0)
    assert logs["train/updates"] == 2 and logs["dppo/kl_new_old_max"] > 0  # the second mini-batch moved
    assert logs["consistency/logprob_abs_diff_max"] < 1e-5


@pytest.mark.slow
def test_nft_rows_and_the_old_velocity(tiny_sd3, tmp_path):
    """NFT rows are (sample, every step's time but the last, a noise of the row's own generator); after an
    optimizer step the old velocity is the rollout policy's (its parameters swapped in, then restored)."""
    cfg = tiny_cfg(
        tiny_sd3, tmp_path, "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--sampling.num_steps", "3", "--algo.loss", "diffusion_nft", "--optim.mini_batches", "2",
    )  # fmt: skip
    dist = D.init_distributed()
    adapter_cls, ops_cls = check_before_loading(cfg)
    assert ops_cls is NFTOps
    ops = NFTOps(cfg, adapter_cls(cfg, dist.device))
    requests = ops.requests(load_prompts(cfg.data.train_path), 0, dist)
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, requests)
    pool.close()
    for i, t in enumerate(trajs):
        t.advantage = [1.0, -1.0][i % 2]
    rows = ops.update_rows(trajs, torch.ones(4, dtype=torch.bool), torch.Generator().manual_seed(0))
    assert sorted((r.traj.request.index, r.k) for r in rows) == [(i, k) for i in range(4) for k in range(2)]
    assert torch.equal(rows[0].noise(), rows[0].noise()) and not torch.equal(rows[0].noise(), rows[1].noise())
    mb = rows[:4]
    x0 = torch.stack([r.traj.final_latents for r in mb])
    t = torch.stack([r.traj.sigmas[r.time_index()] for r in mb])
    noise = torch.stack([r.noise() for r in mb])
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    embeds = ops.adapter.batch_embeds([r.traj.embeds for r in mb])
    with torch.no_grad():
        v_rollout = ops.adapter.velocity(x_t, t, embeds, 1.0)
        for name, p in ops.policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)  # an optimizer step
        v_moved = ops.adapter.velocity(x_t, t, embeds, 1.0)
    moved = [p.detach().clone() for p in ops.trainable()]
    _, first = ops.loss(mb, 4.0, measure=True)  # before any step the old velocity is v itself
    for r in mb:
        r.passes = 0  # the same rows, times and noises again
    _, later = ops.loss(mb, 4.0, measure=False)
    expected = ((v_moved - v_rollout) ** 2).flatten(1).mean(dim=1).sum().item()
    assert first["nft/old_deviate_sum"] == 0 and expected > 1e-6
    assert later["nft/old_deviate_sum"] == pytest.approx(expected, rel=1e-4)
    assert all(torch.equal(p, q) for p, q in zip(ops.trainable(), moved))  # restored after the swap
    # The soft update after an update of 2 optimizer steps: eta = min(0.001 * 2, 0.5) (the defaults),
    # old <- eta old + (1 - eta) theta, by hand; the old policy is then no longer the policy.
    old = [o.clone() for o in ops._old]
    assert ops.old_is_policy() and ops.measured(2) == {"nft/old_decay": pytest.approx(0.002)}
    for o, before, now in zip(ops._old, old, moved, strict=True):
        torch.testing.assert_close(o, 0.002 * before + 0.998 * now, rtol=1e-6, atol=0)
    assert not ops.old_is_policy() and int(ops.state()["nft_optimizer_steps"]) == 2
    assert all(torch.equal(p, q) for p, q in zip(ops.trainable(), moved))  # the policy itself untouched


def test_nft_times_and_noises_per_pass_by_hand(tmp_path):
    """DiffusionNFT's training times as its reference draws them: per sample and pass a random
    int(0.99 T) of the T sigmas before 0 (T = 10: 9 of sigma_0 .. sigma_9, the last one included), each with
    fresh noise, x_t = (1 - t) x0 + t noise. Written out: the sample's pass-p permutation is
    randperm(10) of the generator seeded derive_seed(seed, -3 - p, -1), row k takes its k-th sigma and the
    noise of derive_seed(seed, -3 - p, k)."""
    from types import SimpleNamespace

    from omnirl.algos.losses import diffusion_nft_loss

    cfg = load_config("sd3_tiny_nft", ["--model.path", str(tmp_path)])
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 2
    sigmas = torch.linspace(1.0, 0.0, 11)
    trajs = [
        SimpleNamespace(
            request=SimpleNamespace(seed=derive_seed(3, 0, i), index=i), sigmas=sigmas,
            final_latents=torch.full((2, 3), float(i)), embeds={}, advantage=[1.0, -1.0][i % 2],
        )
        for i in range(8)
    ]  # fmt: skip
    seen = []

    def velocity(x_t, t, embeds, guidance):
        seen.append((x_t.clone(), t.clone()))
        return torch.zeros_like(x_t, requires_grad=True)

    adapter = SimpleNamespace(device="cpu", batch_embeds=lambda embeds, bucketed=False: {}, velocity=velocity)
    ops = SimpleNamespace(
        cfg=cfg, params=SimpleNamespace(num_steps=10), soft=False, _old=None, adapter=adapter,
        ref_model=None, loss_fn=diffusion_nft_loss,
    )  # fmt: skip
    rows = NFTOps.update_rows(ops, trajs, torch.ones(8, dtype=torch.bool), torch.Generator().manual_seed(0))
    assert len(rows) == 8 * 9  # int(0.99 * 10) rows per sample
    picked = {p: {} for p in range(2)}
    for p in range(2):  # two passes over the same rows
        seen.clear()
        NFTOps.loss(ops, rows, float(len(rows)), measure=True)
        ((x_t, t),) = seen
        for row, xt, tt in zip(rows, x_t, t):
            seed = row.traj.request.seed
            perm = torch.randperm(10, generator=torch.Generator().manual_seed(derive_seed(seed, -3 - p, -1)))
            g = torch.Generator().manual_seed(derive_seed(seed, -3 - p, row.k))
            noise = torch.randn(2, 3, generator=g)
            assert tt == sigmas[perm[row.k]]
            torch.testing.assert_close(xt, (1 - tt) * row.traj.final_latents + tt * noise)
            picked[p].setdefault(row.traj.request.index, set()).add(int(perm[row.k]))
    for p in range(2):
        assert all(len(times) == 9 for times in picked[p].values())  # 9 distinct sigmas per sample
        assert any(9 in times for times in picked[p].values())  # the last sigma is trained too
    assert picked[0] != picked[1]  # a fresh subset per pass


def test_nft_old_decay_schedule():
    """eta of the old policy's soft update by optimizer steps: the reference's decay_type 1 (the defaults)
    and 2 (rate 0.0075, max 0.999, 75 steps at 0), as its `return_decay` computes them."""
    from omnirl.config import DiffusionNFTConfig
    from omnirl.ops.nft import old_decay

    one = DiffusionNFTConfig()
    assert [old_decay(one, s) for s in (0, 1, 250, 500, 10_000)] == pytest.approx([0, 0.001, 0.25, 0.5, 0.5])
    two = DiffusionNFTConfig(old_decay_rate=0.0075, old_decay_max=0.999, old_decay_delay=75)
    expected = [0, 0, 0, 0.0075, 0.9975, 0.999]
    assert [old_decay(two, s) for s in (0, 74, 75, 76, 208, 209)] == pytest.approx(expected)


def torchrun(nproc: int, recipe: Path, *overrides: str, timeout=600) -> subprocess.CompletedProcess:
    cmd, env = torchrun_cmd(nproc, recipe, *overrides)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def torchrun_cmd(nproc: int, recipe: Path, *overrides: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a tests._train_entry run on `nproc` ranks (1: no torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "tests._train_entry"]
    else:
        port = str(29600 + os.getpid() % 300)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            port,
            "-m",
            "tests._train_entry",
        ]
    return [*cmd, "--recipe", str(recipe), *overrides], env


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_zero_spread_rank_matches_single_rank(tiny_sd3, tmp_path):
    """Every group of rank 1 has zero spread (dropped): the 2-rank FSDP run pads rank 1 with zero-weight
    micro-batches and divides by the global count, so its update equals the 1-rank run's."""
    rows = [json.loads(line) for line in open(ROOT / "data/sd3_tiny_prompts.jsonl")]
    per_step = 4
    order = step_prompt_indices(len(rows), 0, per_step, 0)
    for i in order[per_step // 2 : per_step]:  # rank 1's share of step 0
        rows[i]["constant"] = True
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["model"]["path"] = str(tiny_sd3)
    recipe["data"]["train_path"] = str(data)
    recipe["reward"]["weights"] = {"constant_on_flagged_rows": 1.0}
    recipe["run"]["steps"] = 1
    recipe["rollout"].update(prompts_per_step=per_step, group_size=4)
    recipe["optim"]["micro_batch_size"] = 8  # several micro-batches: rank 1 must pad them all
    # Adam's first step is lr * g / (|g| + eps): with the default eps an element whose gradient is near
    # zero turns the rounding of a different reduction order (2 ranks vs 1) into a weight difference of up
    # to lr. With eps = 1 >> |g| the step is lr * g (plain SGD), so the weights differ by lr times the
    # gradients' rounding, which is what this test means to hold: the same gradient on 1 and 2 ranks.
    recipe["optim"]["eps"] = 1.0
    results = {}
    for nproc in (1, 2):
        recipe["run"]["output_dir"] = str(tmp_path / f"out{nproc}")
        path = tmp_path / f"recipe{nproc}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        torchrun(nproc, path)
        results[nproc] = (read_jsonl(tmp_path / f"out{nproc}/metrics.jsonl"), tmp_path / f"out{nproc}/lora")
    (m1, lora1), (m2, lora2) = results[1], results[2]
    assert m1[0]["adv/zero_std_groups"] == m2[0]["adv/zero_std_groups"] == per_step // 2
    for key in ("loss/policy", "loss/clip_frac", "train/grad_norm", "reward/mean"):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-4, abs=1e-7), key
    w1 = load_file(lora1 / "pytorch_lora_weights.safetensors")
    w2 = load_file(lora2 / "pytorch_lora_weights.safetensors")
    assert w1.keys() == w2.keys() and w1
    # LoRA B starts at 0, so B's weights are the step itself: it must have moved, and the two runs' steps
    # agree to the gradients' fp32 rounding (relative 1e-4 of the largest step, as grad_norm above).
    moved = max(w1[k].abs().max().item() for k in w1 if "lora_B" in k)
    assert moved > 1e-5
    for k in w1:
        assert (w1[k] - w2[k]).abs().max().item() <= 1e-4 * moved, k


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_fsdp(tiny_sd3, tmp_path):
    out = tmp_path / "run"
    r = torchrun(
        2,
        ROOT / "yaml/sd3_tiny_flowgrpo.yaml",
        "--model.path",
        str(tiny_sd3),
        "--run.output_dir",
        str(out),
        "--run.steps",
        "3",
        "--log.image_every",
        "2",
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["train/updates"] == 1 for m in metrics)
    # The VAE decode is timed inside the generation, on every rank (step 2 also decodes the shown samples).
    for m in metrics:
        for rank in (0, 1):
            assert 0 < m[f"time/vae_decode_s/rank{rank}"] < m[f"time/generate_s/rank{rank}"]
    assert (out / "lora/pytorch_lora_weights.safetensors").is_file()
    assert (out / "samples/step_000002.png").is_file()
    assert list((out / "tb").glob("events.*"))
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_full_finetune_with_kl_under_torchrun_fsdp(tiny_sd3, tmp_path):
    """Full fine-tuning: every transformer weight sharded by FSDP2 and trained, and a frozen sharded
    reference copy for the KL term: KL is 0 while the policy equals the reference (step 0) and positive
    once the first update has moved the policy away from it (step 1). With float32 master weights and
    bf16 compute, as on GPUs: the FSDP root does not cast its inputs, so the adapter must pass them in the
    compute dtype (omnirl.fsdp.compute_dtype), or the first forward fails on a dtype mismatch."""
    out = tmp_path / "run"
    torchrun(
        2, ROOT / "yaml/sd3_tiny_flowgrpo.yaml", "--model.path", str(tiny_sd3), "--run.output_dir", str(out),
        "--run.steps", "2", "--model.finetune", "full", "--algo.kl_beta", "0.04", "--optim.lr", "1e-4",
        "--distributed.param_dtype", "bfloat16",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["train/updates"] == 1 for m in metrics)
    assert metrics[0]["loss/kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics[1]["loss/kl"] > 0


def test_mini_batches_hold_the_same_rows_on_any_number_of_ranks():
    """The update's shuffle is drawn over every rank's rows: split over 1, 2 or 4 ranks (each with its
    own share of the requests, and some groups dropped), mini-batch m holds the same (sample, step) rows."""
    from types import SimpleNamespace

    from omnirl.batching import split_mini_batches
    from omnirl.models.base import Output, Request, SamplingParams, Trajectory
    from omnirl.ops.omni import OmniOps
    from omnirl.recipe import config_for

    cfg = config_for("sd3")
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
    params = SamplingParams(32, 32, 3, 1.0, 0.7, "sde", 0, (0, 1))
    z = torch.zeros(3, 1)
    trajs = [
        Trajectory(
            Request("p", i // 4, i, 0, params), z, z, torch.arange(3), torch.zeros(3), z, {}, Output(), z
        )
        for i in range(16)
    ]
    keep = torch.tensor([i // 4 != 2 for i in range(16)])  # group 2 has no spread

    def batches(world: int, ops_cls, key) -> list[set]:
        out = [set(), set(), set()]
        for rank in range(world):
            share = slice(rank * 16 // world, (rank + 1) * 16 // world)
            gen = torch.Generator().manual_seed(derive_seed(0, 5, -1))
            ops = nft if ops_cls is NFTOps else SimpleNamespace(cfg=cfg)
            rows = ops_cls.update_rows(ops, trajs[share], keep[share], gen)
            for m, mb in enumerate(split_mini_batches(rows, 3)):
                out[m] |= {key(r) for r in mb}
        return out

    nft = SimpleNamespace(cfg=cfg, params=SimpleNamespace(num_steps=3), soft=False)  # every step but the last
    for ops_cls, key, total in (
        (DiffusionOps, lambda r: (r.traj.request.index, r.k), 36),
        (OmniOps, lambda r: r.traj.request.index, 12),
        (NFTOps, lambda r: (r.traj.request.index, r.k), 24),
    ):
        one = batches(1, ops_cls, key)
        assert sum(map(len, one)) == total and all(one)
        assert batches(2, ops_cls, key) == one == batches(4, ops_cls, key)


@pytest.mark.slow
def test_tiny_dgpo_group_weights_do_not_depend_on_the_ranks(tiny_sd3, tmp_path):
    """sd3_tiny_dgpo's first step on 2 ranks and on 1: a group's rows are spread over the ranks, and its
    weight (the sigmoid of its margins summed over all of them) is the same, as are the loss and the
    update; there are no log-probs."""
    runs = {}
    for ranks in (2, 1):
        out = tmp_path / f"run{ranks}"
        r = torchrun(
            ranks, ROOT / "yaml/sd3_tiny_dgpo.yaml", "--model.path", str(tiny_sd3), "--run.output_dir",
            str(out), "--run.steps", "1", "--log.image_every", "0",
        )  # fmt: skip
        assert "Traceback" not in r.stderr
        runs[ranks] = read_jsonl(out / "metrics.jsonl")[0]
    two, one = runs[2], runs[1]
    assert two["train/updates"] == 1 and two["train/grad_norm"] > 0
    assert 0 < two["dgpo/group_weight"] < 1 and two["dgpo/dsm"] > 0
    assert not any(k.startswith("consistency/") for k in two)
    for key in ("dgpo/group_weight", "dgpo/dsm", "loss/policy", "train/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow
def test_tiny_nft_recipe_under_torchrun_fsdp(tiny_sd3, tmp_path):
    """sd3_tiny_nft for 3 steps on 2 ranks, with two optimizer steps per rollout: the second mini-batch
    takes the old velocity from the rollout policy's parameters swapped into the FSDP2-sharded LoRA, so it
    differs from the moved policy's (nft/old_deviate > 0)."""
    out = tmp_path / "run"
    r = torchrun(
        2, ROOT / "yaml/sd3_tiny_nft.yaml", "--model.path", str(tiny_sd3), "--run.output_dir", str(out),
        "--run.steps", "3", "--optim.mini_batches", "2", "--log.image_every", "0",
    )  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["train/updates"] == 2 and math.isfinite(m["loss/policy"]) and m["train/grad_norm"] > 0
        assert m["compile/graphs"] == 0 and m["time/compile_s"] == 0  # the tiny recipe compiles nothing
        assert m["nft/positive"] > 0 and m["nft/negative"] > 0 and m["nft/old_deviate"] > 0
        assert not any(k.startswith(("consistency/", "dppo/")) for k in m)  # no log-probs, no ratio
        # The old policy's soft update (the defaults): eta = 0.001 per optimizer step so far.
        assert m["nft/old_decay"] == pytest.approx(0.002 * (m["step"] + 1))
    assert (out / "lora/pytorch_lora_weights.safetensors").is_file()
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_nft_old_policy_with_eta_zero_is_the_rollout_policy(tiny_sd3, tmp_path):
    """The soft-updated old policy with eta 0 at every update (its delay past the run's end: the old copy
    is kept, checkpointed, swapped in for the later mini-batches and copied from the policy after each
    update) trains bit for bit as no soft update at all (diffusion_nft.old_decay_max 0: the old policy is the
    rollout's, the behaviour before the soft update existed): same weights, same metrics."""
    from safetensors.torch import load_file

    runs = {}
    for name, extra in (
        ("off", ["--algo.diffusion_nft.old_decay_max", "0"]),
        ("eta0", ["--algo.diffusion_nft.old_decay_delay", "1000"]),
    ):
        out = tmp_path / name
        torchrun(
            1, ROOT / "yaml/sd3_tiny_nft.yaml", "--model.path", str(tiny_sd3), "--run.output_dir", str(out),
            "--run.steps", "3", "--optim.mini_batches", "2", "--rollout.prompts_per_step", "2",
            "--log.image_every", "0", "--log.no-tensorboard", *extra,
        )  # fmt: skip
        rows = [
            {k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}
            for m in read_jsonl(out / "metrics.jsonl")
        ]
        runs[name] = (load_file(out / "lora/pytorch_lora_weights.safetensors"), rows)
    (off_w, off_rows), (eta_w, eta_rows) = runs["off"], runs["eta0"]
    assert off_w.keys() == eta_w.keys() and all(torch.equal(off_w[k], eta_w[k]) for k in off_w)
    assert [m.pop("nft/old_decay") for m in eta_rows] == [0.0, 0.0, 0.0]
    assert eta_rows == off_rows and all(m["nft/old_deviate"] > 0 for m in off_rows)
