"""distributed.mode async (omnirl/async_mode.py): the schedule, the checks at load, the importance weights
of stale samples, and the torchrun runs: 3 ranks (2 generate, 1 trains) learn, train every sample once and
resume exactly; at staleness 0 the weights are the colocated run's, with 1 or 2 training ranks; broadcast
weights are the trained ones bit for bit (a LoRA's, and a full fine-tune's sharded over 2 training ranks);
a killed rollout or training rank ends the job; Ctrl-C ends every rank. The model of
benchmarks/async_model.py."""

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from omnirl.async_mode import schedule
from omnirl.errors import ConfigError
from omnirl.recipe import load_config
from tests.test_job_failures import alive, children, failure_of, free_port
from tests.test_train import read_jsonl, torchrun, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent


# --- the schedule ----------------------------------------------------------------------------------------


def walk(events: list, steps: int, staleness: int, trained: int = 0, received: int = -1):
    """Both sides of `events` as the ranks run them: the rollout's version at each step it generates, and
    the order in which the trainer sends versions and trains steps (trained as soon as its samples are in
    and its version went out, as omnirl.async_mode._Trainer does)."""
    to_send = {i for e, i in events if e == "weights"}
    version, generated, order = trained, {}, []
    done = trained
    for event, i in events:
        if event == "weights":
            assert done == i  # the version after i updates
            to_send.discard(i)
            order.append(("sent", i))
            version = i
        else:
            generated[i] = version
            received = i
            order.append(("received", i))
        done = drain(done, received, to_send, steps, order)
    return generated, order, drain(done, received, to_send, steps, order)


def drain(done: int, received: int, to_send: set, steps: int, order: list) -> int:
    while done < steps and done <= received and done not in to_send:
        order.append(("trained", done))
        done += 1
    return done


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_schedule_trains_every_step_once_within_the_staleness(staleness):
    steps = 7
    events = schedule(steps, staleness)
    generated, order, done = walk(events, steps, staleness)
    assert done == steps and [i for e, i in order if e == "trained"] == list(range(steps))  # each once
    # Step k is generated with the policy after max(0, k - s) updates: never staler than s.
    assert generated == {k: max(0, k - staleness) for k in range(steps)}
    if staleness:  # the update of step j overlaps the rollout of step j + s, which starts from version j
        for j in range(1, steps - staleness):
            sent, trained = order.index(("sent", j)), order.index(("trained", j))
            assert sent < trained < order.index(("received", j + staleness))


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_schedule_after_a_checkpoint_is_the_rest_of_the_run(staleness):
    """Resuming at `done` (the samples of steps done .. done + s - 1 in the checkpoint) walks the events the
    uninterrupted run walks after its checkpoint: the same versions for the same steps."""
    steps = 6
    full, _, _ = walk(schedule(steps, staleness), steps, staleness)
    for done in range(1, steps + 1):
        held = min(done + staleness, steps) - 1
        rest = schedule(steps, staleness, done)
        generated, order, end = walk(rest, steps, staleness, trained=done, received=held)
        assert end == steps
        assert generated == {k: v for k, v in full.items() if k > held}, done
        assert all(i >= done for e, i in rest if e == "weights")


# --- checks at load ---------------------------------------------------------------------------------------


def load(tiny_sd3, world: int, *overrides: str):
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return load_config(
            "sd3_tiny_flowgrpo",
            ["--model.path", str(tiny_sd3), "--distributed.mode", "async", *overrides],
        )
    finally:
        del os.environ["WORLD_SIZE"]


