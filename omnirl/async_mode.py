"""distributed.mode async: rollout and update at the same time, on disjoint ranks of one torchrun job.

The last `distributed.rollout_ranks` ranks of the job only generate and score; the first ones only train,
each side in a process group of its own (`omnirl.distributed.within`). Samples go rollout -> training
ranks by point-to-point messages of pickled objects (gloo, on the host), with the policy version they
were generated with; weights go training rank 0 -> rollout ranks by a broadcast of the trained tensors in
buckets of `BUCKET_BYTES`, at a step boundary. Both sides walk the same list of events (`schedule`): the
rollout of step k uses the policy after max(0, k - s) updates, s = distributed.max_staleness, and the
trainer corrects for the older policy (algo.old_logprob recompute, algo.correction tis / mis).
Checkpoints are written by the training ranks with the generated-but-untrained samples in them (`QUEUE`).

How it works and what holds: docs/async.md. Our own code: a schedule and two transfers on
torch.distributed's send/recv and broadcast.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from omnirl import checkpoint
from omnirl import distributed as D
from omnirl.config import Config
from omnirl.config_checks import rollout_count as rollout_count
from omnirl.models import base

# Weights go in buckets of this many bytes: few broadcasts, and no second copy of a full model at once.
BUCKET_BYTES = 256 * 2**20
QUEUE = "queue"  # the checkpoint's folder of each training rank's generated-but-untrained samples
# What a sample is made of: all that a checkpoint's queue may hold beyond tensors and plain values.
RECORDS = [base.Trajectory, base.OmniTrajectory, base.Request, base.SamplingParams, base.GenerationParams]
RECORDS += [base.Output, base.Latent]


def schedule(steps: int, staleness: int, done: int = 0) -> list[tuple[str, int]]:
    """The events every rank walks, in order: ("samples", k) the rollout of step k reaches the training
    ranks; ("weights", v) the policy after v updates reaches the rollout ranks, just before the rollout
    that uses it (step v + s). After a checkpoint of `done` steps the events already behind it are left
    out: the weights before version `done` and the samples the checkpoint holds (through step
    min(done + s, steps) - 1)."""
    events = []
    for k in range(steps):
        if k - staleness >= 1:
            events.append(("weights", k - staleness))
        events.append(("samples", k))
    if not done:
        return events
    held = min(done + staleness, steps) - 1
    return [(e, i) for e, i in events if (e == "weights" and i >= done) or (e == "samples" and i > held)]


def broadcast_trained(
    model: nn.Module, group: tdist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES
) -> int:
    """Send the trained tensors of `model` (requires_grad) from global rank 0 to every rank of `group`
    (rank 0 and the rollout ranks), bucket by bucket; a rank in the group copies them into its own
    parameters. A sharded parameter (DTensor) is gathered first: every training rank calls this, those
    outside the broadcast (`group` None) only for that gather. Returns the bytes broadcast."""
    params = [p for p in model.parameters() if p.requires_grad]
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]
    if group is None:
        return 0
    rank = tdist.get_rank()
    sent = 0
    start = 0
    while start < len(full):  # a bucket: consecutive tensors of one dtype, up to bucket_bytes
        end, size = start + 1, full[start].numel() * full[start].element_size()
        while end < len(full) and full[end].dtype == full[start].dtype and size < bucket_bytes:
            size += full[end].numel() * full[end].element_size()
            end += 1
        flat = torch.cat([t.reshape(-1) for t in full[start:end]])  # [sum of numel]
        tdist.broadcast(flat, src=0, group=group)
        if rank != 0:
            offset = 0
            with torch.no_grad():
                for p in params[start:end]:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        sent += size
        start = end
    return sent


class PeerLost(RuntimeError):
    """A transfer between the two sides failed: the rank at its other end ended (its connection closed) or
    stopped answering (distributed.timeout_s). One line naming that rank and the backend's cause."""


@contextlib.contextmanager
def across(what: str, peer: str):
    """Run the transfer `what` ("receiving step 3's samples") with `peer` at its other end ("rollout rank
    2"), turning the backend's error into a PeerLost that names the peer: gloo's own names an address."""
    try:
        yield
    except RuntimeError as e:  # gloo's and NCCL's errors (torch.distributed.DistError) are RuntimeErrors
        cause = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise PeerLost(
            f"distributed.mode async: {what} failed: {peer} ended or stopped answering ({cause})"
        ) from e


