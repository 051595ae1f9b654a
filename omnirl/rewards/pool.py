"""RewardPool: score finished samples on worker threads with several weighted rewards.

`submit` returns a handle at once, so one batch's rewards are computed while the next batch denoises;
`result` waits, checks every score and combines them. A latent reward's batches are held and scored in
the caller's thread by `score_held`. A reward that raises, returns the wrong number of scores or a
non-finite score, or runs past `timeout_s` is a `RewardError` naming it: a sample is never silently
scored 0.

How it works: docs/rewards.md#the-reward-pool
"""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from omnirl.models.base import Output
from omnirl.rewards import Reward, check_reward_paths, get_reward, reward_inputs, reward_modules


class RewardError(RuntimeError):
    """A reward failed on a batch; the message names the reward."""


@dataclass
class RewardResult:
    total: np.ndarray  # [N] float64, sum over rewards of weight * score
    per_reward: dict[str, np.ndarray]  # name -> [N] float64, unweighted scores


@dataclass(eq=False)
class _Job:
    name: str
    args: tuple[list, list[str], list[dict[str, Any]]]  # the reward's inputs (reward_inputs), prompts, rows
    future: Future
    started: float | None = None  # time.monotonic() when the reward was called


@dataclass(eq=False)
class PendingScores:
    """The handle `submit` returns: one job per reward for one batch. Pass it to `RewardPool.result`."""

    jobs: list[_Job]

    def done(self) -> bool:
        return all(job.future.done() for job in self.jobs)