STALE = ("--algo.old_logprob", "recompute", "--algo.correction", "tis")


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (1, (), "needs at least 2 ranks"),
        (2, ("--distributed.rollout_ranks", "2"), "leaves no training rank"),
        (2, ("--distributed.rollout_ranks", "3"), "leaves no training rank (3 rollout ranks)"),
        (8, ("--distributed.rollout_ranks", "0.01"), "leaves no rollout rank"),
        (2, ("--distributed.rollout_ranks", "1.5"), "a count (1, 2, ...) or a fraction"),
        (2, ("--distributed.max_staleness", "-1"), "distributed.max_staleness must be >= 0"),
        (2, ("--distributed.rollout_ranks", "1"), "need algo.old_logprob recompute"),
        (3, ("--distributed.rollout_ranks", "2", "--rollout.prompts_per_step", "3", *STALE),
         "rollout ranks (2)"),
        (2, ("--distributed.rollout_ranks", "1", "--rollout.fp8.select", "1", "--rollout.precision", "fp8",
             *STALE), "rollout.precision fp8"),
    ],
)  # fmt: skip
def test_bad_async_settings_fail_at_load(tiny_sd3, world, overrides, message):
    with pytest.raises(ConfigError) as e:
        load(tiny_sd3, world, *overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_async_settings_that_run_load(tiny_sd3):
    cfg = load(tiny_sd3, 3, "--distributed.rollout_ranks", "0.67", "--rollout.prompts_per_step", "2", *STALE)
    from omnirl.async_mode import rollout_count

    assert rollout_count(cfg, 3) == 2
    cfg = load(tiny_sd3, 2, "--distributed.max_staleness", "0")  # no correction needed at staleness 0
    assert cfg.distributed.max_staleness == 0


# --- stale samples: the truncated importance weight ------------------------------------------------------


@pytest.mark.slow
def test_stale_samples_are_weighted_by_the_truncated_ratio_of_their_recorded_logprobs(tiny_sd3, tmp_path):
    """A step's samples generated with the policy of one update before (version 0), trained after that
    update (version 1): the loss's importance weights are min(exp(logp_v1 - logp_v0), C) of each trained
    step, logp_v0 the rollout's recorded log-prob and logp_v1 the current policy's, computed here by hand."""
    from omnirl import distributed as D
    from omnirl.batching import make_requests
    from omnirl.models import get_adapter
    from omnirl.ops.diffusion import DiffusionOps, Pair, pair_logprob
    from omnirl.rewards.pool import RewardPool
    from omnirl.scoring import rollout_and_score
    from omnirl.step import assign_advantages, update

    cfg = load(tiny_sd3, 2, "--distributed.rollout_ranks", "1", *STALE, "--rollout.prompts_per_step", "2",
               "--rollout.group_size", "4", "--sampling.num_steps", "4",
               "--algo.correction_threshold", "1.001", "--run.output_dir", str(tmp_path / "out"))  # fmt: skip
    dist = D.init_distributed()
    D.seed_everything(0)
    adapter = get_adapter("sd3")(cfg, dist.device)
    ops = DiffusionOps(cfg, adapter)
    assert ops.correct  # a stale rollout is corrected
    rows = __import__("omnirl.data.prompts", fromlist=["load_prompts"]).load_prompts(cfg.data.train_path)
    requests, _ = make_requests(cfg, rows, 1, dist, ops.step_params(1))
    pool = RewardPool(cfg.reward.weights, 1, 60)
    trajs, _ = rollout_and_score(ops, pool, requests)  # version 0: its log-probs are the behaviour's
    pool.close()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the update between the rollout and this training step: version 1
        for name, p in adapter.policy.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    keep, _ = assign_advantages(cfg, trajs)
    pairs = [Pair(t, k, 1.0) for t, kept in zip(trajs, keep.tolist()) if kept for k in range(len(t.logprobs))]
    with torch.no_grad():
        current = pair_logprob(adapter, pairs, trajs[0].request.params).logprob.double()
    recorded = torch.stack([p.traj.logprobs[p.k] for p in pairs]).double()
    c = cfg.algo.correction_threshold
    ratio = torch.exp(current - recorded)
    weights, clipped = ratio.clamp(max=c), ratio > c
    assert clipped.any() and not clipped.all()  # both sides of the truncation are exercised
    optimizer = torch.optim.SGD([p for p in adapter.policy.parameters() if p.requires_grad], lr=0.0)
    metrics = update(cfg, ops, optimizer, trajs, keep, 1)
    assert metrics["correction/weight_mean"] == pytest.approx(weights.mean().item(), abs=1e-6)
    assert metrics["correction/clip_frac"] == pytest.approx(clipped.double().mean().item(), abs=1e-12)


# --- torchrun runs -----------------------------------------------------------------------------------------


def async_recipe(tiny_sd3, tmp_path: Path, name: str, steps: int, **sections: dict) -> Path:
    """The tiny SD3 recipe in async mode, `steps` steps into tmp_path/name, 4 denoising steps, no images."""
    recipe = yaml.safe_load((ROOT / "yaml/sd3_tiny_flowgrpo.yaml").read_text())
    recipe["model"]["path"] = str(tiny_sd3)
    recipe["run"].update(steps=steps, output_dir=str(tmp_path / name))
    recipe["rollout"].update(prompts_per_step=2, group_size=8)
    recipe["sampling"]["num_steps"] = 4
    recipe["log"]["image_every"] = 0
    recipe["algo"].update(old_logprob="recompute", correction="tis")
    recipe["distributed"].update(mode="async", rollout_ranks=1, max_staleness=1)
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


STEPS = 12


@pytest.fixture(scope="module")
def three_ranks(tiny_sd3, tmp_path_factory):
    """2 rollout ranks and 1 training rank, staleness 1, 12 steps, a checkpoint every 4."""
    tmp = tmp_path_factory.mktemp("async3")
    recipe = async_recipe(
        tiny_sd3, tmp, "out", STEPS, distributed={"rollout_ranks": 2}, optim={"lr": 0.05},
        checkpoint={"every": 4},
    )  # fmt: skip
    torchrun(3, recipe, timeout=900)
    return tmp, recipe


@pytest.mark.slow
def test_tiny_recipe_in_async_mode_on_three_ranks_moves_its_reward(three_ranks):
    tmp, _ = three_ranks
    metrics = read_jsonl(tmp / "out/metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward: {first:.4f} (steps 0-2) -> {last:.4f} (steps {STEPS - 3}-{STEPS - 1})")
    assert last > first + 0.05
    assert (tmp / "out/lora/pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_every_generated_sample_is_trained_exactly_once(three_ranks):
    """Counted: every step trains its 16 samples (the training rank checks their request indices: each
    once), as many as the rollout ranks generated, none lost at a weight sync. Step 0 is generated with the
    first policy (staleness 0), every later step with the one an update before (1), and the loss weights
    those by the truncated importance weight (logged)."""
    tmp, _ = three_ranks
    metrics = read_jsonl(tmp / "out/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["async/samples_trained"] == m["async/samples_generated"] == 16 for m in metrics)
    assert [m["async/staleness_max"] for m in metrics] == [0.0] + [1.0] * (STEPS - 1)
    assert all(m["async/staleness_mean"] == m["async/staleness_max"] for m in metrics)
    assert metrics[0]["correction/weight_mean"] == pytest.approx(1.0, abs=1e-5)  # the same policy
    assert all(
        m["correction/weight_mean"] != 1.0 and math.isfinite(m["correction/weight_mean"]) for m in metrics[1:]
    )


@pytest.mark.slow
def test_resume_gives_the_metrics_of_the_uninterrupted_run(three_ranks):
    """Resumed from the checkpoint of step 4, which holds step 4's samples (generated with the policy of
    step 3): the metrics of steps 4-11 are the uninterrupted run's, timings aside."""
    tmp, recipe = three_ranks
    out = tmp / "resumed"
    shutil.copytree(
        tmp / "out", out, ignore=shutil.ignore_patterns("step_000008", "step_000012", "lora", "tb")
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000004"]
    assert (out / "checkpoints/step_000004/queue/rank_00000.pt").is_file()
    torchrun(3, recipe, "--run.output_dir", str(out), timeout=900)
    timing = ("time/", "async/wait_s", "async/rollout_generate_s", "async/rollout_score_wait_s")
    strip = [lambda m: {k: v for k, v in m.items() if not k.startswith(timing)}]
    full = [strip[0](m) for m in read_jsonl(tmp / "out/metrics.jsonl")]
    resumed = [strip[0](m) for m in read_jsonl(out / "metrics.jsonl")]
    assert [m["step"] for m in resumed] == list(range(STEPS))
    assert resumed[4:] == full[4:]


@pytest.mark.slow
@pytest.mark.parametrize("trainers", [1, 2])
def test_staleness_0_gives_the_weights_of_the_colocated_run(tiny_sd3, tmp_path, trainers):
    """1 rollout rank and 1 or 2 training ranks (their own FSDP2 group) at staleness 0 train the samples
    that the colocated run on as many ranks as train here generates, with the same policy: the same LoRA to
    fp32 rounding (1e-6). Rollout batches of 8 samples: the batches of both runs' rollouts are the same
    (a batch's size changes fp32 rounding), and so are the samples."""
    recipe = async_recipe(
        tiny_sd3, tmp_path, "async", 2, distributed={"max_staleness": 0},
        algo={"old_logprob": "rollout", "correction": "none"}, rollout={"max_num_seqs": 8},
    )  # fmt: skip
    torchrun(1 + trainers, recipe)
    colocated = ("--distributed.mode", "colocated", "--run.output_dir", str(tmp_path / "colocated"))
    torchrun(trainers, recipe, *colocated)
    metrics = read_jsonl(tmp_path / "async/metrics.jsonl")
    assert [m["async/samples_trained"] for m in metrics] == [16.0, 16.0]  # by the training ranks together
    a = load_file(tmp_path / "async/lora/pytorch_lora_weights.safetensors")
    c = load_file(tmp_path / "colocated/lora/pytorch_lora_weights.safetensors")
    assert a.keys() == c.keys() and a
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 1e-4  # trained
    for k in a:
        assert (a[k] - c[k]).abs().max().item() <= 1e-6, k


@pytest.mark.slow
def test_broadcast_weights_equal_the_trained_ones_bit_for_bit_and_a_lost_peer_is_named():
    """tests/_async_checks.py on 2 ranks: the broadcast's tensors bit for bit; a receive from a rank that
    ended fails with one line naming it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    cmd += [str(free_port()), "-m", "tests._async_checks"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("async checks OK") == 2


@pytest.mark.slow
def test_full_fine_tune_broadcasts_the_trained_weights_bit_for_bit(tiny_sd3, tmp_path):
    """A full fine-tune on 3 ranks, 1 generates and 2 train (the weights sharded over the two by FSDP2),
    staleness 1, 4 steps: after each update the whole transformer goes to the rollout rank in buckets
    (of 64 KiB here, tests/_async_entry.py: many buckets, one tensor across several). What the rollout
    rank then holds is, byte for byte, what training rank 0 gathers from the shards; and each version is
    another (trained) one."""
    recipe = async_recipe(
        tiny_sd3, tmp_path, "out", 4, model={"finetune": "full"}, optim={"lr": 1e-4},
    )  # fmt: skip
    weights = tmp_path / "weights"
    weights.mkdir()
    cmd, env = torchrun_cmd(3, recipe)
    cmd[cmd.index("tests._train_entry")] = "tests._async_entry"
    r = subprocess.run(
        cmd, cwd=ROOT, env={**env, "OMNIRL_TEST_WEIGHTS": str(weights)}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # Versions 1 and 2 go out before the rollouts of steps 2 and 3; to rank 2, the rollout rank.
    assert sorted(p.name for p in weights.iterdir()) == [
        "v1_rank0.safetensors", "v1_rank2.safetensors", "v2_rank0.safetensors", "v2_rank2.safetensors",
    ]  # fmt: skip
    sent = {name: load_file(weights / name) for name in os.listdir(weights)}
    base = load_file(next((tiny_sd3 / "transformer").glob("*.safetensors")))
    del base["pos_embed.pos_embed"]  # a buffer (the positional table), not a weight
    for v in (1, 2):
        trained, received = sent[f"v{v}_rank0.safetensors"], sent[f"v{v}_rank2.safetensors"]
        assert trained.keys() == received.keys()
        # Every weight of the transformer: a full fine-tune trains (and sends) them all.
        assert sum(t.numel() for t in trained.values()) == sum(t.numel() for t in base.values())
        for k in trained:
            assert torch.equal(trained[k].view(torch.uint8), received[k].view(torch.uint8)), (v, k)
    v1, v2 = sent["v1_rank0.safetensors"], sent["v2_rank0.safetensors"]
    assert sum(not torch.equal(v1[k], v2[k]) for k in v1) > len(v1) / 2  # the update between them
    metrics = read_jsonl(tmp_path / "out/metrics.jsonl")
    assert [m["async/samples_trained"] for m in metrics] == [16.0] * 4
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]


def launch(recipe: Path, nproc: int, log: Path) -> subprocess.Popen:
    """tests._train_entry on `nproc` ranks under torchrun, its output to `log`, in a session of its own (so
    that a test can signal torchrun and its ranks together, as Ctrl-C in a terminal does)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port"]
    cmd += [str(free_port()), "-m", "tests._train_entry", "--recipe", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )


def wait_until(proc: subprocess.Popen, log: Path, done, what: str, limit: float = 300) -> None:
    """Poll until `done()`; the job ending first, or `limit` seconds passing, fails the test."""
    end = time.monotonic() + limit
    while not done():
        assert proc.poll() is None, f"the job ended before {what}:\n{log.read_text()[-5000:]}"
        assert time.monotonic() < end, f"no {what} after {limit} s:\n{log.read_text()[-5000:]}"
        time.sleep(0.1)


def ended_within(proc: subprocess.Popen, log: Path, limit: float, what: str) -> str:
    """torchrun's exit status and output once it ends; still running `limit` seconds after `what` fails the
    test (after killing its process group)."""
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the job still ran {limit} s after {what}:\n{log.read_text()[-5000:]}")
    return log.read_text()


KILLED = "injected failure: rank 1 kills itself with SIGKILL"


@pytest.mark.slow
@pytest.mark.parametrize("side", ["rollout", "training"])
def test_a_killed_rank_ends_the_job_naming_it(tiny_sd3, tmp_path, side):
    """Rank 1 kills itself with SIGKILL at step 1 (tests/support_failures.py) while its peers wait for it:
    on 2 ranks it is the rollout rank (in its reward; the training rank waits for its samples), on 3 ranks
    with 1 rollout rank a training rank (in its validation reward; training rank 0 waits in validation's
    all-reduce, the rollout rank sends it samples). The job ends within 30 s of the kill, and torchrun's
    summary names rank 1 and its signal."""
    nproc, sections = 2, {"reward": {"weights": {"killed_on_rank1": 1.0}}}
    if side == "training":
        nproc = 3
        sections["data"] = {"val_path": str(ROOT / "data/sd3_tiny_prompts.jsonl")}
        sections["validation"] = {"every": 1, "num_steps": 2}
    recipe = async_recipe(tiny_sd3, tmp_path, "out", 4, **sections)
    log = tmp_path / "job.log"
    proc = launch(recipe, nproc, log)
    try:
        wait_until(proc, log, lambda: KILLED in log.read_text(), "kill of rank 1")
        killed = time.monotonic()
        out = ended_within(proc, log, 30, "rank 1 was killed")
        print(f"the job ended {time.monotonic() - killed:.1f} s after the kill")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    cause = failure_of(proc.returncode, out, rank=1)
    assert "Signal 9 (SIGKILL)" in cause


@pytest.mark.slow
def test_ctrl_c_ends_every_rank(tiny_sd3, tmp_path):
    """SIGINT to torchrun's process group (Ctrl-C in its terminal) once 2 steps are trained on 3 ranks (1
    generates, 2 train; at staleness 1 the rollout rank generates while they train): every rank leaves by
    itself through the interrupt's one line (torchrun, which also passes SIGINT on, never has to kill one
    with SIGKILL), and torchrun exits with an error."""
    recipe = async_recipe(tiny_sd3, tmp_path, "out", 1000, checkpoint={"every": 0})
    log, metrics = tmp_path / "job.log", tmp_path / "out/metrics.jsonl"
    proc = launch(recipe, 3, log)
    workers: list[int] = []
    try:
        wait_until(proc, log, lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, "2 steps")
        workers = children(proc.pid)
        assert len(workers) == 3
        os.killpg(proc.pid, signal.SIGINT)
        interrupted = time.monotonic()
        out = ended_within(proc, log, 60, "SIGINT")
        print(f"the job ended {time.monotonic() - interrupted:.1f} s after SIGINT")
    finally:
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not [w for w in workers if alive(w)]
    assert "error: interrupted (Ctrl-C)" in out
    assert "forcefully exiting" not in out, out[-5000:]  # torchrun's word for a rank it had to SIGKILL


# --- the model ---------------------------------------------------------------------------------------------


def test_async_model_arithmetic():
    """By hand: R = 6 s, U = 24 s, W = 2 s for 32 samples on one GPU, 1 GiB broadcast at 1 GiB/s, 4 GPUs.
    Colocated: 4 x 32 / 32 s = 4 samples/s. Async 1R+3T: max(6 x 4 / 1, 24 x 4 / 3) + 1 = 33 s -> 128 / 33;
    2R+2T: max(12, 48) + 1 = 49 s; at staleness 0, 1R+3T: 24 + 32 + 1 = 57 s."""
    from benchmarks.async_model import GIB, Phases, async_rate, async_step_s, colocated_rate, table

    p = Phases("r", 32, 6.0, 24.0, 2.0, GIB, "by hand")
    assert colocated_rate(p, 4) == pytest.approx(4.0)
    assert async_step_s(p, 4, 1, GIB) == pytest.approx(33.0)
    assert async_rate(p, 4, 1, GIB) == pytest.approx(128 / 33)
    assert async_step_s(p, 4, 2, GIB) == pytest.approx(49.0)
    assert async_step_s(p, 4, 1, GIB, staleness=0) == pytest.approx(57.0)
    text, rows = table([p], 4, GIB)
    assert rows[0]["best_rollout"] == 1 and "**3.88**" in text  # 128 / 33, the best split, marked
