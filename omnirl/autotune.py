"""Memory-for-speed settings decided from measured memory, not by habit: `model.gradient_checkpointing:
auto` at the first update, from the measured peaks of one and two rows of its first micro-batch
(docs/update.md#gradient-checkpointing-modelgradient_checkpointing-auto), and `memory.sleep: auto` after
step 0, from the phases' measured peaks (docs/memory.md#sleep-and-wake). Every rank decides the same, and
each decision is printed once with its numbers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl import memory, probe_cache

GIB = 2**30
# Kept free beyond a measured peak (fragmentation): a share of the memory the process may use
# (memory.device_bytes: the device's, or the cap of memory.cap_device_memory), at least MARGIN_MIN_BYTES.
MARGIN_FRACTION = 0.05
MARGIN_MIN_BYTES = 2 * GIB


def margin_bytes(total: int) -> int:
    """The memory kept free beyond a measured peak on a process that may use `total` bytes (0: none)."""
    return max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * total)) if total else 0


@dataclass
class Decision:
    on: bool
    reason: str


def checkpointing_on(value: bool | str) -> bool:
    """What the policy is built with: `model.gradient_checkpointing` true; auto and false build without."""
    return value is True


def set_checkpointing(policy: nn.Module, on: bool) -> None:
    """Turn activation checkpointing of `policy`'s repeated blocks on or off, for each kind of model omnirl
    trains, found outermost first inside `policy` (Wan A14B's policy holds two diffusers experts): a
    diffusers model (`enable_gradient_checkpointing`), a transformers model (its decoder layers, as
    `omnirl.models.lm.checkpoint_decoder_layers` sets them), or a port with a `gradient_checkpointing`
    flag (BAGEL)."""
    import diffusers
    import transformers

    done: set[int] = set()
    for m in policy.modules():
        if id(m) in done:
            continue
        if isinstance(m, diffusers.ModelMixin):
            m.enable_gradient_checkpointing() if on else m.disable_gradient_checkpointing()
        elif isinstance(m, transformers.PreTrainedModel):
            from omnirl.models.lm import checkpoint_decoder_layers

            layers = decoder_layers(m)
            if on:
                checkpoint_decoder_layers(m, layers)
            else:
                m.gradient_checkpointing_disable()
                for layer in layers:
                    layer.training = False
        elif isinstance(getattr(m, "gradient_checkpointing", None), bool):
            setattr(m, "gradient_checkpointing", on)  # noqa: B010 (nn.Module's __setattr__ types tensors)
        else:
            continue
        done.update(id(c) for c in m.modules())
    if not done:
        raise TypeError(f"model.gradient_checkpointing: no checkpointing to set in a {type(policy).__name__}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers multimodal LM (as omnirl.models.lm reads them) or plain LM."""
    body = getattr(model, "model", None)
    inner = getattr(body, "language_model", body)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    return model.get_decoder().layers  # pyright: ignore[reportCallIssue, reportAttributeAccessIssue]


def optimizer_state_bytes(policy: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes AdamW's state (exp_avg, exp_avg_sq) will take once the first optimizer step makes it: 0 when
    it exists already (it is allocated, so the free memory counts it)."""
    if memory.optimizer_state(optimizer):
        return 0
    total = 0
    for p in policy.parameters():
        if p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += 2 * local.numel() * local.element_size()
    return total


def decide(peak: int | None, free: int, state: int, total: int, micro_batch: int) -> Decision:
    """Checkpointing on or off from the predicted peak of a micro-batch without it (None: the probe ran
    out of memory), the free bytes before it, the optimizer state still to come and the memory the process
    may use (the device's, or its cap)."""
    if peak is None:
        return Decision(True, f"a probe of a micro-batch of {micro_batch} rows ran out of device memory")
    margin = margin_bytes(total)
    need = peak + state + margin
    what = (
        f"a micro-batch of {micro_batch} rows needs {peak / GIB:.2f} GiB without it, the optimizer state "
        f"{state / GIB:.2f} GiB more, margin {margin / GIB:.2f} GiB; {free / GIB:.2f} GiB free"
    )
    return Decision(need > free, what)


def predicted_peak(peaks: dict[int, int], rows: int) -> int:
    """The peak of `rows` rows from the measured peaks of one and two rows (the line through them: a
    micro-batch's activations grow with its rows), rounded up; one measurement alone is taken as is."""
    if len(peaks) == 1 or rows <= 1:
        return peaks[min(peaks)]
    per_row = max(peaks[2] - peaks[1], 0)
    return peaks[1] + (rows - 1) * per_row


def probe_checkpointing(ops, optimizer: torch.optim.Optimizer, mb: list, normaliser: float) -> Decision:
    """Measure the forward, loss and backward of the first one and two rows of a micro-batch without
    checkpointing, predict the whole micro-batch's peak and decide (collective: every rank calls it with
    its first micro-batch). Two small rows cannot run out of memory where the whole micro-batch would, on
    one rank while another waits in a collective. The random state and the gradients are as before. An
    earlier run of the same key's peaks (`omnirl.probe_cache`) stand in for the measurement where every
    rank has them."""
    device = ops.adapter.device
    set_checkpointing(ops.policy, False)
    free = memory.free_bytes(device)
    state = optimizer_state_bytes(ops.policy, optimizer)
    item = f"{len(mb)} rows, {probe_cache.shapes((mb * 2)[:2])}"
    kept = probe_cache.get("checkpointing", item, everyone=True)
    if kept is not None:
        peaks, oom = {int(k): int(v) for k, v in kept["peaks"].items()}, bool(kept["oom"])
    else:
        peaks, oom = measure_peaks(ops, optimizer, mb, normaliser)
        probe_cache.put("checkpointing", item, {"peaks": peaks, "oom": oom})
    mine = decide(
        None if oom else predicted_peak(peaks, len(mb)), free, state, memory.device_bytes(device), len(mb)
    )
    votes = D.all_reduce(torch.tensor([float(mine.on)]), op=torch.distributed.ReduceOp.MAX)
    on = bool(votes.item())
    reason = mine.reason if on == mine.on else f"another rank needs it ({mine.reason} on this one)"
    set_checkpointing(ops.policy, on)
    return Decision(on, reason)


def measure_peaks(ops, optimizer: torch.optim.Optimizer, mb: list, normaliser: float) -> tuple[dict, bool]:
    """The peak bytes of the forward, loss and backward of one and of two rows of `mb` (as the policy is
    set now), and whether one ran out of device memory (then its size and those after are missing)."""
    device = ops.adapter.device
    devices = [device] if device.type != "cpu" else []
    peaks: dict[int, int] = {}
    oom = False
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        for rows in (1, 2):  # on every rank, also one whose micro-batch is one padding row: collectives
            # Copies of the rows: a loss may count on them (DiffusionNFT draws each pass's time anew).
            part = [copy.copy(r) for r in (mb * 2)[:rows]]

            def run(part=part) -> None:
                loss, _ = ops.loss(part, normaliser, False)
                loss.backward()

            try:
                peaks[rows] = memory.peak_bytes(run, device)
            except torch.OutOfMemoryError:
                oom = True
                break
            finally:
                optimizer.zero_grad(set_to_none=True)
    if oom:
        memory.empty_cache()
    return peaks, oom


class AutoCheckpointing:
    """The pending `model.gradient_checkpointing: auto` decision of a run: made at its first update."""

    def __init__(self, value: bool | str):
        self.pending = value == "auto"
        self.on = checkpointing_on(value)

    def maybe_decide(self, ops, optimizer, mb: list | None, normaliser: float) -> dict[str, float]:
        if not self.pending or mb is None:
            return {"train/gradient_checkpointing": float(self.on)}
        decision = probe_checkpointing(ops, optimizer, mb, normaliser)
        memory.restart_peak()  # the update's peak without the probe's: what memory.sleep auto reads
        self.pending, self.on = False, decision.on
        D.print0(f"model.gradient_checkpointing auto: {'on' if decision.on else 'off'} ({decision.reason})")
        return {"train/gradient_checkpointing": float(self.on)}


def sleep_decision(
    rollout_peak: int, train_peak: int, groups: dict[str, int], total: int
) -> tuple[set[str], str]:
    """The groups that stay on the device, and why, from step 0's measured phase peaks (each from after the
    phase's sleep, so without the groups that slept through it), the groups' bytes and the device's size."""
    margin = margin_bytes(total)
    offload, train_only = groups["offload"], groups["optimizer"] + groups["reference"]
    awake: set[str] = set()
    if train_peak + offload + margin <= total:
        awake.add("offload")
    if rollout_peak + train_only + margin <= total:
        awake.update(("optimizer", "reference"))
    reason = (
        f"update peak {train_peak / GIB:.2f} GiB + text encoders, VAE and rewards {offload / GIB:.2f} GiB; "
        f"rollout peak {rollout_peak / GIB:.2f} GiB + optimizer state and reference "
        f"{train_only / GIB:.2f} GiB; margin {margin / GIB:.2f} GiB of {total / GIB:.2f} GiB"
    )
    return awake, reason


class AutoSleep:
    """The `memory.sleep: auto` decision of a run, made when its first train phase ends
    (`Phases.after_train`), from the allocator's peak reservation of that step's phases
    (`mem/{rollout,train}_reserved_gib`: the tensors and the fragmentation they caused)."""

    def __init__(self, value: bool | str, phases: memory.Phases, device: torch.device):
        self.phases, self.device = phases, device
        # No decision without device memory to measure (CPU) or with an engine of its own (vLLM's pool is
        # outside the peaks torch's allocator reports): there, auto sleeps as true.
        sleeps = phases.sleeper is not None and phases.engine is None
        if value == "auto" and sleeps and memory.device_bytes(device):
            phases.after_train = self.decide

    def decide(self, stats: dict[str, float]) -> None:
        self.phases.after_train = None
        rollout, train = (int(stats[f"mem/{n}_reserved_gib"] * GIB) for n in ("rollout", "train"))
        groups = self.phases.group_bytes()
        awake, reason = sleep_decision(rollout, train, groups, memory.device_bytes(self.device))
        # A group stays awake only where it does on every rank: a sleep vote of 1 from any rank wins.
        names = sorted(groups)
        sleeps = torch.tensor([float(n not in awake) for n in names])
        votes = D.all_reduce(sleeps, op=torch.distributed.ReduceOp.MAX)
        awake = {n for n, v in zip(names, votes.tolist()) if v == 0}
        self.phases.awake = awake
        kept = ", ".join(n for n in names if n in awake and groups[n]) or "nothing"
        if all(n in awake for n in names if groups[n]):
            kept += "; nothing sleeps, so the host buffers go back once the rollout-only modules wake"
        D.print0(f"memory.sleep auto: from step 1 on the device: {kept} ({reason})")
