"""Compiled forwards for the rollout only, shared by both engines: each module's `forward` is swapped for
its `torch.compile` version while the rollout runs and restored after, so the trainer's forward and
backward stay eager and FSDP2's hooks (which wrap a module's call, not its forward) stay outside the
compiled code. The diffusion engine compiles static shapes (`dynamic=False`) and pads its batches to a
few bucket sizes. The generation engine compiles its decode step only, whose shapes are fixed within a
call but not between calls (the slots' KV columns follow the call's longest prompt): dynamo's automatic
dynamic shapes (`dynamic=None`) compile static shapes first and, at the first call whose shapes differ,
once more with those sizes symbolic.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

# The torch.compile backend. Tests use "eager": dynamo decides (re)compiles from its guards before any
# backend runs, and inductor's CPU code generation is slow (benchmarks/RESULTS.md).
COMPILE_BACKEND = "inductor"
# Compiled entries all sit on the one `forward` code object of a module class: one per (variant, shape).
# SD3.5 has three block variants and max_num_seqs 256 nineteen batch buckets; a decoder's layers may each
# be an entry of their own (a layer index read in the forward is a constant of its graph). Dynamo's default
# limit of 8 would drop to eager silently after the eighth.
RECOMPILE_LIMIT = 128

# Modules of a decoder layer made only of element-wise work and reductions over one row (by the ends of their
# class names, as transformers names them): compiled (generation.compile_modules), each fuses into a kernel or
# two.
ELEMENTWISE_MODULES = ("RMSNorm", "TopKRouter")

Compiled = list[tuple[nn.Module, Callable]]

# Inductor's on-disk cache (its FX graphs, AOTAutograd's compiled forwards and backwards, and beneath it
# triton's kernels): a process that finds a graph there loads it instead of compiling it.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_PARTS = ("fxgraph", "aotautograd")


def use_cache_dir(setting: str) -> Path:
    """Point inductor's on-disk cache at `setting` (`run.compile_cache`) before anything compiles: 'auto'
    keeps TORCHINDUCTOR_CACHE_DIR where the user set it, else takes `$XDG_CACHE_HOME/omnirl/torchinductor`
    (`~/.cache/omnirl/torchinductor`), which outlives /tmp, inductor's own default, and, on a shared home,
    the node; a path is taken as it is. Returns the directory in use. Inductor writes its default into the
    variable the first time it is asked for its directory (importing diffusers does), so a variable that
    names that default is taken as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if setting == "auto":
        given = os.environ.get(CACHE_ENV)
        if given and Path(given).absolute() != Path(default_cache_dir()).absolute():
            return Path(given)
        path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omnirl" / "torchinductor"
    else:
        path = Path(setting).expanduser()
    os.environ[CACHE_ENV] = str(path.absolute())
    return path.absolute()


def cached_graphs(path: Path) -> int:
    """How many compiled graphs the cache at `path` holds (FX graphs and AOTAutograd entries): 0 means step
    0 compiles every graph; more, that graphs of earlier runs may be loaded instead."""
    return sum(1 for part in CACHE_PARTS if (path / part).is_dir() for _ in (path / part).iterdir())


# Dynamo's timers of compiling: a frame's compile (tracing, AOTAutograd and inductor's forward, or their
# loading from the on-disk cache) and a backward graph's compile at its first backward, which runs apart.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


class CompileMeter:
    """What torch.compile cost since the last `take`: `time/compile_s`, the seconds spent compiling (inside
    the phases that ran the compiled code: part of their time, not added to it), and `compile/graphs`, the
    graphs compiled, which a steady step keeps at 0 (a graph compiled after step 0 is a recompile)."""

    def __init__(self):
        self.last = self._read()
        self.parts: dict[str, float] = {}  # seconds compiled inside each `part` since the last `take`

    @staticmethod
    def _read() -> tuple[float, int]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        secs = sum(sum(compilation_time_metrics.get(k, ())) for k in COMPILE_TIMERS)
        return secs, counters["stats"]["unique_graphs"]

    @contextlib.contextmanager
    def part(self, name: str):
        """Count what the block compiles as `time/{name}_compile_s` too (the rollout's share of a step's)."""
        began = self._read()[0]
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + self._read()[0] - began

    def take(self) -> dict[str, float]:
        """The cost since the last `take`, with each `part`'s seconds apart."""
        (secs, graphs), (secs0, graphs0) = self._read(), self.last
        self.last = (secs, graphs)
        out = {"time/compile_s": secs - secs0, "compile/graphs": float(graphs - graphs0)}
        out |= {f"time/{name}_compile_s": s for name, s in self.parts.items()}
        self.parts = {}
        return out


def modules_named(layers: Iterable[nn.Module], suffixes: tuple[str, ...]) -> list[nn.Module]:
    """The modules of `layers` whose class names end with one of `suffixes`, outermost first: a module
    inside one already taken is left to its parent's compile."""
    found: list[nn.Module] = []
    for layer in layers:
        inner: set[int] = set()
        for m in layer.modules():
            if id(m) not in inner and type(m).__name__.endswith(suffixes):
                found.append(m)
                inner.update(id(c) for c in m.modules())
    return found


def compile_forwards(modules: Iterable[nn.Module], dynamic: bool | None = False) -> Compiled:
    """(module, its compiled forward) for each module; nothing runs compiled until `swapped`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return [
        (m, torch.compile(m.forward, fullgraph=True, dynamic=dynamic, backend=COMPILE_BACKEND))
        for m in modules
    ]


@contextlib.contextmanager
def swapped(compiled: Compiled):
    """Run with the compiled forwards: an instance attribute shadows the class's forward until deleted."""
    for module, fn in compiled:
        module.forward = fn
    try:
        yield
    finally:
        for module, _ in compiled:
            del module.forward


@contextlib.contextmanager
def eager(compiled: Compiled):
    """Inside `swapped`, run the modules' own forwards again until the block ends: for work at sizes the
    compiled code will never see again (a memory probe), whose compile would cost more than it saves."""
    saved = [(m, vars(m).pop("forward")) for m, _ in compiled if "forward" in vars(m)]
    try:
        yield
    finally:
        for module, fn in saved:
            module.forward = fn
