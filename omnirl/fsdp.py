"""FSDP2 on the models and how they are loaded: the policy's placement for its frozen base, `fully_shard`
on an adapter's units (`shard`: a run's policy and reference copy), the bytes sharded and gathered weights
take, the weights gathered once for a rollout phase, and models read on rank 0 and broadcast (or built
by `building_with` instead).

The devices, the process group and the DeviceMesh this works over come from `distributed.py`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from transformers import PreTrainedModel

from omnirl import distributed as D
from omnirl.config import Config
from omnirl.distributed import device_type, local_device
from omnirl.errors import ConfigError
from omnirl.memory import free_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# A module type kept through a function that returns its argument (or one of the same class).
M = TypeVar("M", bound=nn.Module)


def place_policy(model: M, frozen_base: str, device: torch.device) -> M:
    """An adapter's policy, as loaded (on the host), moved onto `device` when its frozen base is replicated,
    and left where it is when FSDP2 shards it (distributed.frozen_base shard / offload): `apply_fsdp`'s
    `fully_shard` then moves each unit to the device itself, one call (one unit) at a time, shards it there
    and frees the whole unit (offload: the shards go to host memory), so the device never holds the whole
    base. A replicated base must move now: FSDP2 leaves the parameters it ignores where they are."""
    if frozen_base == "replicate":
        model.to(device)
    return model


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    ignored_params: set[nn.Parameter] | None = None,
    offload: bool = False,
) -> nn.Module:
    """FSDP2 `fully_shard` on each unit an adapter names, then on the root.

    `ignored_params` (the frozen base of a LoRA model with distributed.frozen_base replicate) stay plain
    replicated tensors; only the trainable parameters become sharded DTensors. Without them the frozen
    parameters are sharded with the trained ones in the same units (FSDP2 takes units that mix frozen and
    trained parameters: it reduces gradients only for those that have one). `offload` keeps every shard in
    pinned host memory (`CPUOffloadPolicy`, which covers a whole `fully_shard` call: the trained
    parameters of a unit, their gradients and hence their optimizer state too). When parameters are
    sharded, each unit's forward issues the next unit's all-gather ahead of it (explicit forward prefetch;
    FSDP2 prefetches only backward by itself). Gradients are summed, not averaged, over ranks: the losses
    are already divided by the global (all-reduced) sample or token count.

    The root does not cast its floating-point inputs to `param_dtype`; the units do (their inputs are
    activations), by `cast_inputs`, which also casts in a checkpointed unit's recompute. A root's inputs are
    what the caller chose: Qwen3-Omni's M-RoPE position ids are float32 (video positions can be fractional),
    and in bfloat16 integers above 256 round to even numbers (above 512 to multiples of 4), which moved the
    rotary positions of every long prompt and response; SD3's timesteps are float32 in the stock pipeline, and
    rounding them changes the time embedding. So adapters pass their inputs in the dtype the model computes in
    (latents, text embeddings) and keep positions and timesteps as the stock pipeline does, with or without
    FSDP: in the dtype `compute_dtype` names.
    """
    # No FSDP2 input cast anywhere: the units cast their inputs by `cast_inputs`, in every forward.
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype], cast_forward_inputs=False
    )
    ignored = ignored_params or set()
    # pin_memory only where there is an accelerator to copy to (pinning needs one).
    # OffloadPolicy(): fully_shard's default, no offloading.
    placed = CPUOffloadPolicy(pin_memory=device_type() != "cpu") if offload else OffloadPolicy()
    for unit in units:
        own = ignored & set(unit.parameters())
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=placed, ignored_params=own)
        unit.register_forward_pre_hook(functools.partial(cast_inputs, DTYPES[param_dtype]), with_kwargs=True)
        # Ahead of FSDP2's post-forward hook, which hooks the pre-backward (the all-gather) onto the outputs.
        unit.register_forward_hook(own_outputs, prepend=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=placed, ignored_params=ignored)
    model.register_forward_hook(own_outputs, prepend=True)
    # Read by `compute_dtype`. (torch types Module.__setattr__ for tensors and modules; any value is kept.)
    model._omnirl_compute_dtype = DTYPES[param_dtype]  # pyright: ignore[reportArgumentType]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    if not ignored:
        for unit, following in forward_chains(model, units):
            assert isinstance(unit, FSDPModule) and isinstance(following, FSDPModule)  # fully_shard made them
            unit.set_modules_to_forward_prefetch([following])
    return model


def own_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
    """Each unit's and the root's forward hook: a trained output that is a view, a copy instead. A root
    whose last layer is an nn.Linear on a 3-D input returns a view (torch views the 2-D matmul's result back
    to 3-D): Qwen-Image-Edit's and LTX-2's proj_out; FLUX's single-stream blocks return their text and image
    rows as two slices of one tensor. FSDP2 hooks its pre-backward onto the outputs, and an in-place op on a
    view would drop that hook (its all-gather, hence the gradient), which it warns of on every forward; a
    copy (activation-sized, one per trained forward of such a module) has its own hook that nothing can
    drop. Without gradients nothing is copied."""
    if not torch.is_grad_enabled():
        return output

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.requires_grad and t._base is not None else t

    return tree_map_only(torch.Tensor, own, output)


def shard(cfg: Config, ops: Any, dist: D.DistInfo) -> dict[str, float]:
    """FSDP2 over the policy and over the reference copy of a full fine-tune, the frozen weights as
    distributed.frozen_base says: a LoRA's base replicated (only the trained parameters sharded), sharded
    with them, or sharded and offloaded to host memory; a full fine-tune's reference copy sharded like
    the actor, offloaded with 'offload' (its actor, all trained, stays on the device). Returns the bytes
    of frozen parameters this rank then holds and the part of them on its device (`frozen_bytes`), which
    the trainer logs every step (mem/frozen_bytes, mem/frozen_device_bytes), and prints them with the way
    the rollout gathers the weights."""
    if cfg.distributed.fsdp and dist.mesh is not None:
        _apply_fsdp(cfg, ops, dist)
    d = cfg.distributed
    models = [ops.policy] + ([ops.ref_model] if ops.ref_model is not None else [])
    held, on_device = (sum(n) for n in zip(*(frozen_bytes(m) for m in models)))
    D.print0(
        f"frozen weights: {d.frozen_base}, {held / 2**20:.1f} MiB on each rank ({on_device / 2**20:.1f} MiB "
        f"of it on the device); the rollout gathers weights per {d.rollout_gather}"
    )
    return {"mem/frozen_bytes": float(held), "mem/frozen_device_bytes": float(on_device)}


def _apply_fsdp(cfg: Config, ops: Any, dist: D.DistInfo) -> None:
    d, units = cfg.distributed, ops.adapter.fsdp_units()
    mesh = dist.mesh
    assert mesh is not None  # `shard` calls this only with a mesh
    replicate = d.frozen_base == "replicate"
    offload = d.frozen_base == "offload"
    frozen = {p for p in ops.policy.parameters() if not p.requires_grad} if replicate else set()
    lora = cfg.model.finetune == "lora"
    # The reference copy's units are the policy's, by name (it is a copy of the policy). Named before the
    # policy is wrapped, and not by class: fully_shard gives each unit an FSDP subclass of its own class.
    names = {id(m): n for n, m in ops.policy.named_modules()}
    unit_names = [names[id(u)] for u in units]
    apply_fsdp(ops.policy, units, mesh, d.param_dtype, d.reduce_dtype, frozen, offload and lora)
    if ops.ref_model is not None:
        ref_units = [ops.ref_model.get_submodule(n) for n in unit_names]
        apply_fsdp(ops.ref_model, ref_units, mesh, d.param_dtype, d.reduce_dtype, offload=offload)


def cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A unit's forward pre-hook: its floating-point tensor inputs in `dtype` (what FSDP2's
    `cast_forward_inputs` does), also in the recompute of a gradient-checkpointed unit. FSDP2's own cast
    is skipped there (its pre-forward hook returns early during the backward), so a unit whose inputs
    include float32 tensors (Wan's rotary embedding) recomputed in other dtypes than its forward ran in,
    and `torch.utils.checkpoint` refused the backward."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return tree_map_only(torch.Tensor, cast, (args, kwargs))


def forward_chains(model: nn.Module, units: list[nn.Module]) -> list[tuple[nn.Module, nn.Module]]:
    """(unit, the unit its forward runs next) for consecutive units of one container (a block list), the
    only order every forward keeps: a family's other units (Qwen3-Omni's vision and audio towers, which
    decode steps skip; a second expert of Wan2.2, which a step may not run) are not chained, since a
    prefetched unit that no forward uses stays gathered."""
    parent = {id(m): name.rpartition(".")[0] for name, m in model.named_modules()}
    return [(a, b) for a, b in zip(units, units[1:]) if parent.get(id(a)) == parent.get(id(b)) is not None]


def frozen_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of `model`'s frozen parameters this rank holds, the part of them on the accelerator): a
    DTensor counts by its local shard's storage (FSDP2 pads each parameter's dim 0 to a multiple of the
    ranks), a plain tensor whole; a shard in host memory (FSDP2 CPU offload) counts in the first number
    only. On CPU the device is the host: both numbers are equal."""
    held, on_device, seen = 0, 0, set()
    for p in model.parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        held += storage.nbytes()
        if local.device.type == device_type():
            on_device += storage.nbytes()
    return held, on_device


