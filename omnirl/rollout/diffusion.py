"""DiffusionEngine: packs requests into compatible batches and runs each as one denoising loop.

The `RequestPacker` groups requests by the adapter's compatibility key under `max_num_seqs` and
`max_num_batched_tokens`; the adapter's `rollout` runs a batch as one transformer forward per denoising
step with one generator per request, so the packed result equals the serial one to fp32 rounding. Each
finished batch goes to `on_batch` at once, so reward scoring overlaps the next batch's denoising. The
engine calls the very module the optimizer updates: under FSDP2 its weights are gathered once per rollout
phase, or one unit per forward (`per_unit`, padding batches keeping the ranks in step). Before the first
batch of each key it measures what a batch costs (`_probe`) and refuses a max_num_seqs that does not fit.
`precision` fp8 runs the blocks' linear layers in FP8 (`omnirl.rollout.fp8`); `compile` compiles the
repeated blocks for the rollout only (`omnirl.rollout.compiled`).

How each part works: docs/rollout.md#packed-diffusion-rollout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from omnirl import distributed as D
from omnirl import fsdp, phase_clock, probe_cache
from omnirl.config import RolloutConfig
from omnirl.memory import GIB, empty_cache, free_bytes, peak_bytes
from omnirl.models.base import DiffusionAdapter, Request, Trajectory
from omnirl.rollout.compiled import Compiled, compile_forwards, eager, swapped
from omnirl.rollout.fp8 import Fp8Rollout
from omnirl.rollout.packer import RequestPacker


def bucket_size(n: int, capacity: int) -> int:
    """The bucket a batch of `n` requests is padded to, at most `capacity`: the next power of two up to 8,
    then the next multiple of 8, 16, 32, ... (an eighth of the power of two below n, at least 8), so a
    batch is padded by at most ~1/8 (a power of two pads 33 to 64, i.e. wastes nearly half) and the
    number of shapes to compile grows only logarithmically: 1, 2, 4, 8, 16, 24, ..., 64, 80, ..., 128."""
    if n <= 8:
        size = 1 << (n - 1).bit_length()
    else:
        step = max(8, 1 << (n.bit_length() - 4))
        size = -(-n // step) * step
    return min(size, capacity)


class DiffusionEngine:
    """Built from the rollout section (`RolloutConfig`: max_num_seqs, max_num_batched_tokens, compile,
    memory_budget_gib, precision and fp8) and whether each forward gathers one FSDP unit (`per_unit`:
    distributed.rollout_gather unit)."""

    def __init__(self, adapter: DiffusionAdapter, rollout: RolloutConfig, per_unit: bool = False):
        self.adapter = adapter
        self.per_unit = per_unit
        self.memory_budget = (
            rollout.memory_budget_gib * 2**30
        )  # bytes; 0 = the free device memory (none on CPU)
        # compatibility key -> (fixed bytes, bytes per request, the rows of its larger probe): measured once,
        # and again only when a larger batch of the key lets the probe go further towards 2k rows
        self.row_cost: dict = {}
        self.stats: dict[str, float] = {}  # the last call's padding batches and per-request cost
        self.packer = RequestPacker(
            rollout.max_num_seqs, rollout.max_num_batched_tokens, adapter.compat_key, self.tokens
        )
        # Padding to bucket sizes is what keeps a compiled rollout from recompiling; eager needs none.
        self.pad = rollout.compile
        self.compiled: Compiled = []
        if rollout.compile:
            self.compiled = compile_forwards(adapter.fsdp_units())
        self.fp8: Fp8Rollout | None = None
        if rollout.precision == "fp8":
            D.check_fp8_matmul(adapter.device)
            self.fp8 = Fp8Rollout(adapter.fsdp_units(), adapter.fp8_keep_bf16, rollout.fp8.fast_accum)
        self.use_fp8 = self.fp8 is not None  # `in_bf16` turns it off for a call
        self.fp8_untrained_only = rollout.fp8.steps == "untrained"
        self.steps_switched = 0  # step hook calls in the current batch (fp8.steps untrained)

    def tokens(self, request: Request) -> int:
        """Transformer tokens of a request in one forward: its CFG row counts too when fused."""
        rows = 2 if request.params.fused_cfg and request.params.guidance_scale > 1 else 1
        return rows * self.adapter.num_tokens(request)

    def padding(self, batch: list[Request]) -> list[Request]:
        """Dummy requests that pad `batch` to its bucket size (none unless `pad`)."""
        if not self.pad:
            return []
        capacity = self.packer.capacity(max(self.tokens(r) for r in batch))  # the bucket stays in budget
        # Copies of the shortest request (the packer sorts by tokens), so shapes and keys match; index -1
        # marks them. The adapter builds a generator per row, so a dummy draws from its own generator
        # object (seeded like batch[0]'s) and no real request's noise moves.
        return [self._dummy(batch[0])] * (bucket_size(len(batch), capacity) - len(batch))

    @contextlib.contextmanager
    def in_bf16(self):
        """Run the rollouts inside in the policy's own precision, also in an FP8 engine (validation, and
        Sol-RL's regeneration of the samples it trains on)."""
        use, self.use_fp8 = self.use_fp8, False
        try:
            yield
        finally:
            self.use_fp8 = use

    @contextlib.contextmanager
    def _running(self):
        """What a rollout runs under: the compiled blocks swapped in, the weights gathered as
        distributed.rollout_gather says, and (rollout.precision fp8) the blocks' FP8 layers, quantised from
        the gathered weights."""
        fp8 = self._fp8_on()
        with (
            swapped(self.compiled),
            fsdp.gathered_weights(self.adapter.policy, per_unit=self.per_unit),
            fp8.swapped() if fp8 is not None else contextlib.nullcontext(),
        ):
            yield

    def _fp8_on(self) -> Fp8Rollout | None:
        """The FP8 layers when this call runs them (rollout.precision fp8, not turned off by `in_bf16`)."""
        return self.fp8 if self.use_fp8 else None

    def _per_step_fp8(self) -> bool:
        return self._fp8_on() is not None and self.fp8_untrained_only

    def _on_step(self) -> Callable[[bool], None] | None:
        """What the adapter's denoising loop runs before each step (`DiffusionAdapter.rollout`'s
        `on_step`): the step's precision with FP8 on untrained steps, else nothing."""
        return self._step_precision if self._per_step_fp8() else None

    def _step_precision(self, trained: bool) -> None:
        """The step hook of FP8 on untrained steps: a step that trains a row runs the policy's own layers."""
        assert self.fp8 is not None
        self.fp8.use(not trained)
        self.steps_switched += 1

    def _plan(self, requests: list[Request]):
        """The batches of `requests`, every rank's templates, and the memory check of their keys."""
        packed = self.packer.pack(requests, fill=self.pad)
        batches = [[requests[i] for i in idx] for idx in packed]
        templates = self._templates(batches)
        self._check_memory(templates)
        return packed, batches, templates

    @torch.no_grad()
    def check_memory(self, requests: list[Request]) -> None:
        """Run the memory check a `generate(requests)` runs before its first batch (it measures each key
        once, at the sizes of its largest batch), without generating: a benchmark calls it before timing
        so that no timed generation includes the probes. A collective under unit gathering."""
        with self._running():
            self._plan(requests)

    @torch.no_grad()
    def generate(
        self,
        requests: list[Request],
        on_batch: Callable[[list[Trajectory]], None] | None = None,
    ) -> list[Trajectory]:
        """Trajectories in the order of `requests`; `on_batch` gets each finished batch's (real) ones."""
        results: list[Trajectory | None] = [None] * len(requests)
        with self._running():
            packed, batches, templates = self._plan(requests)
            for idx, batch in zip(packed, batches):
                self.steps_switched = 0
                rows = batch + self.padding(batch)
                try:
                    trajs = self.adapter.rollout(rows, self._on_step())[: len(batch)]
                except RuntimeError as e:
                    if self._fp8_on() is None or "CUBLAS_STATUS_NOT_SUPPORTED" not in str(e):
                        raise
                    # A known cuBLASLt refusal (docs/fp8_rollout.md): name the batch and the way out.
                    raise RuntimeError(
                        f"FP8 rollout: cuBLASLt refused an FP8 GEMM of a batch of {len(rows)} requests "
                        f"({str(e).splitlines()[0][:80]}...); rollout.precision bf16 runs this recipe"
                    ) from e
                if self._per_step_fp8() and not self.steps_switched:
                    # its trained steps would have run in FP8, their log-probs taken for the trainer's
                    raise RuntimeError(
                        f"{type(self.adapter).__name__}.rollout does not step through sampler.steps(): "
                        "rollout.fp8.steps untrained cannot keep its trained steps in bf16"
                    )
                for i, t in zip(idx, trajs):
                    results[i] = t
                if on_batch is not None:
                    on_batch(trajs)
            # Unit gathering: every rank runs as many forwards (the others wait in their all-gathers).
            extra = max(n for n, _ in templates) - len(batches) if self.per_unit else 0
            for _ in range(extra):
                dummy = self._dummy(next(r for _, keyed in templates for r, _ in keyed))
                self.adapter.rollout([dummy], self._on_step())
            self.stats["padding_batches"] = extra
        done = [t for t in results if t is not None]
        assert len(done) == len(results)
        return done

    @staticmethod
    def _dummy(request: Request) -> Request:
        return dataclasses.replace(request, index=-1, group_id=-1, metadata={})

    @classmethod
    def _probe(cls, request: Request) -> Request:
        """A dummy of `request` whose rollout needs the same memory in fewer denoising steps: every step's
        forward has the same shapes, and what a rollout holds across steps (the [B, K, ...] records of its
        K trained steps, dpm2's previous data prediction) depends on K, not on the number of steps. So it
        runs its K trained steps from step 0 and two steps more (an SDE step, an ODE step and a
        second-order one all occur), the decode whole; a window of every step (size 0) keeps them all.
        What it leaves out is per-step bookkeeping of a few bytes a row (sigmas, step row indices)."""
        p = request.params
        if not p.record_logprobs:
            steps, size, span = min(p.num_steps, 2), p.sde_window_size, p.sde_window_range
        elif p.sde_window_size == 0:
            steps, size, span = p.num_steps, 0, p.sde_window_range
        else:
            size = p.sde_window_size
            steps, span = min(p.num_steps, size + 2), (0, size)
        # A window from step 0 holds the K records of any schedule's K trained steps (a compressed one's too).
        schedule = "contiguous" if p.sde_window_schedule in ("dance", "subset") else p.sde_window_schedule
        params = dataclasses.replace(
            p, num_steps=steps, sde_window_size=size, sde_window_range=span, sde_window_schedule=schedule
        )
        return dataclasses.replace(cls._dummy(request), params=params)

    def _templates(self, batches: list[list[Request]]) -> list[tuple[int, list[tuple[Request, int]]]]:
        """Per rank: (its number of batches, per key the key's first request and the rows of its largest
        batch, padding included). Only unit gathering needs the other ranks' (for padding batches and for
        measuring the same keys at the same sizes on every rank, both collectives); otherwise this rank's
        alone."""
        keyed = self._largest((batch[0], len(batch) + len(self.padding(batch))) for batch in batches)
        mine = (len(batches), list(keyed.values()))
        return D.all_gather_object(mine) if self.per_unit else [mine]

    def _largest(self, sized) -> dict:
        """(request, rows) pairs -> per compatibility key: (its first request, the most rows of any)."""
        largest: dict = {}
        for request, rows in sized:
            key = self.adapter.compat_key(request)
            first, most = largest.get(key, (request, 0))
            largest[key] = (first, max(most, rows))
        return largest

    def _check_memory(self, templates) -> None:
        """Measure each new key's cost (all ranks' keys, in one order, under unit gathering) and stop when
        the largest batch of a key would not fit the budget."""
        device = self.adapter.device
        budget = self.memory_budget or (free_bytes(device) if device.type != "cpu" else 0)
        if not budget:
            return
        # key -> (a request of it, the rows of its largest batch on any rank)
        largest = self._largest(pair for _, keyed in templates for pair in keyed)
        for key, (request, rows) in largest.items():
            top = min(rows, 2 * self.adapter.memory_probe_rows)
            if key not in self.row_cost or self.row_cost[key][2] < top:
                self.row_cost[key] = self._kept_or_measured(key, request, top, budget)
            fixed, per_row, _ = self.row_cost[key]
            fits = int((budget - fixed) // per_row)
            if rows > fits:
                raise ValueError(
                    f"rollout.max_num_seqs {self.packer.max_num_seqs} does not fit: a batch of {rows} "
                    f"requests needs {(fixed + rows * per_row) / GIB:.3f} GiB ({fixed / GIB:.3f} GiB + "
                    f"{per_row / GIB:.4f} GiB per request, measured), the rollout may use "
                    f"{budget / GIB:.3f} GiB (rollout.memory_budget_gib, 0 = the free device memory): "
                    f"the largest rollout.max_num_seqs that fits is {max(fits, 0)}"
                )
        if largest:  # what one more request costs (from k rows up), for the dearest key
            self.stats["row_gib"] = max(self.row_cost[key][1] for key in largest) / GIB

    def _kept_or_measured(self, key, request: Request, top: int, budget: float) -> tuple[int, int, int]:
        """The key's cost as an earlier run of the same run key measured it (`omnirl.probe_cache`; under
        unit gathering only where every rank has it: the probes are collectives there), else measured and
        kept."""
        item = f"{key!r} up to {top} rows"
        kept = probe_cache.get("rollout", item, everyone=self.per_unit)
        if kept is not None:
            return int(kept[0]), int(kept[1]), int(kept[2])
        with phase_clock.alone("memory_probe"):  # the step's `time/memory_probe_s`
            cost = self._measure(request, top, budget)
        probe_cache.put("rollout", item, list(cost))
        return cost

    def _measure(self, request: Request, top: int, budget: float) -> tuple[int, int, int]:
        """(fixed bytes, bytes per request, top): the line through the peaks of rollouts of `top` rows and
        of k rows (`memory_probe_rows`), or of half of `top` when `top` is at most k (none at all for one
        row: a line through zero bytes at zero rows, which errs high). Its slope is rounded up, so the
        line passes through the measured peak at `top` rows and errs high beyond it."""
        k = self.adapter.memory_probe_rows
        assert k >= 1, k
        low = k if top > k else top // 2
        dummy = self._probe(request)
        peaks = {0: 0}
        for rows in sorted({low, top} - {0}):
            # Eager: compiled, each probe size is a graph per block variant, traced (and on an empty cache
            # compiled) at step 0 and never run again. Without fused kernels the probe holds intermediates
            # a compiled forward fuses away, so its line errs high, as the slope's rounding does.
            with eager(self.compiled):
                peak = self._peak([dummy] * rows)
            if peak is None:
                empty_cache()  # the failed rollout's tensors went with its traceback; hand back their blocks
                raise ValueError(
                    f"rollout.max_num_seqs {self.packer.max_num_seqs} does not fit: measuring what a batch "
                    f"needs, a rollout of {rows} requests ran out of device memory (the rollout may use "
                    f"{budget / GIB:.3f} GiB, rollout.memory_budget_gib, 0 = the free device memory): "
                    f"the largest rollout.max_num_seqs that fits is below {rows}"
                )
            peaks[rows] = peak
        per_row = max(-(-(peaks[top] - peaks[low]) // (top - low)), 1)
        return peaks[top] - top * per_row, per_row, top

    def _peak(self, batch: list[Request]) -> int | None:
        """The peak bytes of a rollout of `batch`; None when it ran out of device memory (returning from
        the handler drops the exception and, with its traceback, what the rollout had allocated)."""
        try:
            return peak_bytes(functools.partial(self.adapter.rollout, batch), self.adapter.device)
        except torch.OutOfMemoryError:
            return None