def named(side: str, ranks: list[int]) -> str:
    """The global ranks of one side in words: "rollout rank 2", "rollout ranks 1-2"."""
    return f"{side} rank {ranks[0]}" if len(ranks) == 1 else f"{side} ranks {ranks[0]}-{ranks[-1]}"


def send_samples(msg: dict, step: int, rank: int) -> None:
    """A rollout rank's message of step `step` to training rank `rank` (pickled, through the host)."""
    with across(f"sending step {step}'s samples", f"training rank {rank}"):
        tdist.send_object_list([msg], dst=rank, device=torch.device("cpu"))


def receive_samples(step: int, rollouts: list[int]) -> list[dict]:
    """A training rank's messages of step `step`, one from each rollout rank of `rollouts`, in that order."""
    msgs = []
    for rank in rollouts:
        box: list = [None]
        with across(f"receiving step {step}'s samples", f"rollout rank {rank}"):
            tdist.recv_object_list(box, src=rank, device=torch.device("cpu"))
        msgs.append(box[0])
    return msgs


def owner(group_id: int, prompts: int, trainers: int) -> int:
    """The training rank (in the training group) that trains the samples of prompt `group_id`."""
    return group_id // (prompts // trainers)


def dump_queue(queue: dict[int, list[dict]]) -> bytes:
    buf = io.BytesIO()
    torch.save(queue, buf)
    return buf.getvalue()


def load_queue(path: Path, rank: int) -> dict[int, list[dict]]:
    """This training rank's generated-but-untrained samples of the checkpoint at `path`, read with
    `torch.load(weights_only=True)` allowing only the sample records of `omnirl.models.base` (a sample
    holding anything else, e.g. a condition image object, is a CheckpointError naming the file)."""
    from omnirl.checkpoint_checks import CheckpointError

    file = path / QUEUE / f"rank_{rank:05d}.pt"
    try:
        with torch.serialization.safe_globals(RECORDS):
            return torch.load(file, weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError) as e:
        why = str(e).splitlines()[0]
        raise CheckpointError(f"{file}: not the samples this mode writes ({why})") from None


def train_async(cfg: Config, dist: D.DistInfo) -> dict[str, float]:
    """`omnirl.trainer.train` for distributed.mode async; returns the last step's logged metrics (on the
    training ranks; {} on the rollout ranks)."""
    from omnirl.data import check_prompts, load_data
    from omnirl.models import build_adapter
    from omnirl.ops import check_before_loading
    from omnirl.rewards.pool import RewardPool

    resume = checkpoint.find_resume(cfg)
    rows, val_rows, skipped = load_data(cfg)
    _, ops_cls = check_before_loading(cfg)
    adapter = build_adapter(cfg, dist.device)  # every rank: read on rank 0, broadcast
    r = cfg.reward
    rewards = RewardPool(r.weights, r.num_workers, r.timeout_s, r.paths, adapter=adapter, cfg=cfg)
    ops = ops_cls(cfg, adapter)
    rows, val_rows = (check_prompts(x, ops.prompt_problem, skipped) for x in (rows, val_rows))
    n = rollout_count(cfg, dist.world_size)
    trainers = list(range(dist.world_size - n))
    rollouts = list(range(dist.world_size - n, dist.world_size))
    # Every rank makes every group, in the same order (new_group is collective over the job); a rank
    # keeps those it is a member of.
    train_group, rollout_group, weights_group = (
        cast(tdist.ProcessGroup, g) if dist.rank in ranks else None
        for ranks in (trainers, rollouts, [0, *rollouts])
        for g in [tdist.new_group(ranks)]
    )
    done = checkpoint.read_meta(resume)["step"] if resume is not None else 0
    events = schedule(cfg.run.steps, cfg.distributed.max_staleness, done)
    try:
        if dist.rank in rollouts:
            assert rollout_group is not None
            with D.within(rollout_group):
                mine = D.DistInfo(rollouts.index(dist.rank), n, dist.local_rank, dist.device, None)
                _rollout(cfg, ops, rewards, rows, mine, events, trainers, weights_group)
            return {}
        assert train_group is not None
        with D.within(train_group):
            kind = dist.device.type
            mesh = DeviceMesh.from_group(train_group, kind, mesh_dim_names=("dp",))
            mine = D.DistInfo(dist.rank, len(trainers), dist.local_rank, dist.device, mesh)
            trainer = _Trainer(cfg, ops, rewards, mine, rollouts, weights_group, val_rows, skipped)
            return trainer.run(resume, done, events)
    finally:
        rewards.close()