class RewardPool:
    def __init__(
        self,
        weights: dict[str, float],
        num_workers: int,
        timeout_s: float,
        paths: dict[str, str] | None = None,
        adapter: Any = None,
        cfg: Any = None,
    ):
        """`weights`: reward name (omnirl.rewards.REWARDS) -> weight; each reward is built once, here, with
        its local checkpoint from `paths` when it has one there, and a latent reward also with the model's
        `adapter` and the run's `cfg` (it reads that model's latent space)."""
        paths = paths or {}
        for name in weights:
            get_reward(name)  # every unknown name fails before any reward is built
        check_reward_paths(weights, paths)  # every local checkpoint's files, before any reward loads
        built = {}
        for name, weight in weights.items():
            cls, args = get_reward(name), [paths[name]] if name in paths else []
            if cls.modality == "latent":
                if adapter is None:
                    raise ValueError(f"reward {name!r} reads latents: the pool needs the model's adapter")
                args = [paths.get(name), adapter, cfg]
            built[name] = (cls(*args), weight)
        self._start(built, num_workers, timeout_s)

    @classmethod
    def from_instances(
        cls, rewards: dict[str, tuple[Reward, float]], num_workers: int, timeout_s: float
    ) -> RewardPool:
        """A pool of reward objects built by the caller: name -> (reward, weight)."""
        pool = cls.__new__(cls)
        pool._start(dict(rewards), num_workers, timeout_s)
        return pool

    def _start(self, rewards: dict[str, tuple[Reward, float]], num_workers: int, timeout_s: float) -> None:
        if not rewards:
            raise ValueError("reward.weights is empty: name at least one reward")
        for name, (_, weight) in rewards.items():
            if not math.isfinite(weight):
                raise ValueError(f"reward.weights.{name}: weight must be finite, got {weight}")
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.rewards = {name: reward for name, (reward, _) in rewards.items()}
        self.weights = {name: float(weight) for name, (_, weight) in rewards.items()}
        self.timeout_s = timeout_s
        self._locks = {name: threading.Lock() for name in rewards}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[PendingScores] = []  # submitted, not yet returned by `result`
        self._held: list[_Job] = []  # latent rewards' jobs, run by `score_held` in the caller's thread
        self._closed = False
        self._workers = [threading.Thread(target=self._work, daemon=True) for _ in range(num_workers)]
        for t in self._workers:
            t.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            with self._locks[job.name]:
                job.started = time.monotonic()
                try:
                    job.future.set_result(self.rewards[job.name](*job.args))
                except BaseException as e:
                    job.future.set_exception(e)

    def submit(
        self, outputs: list[Output], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> PendingScores:
        """Queue one batch for every reward (each called with the modality it reads) and return at once."""
        assert not self._closed, "submit() after close()"
        if not len(outputs) == len(prompts) == len(metadata):
            raise ValueError(
                f"outputs, prompts and metadata must have one entry per sample, "
                f"got {len(outputs)}, {len(prompts)}, {len(metadata)}"
            )
        # Each modality is converted once per batch (e.g. to PIL for every image reward).
        modalities = {reward.modality for reward in self.rewards.values()}
        inputs = {m: reward_inputs(outputs, m) for m in modalities}
        jobs = [
            _Job(name, (inputs[reward.modality], list(prompts), list(metadata)), Future())
            for name, reward in self.rewards.items()
        ]
        for job in jobs:
            if self.rewards[job.name].modality == "latent":
                self._held.append(job)
            else:
                self._queue.put(job)
        pending = PendingScores(jobs)
        self._pending.append(pending)
        return pending

    def score_held(self) -> None:
        """Score the held batches of every latent reward, here, in one call per reward (all its batches
        together; an empty call when there are none, so that every rank makes the same calls: a reward
        whose forwards are collectives runs them in step). Every rank calls it once after its generation,
        before `result`."""
        held, self._held = self._held, []
        for name, reward in self.rewards.items():
            if reward.modality != "latent":
                continue
            jobs = [job for job in held if job.name == name]
            samples = [x for job in jobs for x in job.args[0]]
            prompts = [x for job in jobs for x in job.args[1]]
            rows = [x for job in jobs for x in job.args[2]]
            for job in jobs:
                job.future.set_running_or_notify_cancel()
                job.started = time.monotonic()
            try:
                scores = reward(samples, prompts, rows)
            except BaseException as e:
                for job in jobs:
                    job.future.set_exception(e)
                continue
            if not isinstance(scores, (list, tuple, np.ndarray)) or len(scores) != len(samples):
                for job in jobs:  # `_check` reports it, naming the reward, when `result` reaches the job
                    job.future.set_result(scores)
                continue
            at = 0
            for job in jobs:
                job.future.set_result(scores[at : at + len(job.args[0])])
                at += len(job.args[0])

    def result(self, pending: PendingScores) -> RewardResult:
        """Wait for a submitted batch, check every reward's scores and combine them."""
        assert not any(job in self._held for job in pending.jobs), "score_held() before result()"
        jobs = pending.jobs
        n = len(jobs[0].args[0])
        for job in jobs:
            while not job.future.done():
                # Every running job of every pending batch is checked: a hung job of an earlier batch may
                # hold the workers this batch waits for.
                running = [j for p in self._pending for j in p.jobs if self._is_running(j)]
                now = time.monotonic()
                for j in running:
                    assert j.started is not None  # _is_running: started and not done
                    if now - j.started > self.timeout_s:
                        raise RewardError(
                            f"reward {j.name!r} took longer than timeout_s={self.timeout_s} s on a batch of "
                            f"{len(j.args[0])} (still running)"
                        )
                # Sleep until the earliest running job would time out, or briefly while none has started.
                if running:
                    started = [j.started for j in running if j.started is not None]  # all: _is_running
                    timeout = min(started) + self.timeout_s - now + 0.01
                else:
                    timeout = 0.05
                wait([job.future], timeout=timeout)
        self._pending.remove(pending)
        per_reward = {}
        for job in jobs:
            if job.future.exception() is not None:
                raise RewardError(
                    f"reward {job.name!r} raised on a batch of {n}: {job.future.exception()!r}"
                ) from job.future.exception()
            per_reward[job.name] = self._check(job.name, job.future.result(), n, job.args[1])
        total = sum(self.weights[name] * scores for name, scores in per_reward.items())
        return RewardResult(total=np.asarray(total, dtype=np.float64), per_reward=per_reward)

    def modules(self) -> list[nn.Module]:
        """Every reward's modules (`reward_modules`): they sleep with the rollout-only modules."""
        return [m for reward in self.rewards.values() for m in reward_modules(reward)]

    @staticmethod
    def _is_running(job: _Job) -> bool:
        return job.started is not None and not job.future.done()

    @staticmethod
    def _check(name: str, scores: Any, n: int, prompts: list[str]) -> np.ndarray:
        if not isinstance(scores, (list, tuple, np.ndarray)):
            raise RewardError(
                f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} floats"
            )
        try:
            arr = np.asarray(scores, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward {name!r} returned scores that are not numbers: {e}") from None
        if arr.shape != (n,):
            raise RewardError(
                f"reward {name!r} returned shape {arr.shape} for a batch of {n} (expected ({n},))"
            )
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            i = int(bad[0])
            raise RewardError(
                f"reward {name!r} returned {bad.size} non-finite score(s), "
                f"e.g. {arr[i]} for prompt {prompts[i]!r}"
            )
        return arr

    def score(
        self, outputs: list[Output], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        pending = self.submit(outputs, prompts, metadata)
        self.score_held()
        return self.result(pending)

    def close(self) -> None:
        """Stop the workers once the queued jobs are done; a hung job's daemon thread is abandoned."""
        self._closed = True
        for _ in self._workers:
            self._queue.put(None)