def sharded_bytes(shapes: list[tuple[tuple[int, ...], int]], world: int) -> int:
    """The bytes one rank holds of parameters of these (shape, bytes per element) when FSDP2 shards them
    over `world` ranks: dim 0 split into `world` chunks of ceil(dim0 / world) rows (the last ones padded),
    a 0-dim parameter as one row. The computation `frozen_bytes` measures on a sharded model."""
    total = 0
    for shape, itemsize in shapes:
        rows = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if shape else 1
        total += -(-rows // world) * rest * itemsize
    return total


def compute_dtype(model: nn.Module, stored: torch.dtype) -> torch.dtype:
    """The dtype `model`'s forward computes in, hence the dtype its floating-point inputs must have: FSDP's
    param_dtype where `apply_fsdp` wrapped it (the root does not cast its inputs), else `stored`, the dtype
    its weights are kept in (a fully fine-tuned transformer: float32 master weights, bf16 compute)."""
    return getattr(model, "_omnirl_compute_dtype", stored)


@contextlib.contextmanager
def gathered_weights(model: nn.Module, per_unit: bool = False):
    """Gather an FSDP2 model's weights once for a whole rollout phase (docs/memory.md).

    Every `FSDPModule` (root and each block) is unsharded and kept so across forwards, so the
    rollout runs no collectives and ranks may run different numbers of forwards. On exit all are
    resharded (resharding only the root would leave the blocks' parameters as plain tensors and the
    optimizer would update nothing). A model without FSDP passes through, and so does one read with
    `per_unit` (distributed.rollout_gather unit): each forward then gathers one unit at a time, as in
    training, and every rank must run the same forwards.
    """
    fsdp_modules = [] if per_unit else [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp_modules and device_type() != "cpu":
        check_gather_fits(model, free_bytes(local_device()))
    for m in fsdp_modules:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for m in fsdp_modules:
            m.set_reshard_after_forward(True)
            m.reshard()


def gather_bytes(model: nn.Module) -> int:
    """The device bytes `gathered_weights` allocates for `model`: every parameter of each FSDP2 unit not
    gathered already, whole, in the dtype FSDP2 gathers it in (distributed.param_dtype for a floating-point
    parameter). A root left gathered by its last forward (FSDP2 does not reshard the root) counts nothing."""
    total = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is None or group.is_unsharded:
            continue
        for fp in group.fsdp_params:  # FSDPParam.param_dtype is only set at the first forward
            stored = fp.sharded_param.dtype
            dtype = (group.mp_policy.param_dtype if stored.is_floating_point else None) or stored
            total += fp.sharded_param.numel() * dtype.itemsize
    return total


def check_gather_fits(model: nn.Module, free: int) -> None:
    """Refuse a whole-model gather for the rollout (distributed.rollout_gather phase) that `free` bytes
    cannot hold, before it starts, rather than running out of memory inside it."""
    need = gather_bytes(model)
    if need > free:
        raise ConfigError(
            f"distributed.rollout_gather phase gathers the whole sharded base ({need / 2**30:.1f} GiB) onto "
            f"the device for the rollout, which has {free / 2**30:.1f} GiB free: set "
            f"distributed.rollout_gather unit (one unit at a time) or shard over more ranks"
        )


@contextlib.contextmanager
def fsdp_hooks_quiet(model: nn.Module):
    """Inside `gathered_weights`: run forwards of `model` with FSDP2's forward hooks doing no stream or
    bookkeeping work (no all-gather-stream waits, no post-forward order records), so a decode step can be
    captured in a CUDA graph (a stream wait in the root pre-forward would fork the capture onto FSDP's
    all-gather streams and never join them back) and repeated steps grow no per-forward lists.

    It marks every FSDP state as in pre-backward, the state in which FSDP2's forward hooks only unshard
    what is not unsharded (nothing here) and cast inputs / outputs for mixed precision; the states are put
    back on exit. A model without FSDP passes through.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [s._training_state for s in states]
    for s in states:
        s._training_state = TrainingState.PRE_BACKWARD
    try:
        yield model
    finally:
        for s, t in zip(states, saved):
            s._training_state = t


# What `load_pretrained` builds models with instead of reading weights, while `building_with` is in effect:
# model.weights random (`omnirl.models.build_adapter`), else None.
_builder = None


@contextlib.contextmanager
def building_with(builder):
    """While in effect, `load_pretrained(cls, path, **kwargs)` returns `builder(cls, path, **kwargs)`: every
    model an adapter loads goes through it (omnirl.models.random_init.random_init_loader)."""
    global _builder
    before, _builder = _builder, builder
    try:
        yield
    finally:
        _builder = before


def load_pretrained(cls: type[M], path: str, **kwargs) -> M:
    """`cls.from_pretrained(path, **kwargs)` read on rank 0 only, broadcast to the other ranks.

    Other ranks build the module from its config on the meta device (no memory, no disk read of the
    weights), allocate it empty on the host and receive every parameter and buffer from rank 0, so N
    ranks do not each read a 40-60 GB checkpoint into host memory. Works for diffusers and
    transformers models alike (both have `from_pretrained` and a config on disk). Every adapter loads
    its models through here, so that model.weights random builds them instead (`building_with`).
    """
    if _builder is not None:
        return _builder(cls, path, **kwargs)
    loader: Any = cls  # a diffusers or transformers class: from_pretrained and its config are theirs
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return loader.from_pretrained(path, **kwargs)
    if dist.get_rank() == 0:
        model = loader.from_pretrained(path, **kwargs)
    else:
        model = _build_on_meta(cls, path, **kwargs).to_empty(device="cpu")
        _retie(model)
    tensors = [*model.parameters(), *model.buffers()]
    # Rank 0's dtypes win: from_pretrained keeps some tensors of a bfloat16 model in float32 (transformers'
    # rotary `inv_freq` buffers), which the meta build's blanket .to(dtype) casts. A broadcast of unequal
    # dtypes is a size mismatch (gloo aborts, NCCL is undefined), so the other ranks cast to match first.
    layout = [[(str(t.dtype), tuple(t.shape)) for t in tensors]]
    dist.broadcast_object_list(layout, src=0)
    if [shape for _, shape in layout[0]] != [tuple(t.shape) for t in tensors]:
        raise RuntimeError(f"load_pretrained({cls.__name__}, {path!r}): rank 0 has other tensor shapes")
    for tensor, (dtype, _) in zip(tensors, layout[0]):
        dtype = getattr(torch, dtype.removeprefix("torch."))
        if tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
    # Broadcast through the accelerator's backend (NVLink / InfiniBand), not gloo over TCP.
    comm_device = None if device_type() == "cpu" else local_device()
    for tensor in tensors:
        if comm_device is None:
            dist.broadcast(tensor.data, src=0)
        else:
            buf = tensor.data.to(comm_device)
            dist.broadcast(buf, src=0)
            tensor.data.copy_(buf)
    # What from_pretrained records about the checkpoint's names (its renames, a caller's key_mapping):
    # transformers' revert_weight_conversion reads it to give checkpoint names back (a vLLM push, a save),
    # and a meta build has none, so every rank takes rank 0's.
    conversions = [getattr(model, "_weight_conversions", None)]
    dist.broadcast_object_list(conversions, src=0)
    if conversions[0] is not None:
        model._weight_conversions = conversions[0]
    return model.eval()


def _retie(model: nn.Module) -> None:
    """to_empty() unties shared embeddings (T5): retie them so that the tensor lists match rank 0's."""
    if isinstance(model, PreTrainedModel):
        model.tie_weights()


def _build_on_meta(cls: type[M], path: str, **kwargs) -> M:
    from accelerate import init_empty_weights
    from diffusers import ModelMixin

    dtype = kwargs.get("torch_dtype") or kwargs.get("dtype")
    # Only parameters go to meta: a module may keep constant tensors as plain attributes (Qwen-Image's
    # RoPE tables), which to_empty() cannot restore and the broadcast does not reach.
    loader: Any = cls  # a diffusers or transformers class: its config API is reached by name
    with init_empty_weights():
        if issubclass(cls, ModelMixin):
            config = loader.load_config(path, subfolder=kwargs.get("subfolder"))
            model = loader.from_config(config)
        else:
            # A caller's config wins, as in from_pretrained (the Qwen3-Omni thinker of a full checkpoint).
            config = kwargs.get("config") or loader.config_class.from_pretrained(
                path, subfolder=kwargs.get("subfolder") or ""
            )
            model = loader._from_config(config)
    return model.to(dtype) if dtype is not None else model