def _rollout(cfg, ops, rewards, rows, dist: D.DistInfo, events, trainers: list[int], weights_group) -> None:
    """A rollout rank: generate and score each step with the newest weights the schedule allows, send each
    training rank its share."""
    from omnirl.scoring import rollout_step

    s, prompts = cfg.distributed.max_staleness, cfg.rollout.prompts_per_step
    rollouts = list(range(len(trainers), len(trainers) + dist.world_size))  # global ranks: after the trainers
    version = 0
    for event, i in events:
        if event == "weights":
            peer = f"training rank 0 or {named('rollout', rollouts)}"
            with across(f"receiving the weights after {i} updates", peer):
                broadcast_trained(ops.policy, weights_group)
            version = i
            continue
        assert version == max(0, i - s), (i, version)  # the schedule's promise
        stats: dict[str, float] = {}
        trajs, per_reward = rollout_step(cfg, ops, rewards, ops.requests(rows, i, dist), stats)
        for t, rank in enumerate(trainers):
            msg = {
                "step": i,
                "version": version,
                "trajs": [x for x in trajs if owner(x.request.group_id, prompts, len(trainers)) == t],
                "generated": len(trajs),
                # lists, not arrays: a checkpoint's queue loads with weights_only (`load_queue`)
                "per_reward": {k: v.tolist() for k, v in per_reward.items()} if t == 0 else {},
                "stats": stats,
            }
            send_samples(msg, i, rank)


