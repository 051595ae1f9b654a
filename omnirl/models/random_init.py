"""Full-size models with random weights, for measurements that must run without downloads.

`write_random_checkpoint` writes a config-only checkpoint of a family's public configs (the `RANDOM` of
`omnirl/models/<family>/public_config.py`) with the byte-level tokenizers of `omnirl.models.tokenizers`
(the real Qwen2 BPE when its ranks are given: `qwen_bpe_tokenizer`).
With model.weights random, `omnirl.models.build_adapter` builds the adapter under `random_weights`: every
model the adapter loads through `omnirl.fsdp.load_pretrained` is then built by `random_init_loader` from
its config, directly in its dtype on the device (a sharded run's policy on the host), with random weights
seeded per model, so every rank builds the same ones. Any family gets this by loading each of its models
through `load_pretrained`; `BUILD_HOOKS` lets a measuring script see each build.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omnirl.config import Config


def checked(cls, **kwargs):
    """`cls(**kwargs)` for a transformers config, refusing a key that the default config lacks (the class
    would keep it as a stray attribute and build the model without it)."""
    unknown = set(kwargs) - set(cls().to_dict())
    if unknown:
        raise TypeError(f"{cls.__name__} takes no {sorted(unknown)}")
    return cls(**kwargs)


def dump(out: Path, sub: str, cfg: dict) -> None:
    """`cfg` as out/sub/config.json."""
    (out / sub).mkdir(parents=True, exist_ok=True)
    (out / sub / "config.json").write_text(json.dumps(cfg))


# The checkpoint subfolders that hold the diffusion adapters' policies (Wan2.2 A14B: both experts); a
# model at a checkpoint's root (no subfolder: the omni adapters' one transformers model) is a policy too.
POLICY_SUBFOLDERS = ("transformer", "transformer_2")
# A config-only thinker's build settings (write_random_thinker(weights=False)), read by random_init_loader.
RANDOM_INIT_FILE = "random_init.json"
# The random weights: torch is seeded with this plus a hash of the model's class and subfolder before each
# build, so that every rank builds the same weights, whatever it drew before, and two experts of one class
# (Wan2.2 A14B) differ.
BUILD_SEED = 1234
# Called after each build of `random_weights` as hook(cls, subfolder, model, seconds): what a measuring
# script records of the builds (scripts/gpu/phase_memory.py).
BUILD_HOOKS: list[Callable] = []


@contextlib.contextmanager
def random_weights(cfg: Config, device: torch.device):
    """While in effect, every model loaded through `omnirl.fsdp.load_pretrained` is built by
    `random_init_loader` on `device`, seeded per model (`BUILD_SEED`); a run whose frozen base FSDP2 shards
    or offloads builds its policy on the host (not when `device` is meta: nothing is allocated there)."""
    from omnirl import fsdp
    from omnirl.memory import synchronize

    on_host = cfg.distributed.frozen_base != "replicate" and device.type != "meta"
    load = random_init_loader(device, policy_on_host=on_host)

    def build(cls, path, subfolder=None, **kwargs):
        torch.manual_seed(BUILD_SEED + zlib.crc32(f"{cls.__name__}/{subfolder}".encode()))
        begin = time.perf_counter()
        model = load(cls, path, subfolder=subfolder, **kwargs)
        if BUILD_HOOKS:
            synchronize()
            for hook in BUILD_HOOKS:
                hook(cls, subfolder, model, time.perf_counter() - begin)
        return model

    with fsdp.building_with(build):
        yield


def random_init_loader(device: torch.device, policy_on_host: bool = False):
    """What `load_pretrained` builds with under `random_weights`: each model from its config, random
    weights, on the device, with the dtypes `from_pretrained(torch_dtype=...)` leaves (`_as_loaded`). With
    `policy_on_host` the policies (`POLICY_SUBFOLDERS`, or a model at the checkpoint's root) are built on
    the host, where `from_pretrained` leaves them, for a run whose frozen base FSDP2 shards
    (distributed.frozen_base shard / offload): the adapter leaves its policy there and `fully_shard` moves
    it to the device one unit at a time (docs/memory.md). A `config` the adapter passes is used as given; a
    `RANDOM_INIT_FILE` beside the config scales the output embedding by its `head_scale` (as
    `write_random_thinker` does)."""
    from diffusers import ModelMixin

    def load(cls, path, subfolder=None, torch_dtype=None, dtype=None, config=None, **_):
        dtype = torch_dtype or dtype or torch.float32
        policy = subfolder in POLICY_SUBFOLDERS or subfolder is None
        where = torch.device("cpu") if policy_on_host and policy else device
        # Made in `dtype` (the default dtype while the modules are made, as both libraries' from_pretrained
        # do), not in float32 and cast after: Qwen-Image's 20 B-parameter transformer would pass through
        # 76 GiB of float32 on the device, more than an 80 GB device holds.
        # A host build's random draws on the accelerator (`_draws_on`): the host's generator is serial.
        drawn = _draws_on(device) if where.type == "cpu" and device.type not in ("cpu", "meta") else None
        with torch.device(where), _default_dtype(dtype), drawn or contextlib.nullcontext():
            model_cls: Any = cls  # a diffusers or transformers class: its config API is reached by name
            if issubclass(cls, ModelMixin):
                model = model_cls.from_config(model_cls.load_config(path, subfolder=subfolder))
            else:  # the config the adapter passes (it may have set fields), else the checkpoint's
                config = config or model_cls.config_class.from_pretrained(path, subfolder=subfolder)
                model = model_cls._from_config(config, dtype=dtype)
        _as_loaded(model, dtype)
        settings = Path(path, subfolder or "", RANDOM_INIT_FILE)
        if settings.is_file():
            head_scale = json.loads(settings.read_text()).get("head_scale", 1.0)
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(head_scale)
        return model.eval()

    return load


@contextlib.contextmanager
def _draws_on(device: torch.device, generator: torch.Generator | None = None, min_numel: int = 1 << 16):
    """While models are built in host memory: a large host tensor's `uniform_` / `normal_` (what every
    torch.nn.init function ends in: the modules' own `reset_parameters` and transformers' `_init_weights`)
    is drawn on `device` (from `generator`, else the device's default one) and copied back. The host's
    generator is serial, so a 20 B-parameter transformer takes minutes to build on the host
    (benchmarks/RESULTS.md); a device draws at its memory speed and the copy back is one pass over the
    host memory the build allocates anyway.
    Same distributions, the device's random stream; a call that brings its own generator, and small
    tensors, draw in place."""
    originals = {name: getattr(torch.Tensor, name) for name in ("uniform_", "normal_")}
    defined = {name: torch.Tensor.__dict__[name] for name in originals if name in torch.Tensor.__dict__}

    def drawing(original):
        def draw(self, *args, **kwargs):
            own = kwargs.pop("generator", None)
            if own is not None or self.device.type != "cpu" or self.numel() < min_numel:
                return original(self, *args, generator=own, **kwargs)
            with torch.no_grad():
                values = torch.empty(self.shape, dtype=self.dtype, device=device)
                self.copy_(original(values, *args, generator=generator, **kwargs))
            return self

        return draw

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, drawing(original))
        yield
    finally:
        for name in originals:
            if name in defined:
                setattr(torch.Tensor, name, defined[name])
            else:
                delattr(torch.Tensor, name)  # back to TensorBase's own method


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _as_loaded(model, dtype: torch.dtype) -> None:
    """Give a model built under the default dtype `dtype` the dtypes its library's `from_pretrained` would
    leave. diffusers casts every checkpoint tensor (parameters and persistent buffers, whatever dtype the
    module made them in: SD3's float32 `pos_embed`) to `dtype`, except those under `_keep_in_fp32_modules`
    (a module name among the key's dotted parts: Wan's time embedder, norms and modulation), which stay
    float32; transformers keeps each tensor's dtype as built (the float32 rotary `inv_freq`) except the
    modules of its dtype plan (`_keep_in_fp32_modules` under float16, `_keep_in_fp32_modules_strict` under
    bfloat16 too: float32). Non-persistent buffers stay as built in both."""
    from diffusers import ModelMixin

    if isinstance(model, ModelMixin):
        keep = set(model._keep_in_fp32_modules or ())

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return torch.float32 if keep & set(key.split(".")) else dtype
    else:
        plan = model._get_dtype_plan(dtype)  # glob -> dtype; transformers searches each key for the globs
        patterns = [(re.compile(glob.replace("*", ".*")), d) for glob, d in plan.items()]

        def target(key: str, t: torch.Tensor) -> torch.dtype:
            return next((d for pattern, d in patterns if pattern.search(key)), t.dtype)

    for key, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point() and t.dtype != (want := target(key, t)):
            t.data = t.data.to(want)