class _Trainer:
    """A training rank: receive samples, train each step as soon as the schedule allows, send weights."""

    def __init__(self, cfg, ops, rewards, dist: D.DistInfo, rollouts, weights_group, val_rows, skipped):
        from omnirl.fsdp import shard

        self.cfg, self.ops, self.rewards, self.dist = cfg, ops, rewards, dist
        self.rollouts, self.weights_group = rollouts, weights_group
        self.val_rows, self.skipped = val_rows, skipped
        self.frozen = shard(cfg, ops, dist)
        o = cfg.optim
        trained = [p for p in ops.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trained, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        from omnirl.step import UpdateTuning

        self.tuning = UpdateTuning(cfg, ops)  # auto checkpointing, train.compile, the update's clock
        self.queue: dict[int, list[dict]] = {}  # step -> one message per rollout rank
        self.logs: dict[str, float] = {}
        self.last = time.perf_counter()
        self.waited = 0.0
        from omnirl.rollout.compiled import CompileMeter

        self.compiled = CompileMeter()  # what each update spent compiling

    def run(self, resume: Path | None, done: int, events: list[tuple[str, int]]) -> dict[str, float]:
        from omnirl.metrics import MetricsLogger
        from omnirl.step import check_learned

        cfg, dist = self.cfg, self.dist
        history: list[dict] = []
        if resume is not None:
            done, history = checkpoint.load(
                resume, cfg, self.ops.policy, self.optimizer, dist, self.ops.state()
            )
            self.queue = load_queue(resume, dist.rank)
        self.trained = self.saved = done
        self.received = done - 1 + len(self.queue)
        self.sent = {i for e, i in events if e == "weights"}  # versions still to send
        self.logger = MetricsLogger(cfg.run.output_dir, dist.is_main, cfg.log.tensorboard, done, history)
        self.logger.progress(cfg.run.steps, initial=done)
        try:
            for event, i in events:
                start = time.perf_counter()
                if event == "samples":
                    self.queue[i] = receive_samples(i, self.rollouts)
                    self.received = i
                else:
                    assert self.trained == i, (self.trained, i)  # the schedule's promise
                    peer = f"a training rank or {named('rollout', self.rollouts)}"
                    with across(f"gathering and sending the weights after {i} updates", peer):
                        broadcast_trained(self.ops.policy, self.weights_group)
                    self.sent.discard(i)
                self.waited += time.perf_counter() - start
                self._drain()
            self._drain()
            assert self.trained == cfg.run.steps and not self.queue, (self.trained, sorted(self.queue))
            check_learned(cfg.run.steps - done, self.tuning.updates, self.tuning.skipped)
            if cfg.export.lora_at_end and cfg.model.finetune == "lora":
                checkpoint.export_lora(cfg, self.ops.adapter, self.ops.policy, dist)
        finally:
            self.logger.close()
        return self.logs

    def _checkpoint_due(self, done: int) -> bool:
        return done > self.saved and checkpoint.due(self.cfg, done)

    def _drain(self) -> None:
        """Save what is due and train what may be trained, until neither can go on."""
        steps, s = self.cfg.run.steps, self.cfg.distributed.max_staleness
        while True:
            j = self.trained
            if self._checkpoint_due(j):
                if self.received < min(j + s, steps) - 1:
                    return  # the checkpoint holds the next s steps' samples: wait for them
                checkpoint.save(
                    self.cfg, j, self.ops.policy, self.optimizer, self.dist, self.ops.state(),
                    rank_file=(QUEUE, dump_queue(self.queue)),
                )  # fmt: skip
                self.saved = j
                continue
            if j >= steps or j not in self.queue or j in self.sent:
                return
            self._train_step(j, self.queue.pop(j))
            self.trained = j + 1

    def _train_step(self, step: int, msgs: list[dict]) -> None:
        from omnirl.scoring import validate
        from omnirl.step import assign_advantages, reward_stats, update

        cfg, ops = self.cfg, self.ops
        start = time.perf_counter()
        trajs = sorted((t for m in msgs for t in m["trajs"]), key=lambda t: t.request.index)
        prompts, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        share = prompts // self.dist.world_size
        expected = list(range(self.dist.rank * share * group, (self.dist.rank + 1) * share * group))
        # Every sample of this rank's share, once: none lost at a weight sync, none trained twice.
        assert [t.request.index for t in trajs] == expected, (step, [t.request.index for t in trajs])
        per_reward = {name: np.zeros(0) for name in cfg.reward.weights}
        for m in msgs:
            for k, v in m["per_reward"].items():
                per_reward[k] = np.concatenate([per_reward[k], v])
        keep, adv_metrics = assign_advantages(cfg, trajs)
        self.optimizer.zero_grad(set_to_none=True)
        update_metrics = update(cfg, ops, self.optimizer, trajs, keep, step, self.tuning)
        stale = [float(step - m["version"]) for m in msgs for _ in m["trajs"]]
        sums = D.all_reduce(torch.tensor([sum(stale), float(len(stale))], dtype=torch.float64))
        worst = D.all_reduce(torch.tensor([max(stale)], dtype=torch.float64), op=tdist.ReduceOp.MAX)
        now = time.perf_counter()
        logs = {**reward_stats(per_reward), **adv_metrics, **update_metrics, **self.frozen}
        logs.update(
            {
                "async/staleness_mean": sums[0].item() / sums[1].item(),
                "async/staleness_max": worst.item(),
                "async/samples_trained": sums[1].item(),
                "async/samples_generated": float(sum(m["generated"] for m in msgs if m["per_reward"])),
                "async/rollout_generate_s": max(m["stats"]["time/generate_s"] for m in msgs),
                "async/rollout_score_wait_s": max(m["stats"]["time/score_wait_s"] for m in msgs),
                "async/wait_s": self.waited,
                "time/update_s": now - start,
                "time/step_s": now - self.last,
                **self.compiled.take(),
            }
        )
        self.last, self.waited = now, 0.0
        if step == 0 and self.skipped is not None:
            logs["data/skipped_rows"] = len(self.skipped)
        if cfg.validation.every and self.val_rows and (step + 1) % cfg.validation.every == 0:
            logs.update(validate(cfg, ops, self.rewards, self.val_rows, self.dist))
        self.logger.log(step, logs)
        if cfg.log.image_every and step % cfg.log.image_every == 0:
            ops.log_samples(self.logger, step, trajs)
        self.logger.update(step, logs["reward/mean"], logs["time/step_s"])
        self.logs = logs
