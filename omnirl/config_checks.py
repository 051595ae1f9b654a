"""The value checks of a loaded config (`check_values`): ranges of every numeric field, the settings
that only go together, the sampling window, the rollout backend and the frozen base; each failure one
`ConfigError` line naming the field, before any model loads."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from typing import Any

from omnirl.algos.losses import check_loss, loss_spec
from omnirl.config import Config, SamplingConfig
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.flow_sde import window
from omnirl.ranges import FRACTION, NON_NEGATIVE, POSITIVE, at_least

# Field -> (predicate, what is allowed). A family's own settings (`family.*`) and a component's own
# section (`subsections`: algo.<loss>, rollout.vllm, rollout.fp8) have theirs in the RANGES class attribute
# of their dataclass, checked here in the same way.
RANGES = {
    "run.steps": at_least(1),
    "run.compile_cache": ((lambda v: bool(v.strip())), "'auto' or a directory"),
    "lora.rank": at_least(1),
    "lora.alpha": POSITIVE,
    "lora.dropout": ((lambda v: math.isfinite(v) and 0 <= v < 1), "a number in [0, 1)"),
    "sampling.height": at_least(1),
    "sampling.width": at_least(1),
    "sampling.num_steps": at_least(1),
    "sampling.guidance_scale": (
        (lambda v: math.isfinite(v) and v >= 1),
        "a finite number >= 1 (1 = no guidance)",
    ),
    "sampling.noise_level": NON_NEGATIVE,
    "sampling.sde_window_size": at_least(0),
    "sampling.sde_window_shift_interval": at_least(1),
    "sampling.sde_window_stride": at_least(1),
    "sampling.ode_compress_ratio": ((lambda v: math.isfinite(v) and 0 <= v <= 1), "a number in [0, 1]"),
    "generation.temperature": POSITIVE,
    "generation.top_p": FRACTION,
    "generation.top_k": at_least(0),
    "generation.max_new_tokens": at_least(1),
    "generation.max_prefill_tokens": at_least(1),
    "generation.kv_windows": at_least(1),
    "generation.row_buckets": at_least(1),
    "generation.kv_cache_fraction": ((lambda v: math.isfinite(v) and 0 < v < 1), "a number in (0, 1)"),
    "rollout.memory_budget_gib": NON_NEGATIVE,
    "rollout.prompts_per_step": at_least(1),
    "rollout.group_size": at_least(2),  # a group of one sample never has reward spread
    "rollout.max_num_seqs": at_least(1),
    "rollout.max_num_batched_tokens": at_least(0),
    "reward.num_workers": at_least(1),
    "reward.timeout_s": POSITIVE,
    "algo.clip_range": POSITIVE,
    "algo.kl_beta": NON_NEGATIVE,
    "algo.adv_clip": (
        (lambda v: v is None or (math.isfinite(v) and v > 0)),
        "a finite number > 0, or null (unclamped)",
    ),
    "algo.correction_threshold": ((lambda v: math.isfinite(v) and v > 1), "a finite number > 1"),
    "optim.lr": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.eps": POSITIVE,
    "optim.grad_clip": NON_NEGATIVE,
    "optim.micro_batch_size": at_least(1),
    "optim.micro_batch_tokens": at_least(0),
    "optim.mini_batches": at_least(1),
    "optim.epochs": at_least(1),
    "distributed.timeout_s": at_least(1),
    "log.image_every": at_least(0),
    "validation.every": at_least(0),
    "validation.num_steps": at_least(1),
    "validation.num_samples": at_least(1),
    "validation.temperature": POSITIVE,
    "validation.top_p": FRACTION,
    "checkpoint.every": at_least(0),
    "checkpoint.keep": at_least(1),
}


def sections(config_cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """Every section of the config class `config_cls` by its dotted name, with its dataclass: the top-level
    ones (`algo`, and `family` where typed) each followed by the sections it holds (`algo.dgpo`)."""
    hints = typing.get_type_hints(config_cls)
    found = []
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            found += [(prefix + f.name, tp), *sections(tp, f"{prefix}{f.name}.")]
    return found


def subsections(config_cls: type) -> list[tuple[str, type]]:
    """The sections of `config_cls` that are a field of another section (`algo.<loss>`, `rollout.vllm`,
    `rollout.fp8`): a component's own settings, each with its RANGES."""
    return [(name, cls) for name, cls in sections(config_cls) if "." in name]


def check_values(cfg: Config) -> None:
    """Every value a run cannot use, found when the recipe loads (before anything is loaded or written):
    a ConfigError naming the field, the value and what is allowed. Ranges come from `RANGES` and from the
    `RANGES` of the adapter's `Settings` (`omnirl.models.get_adapter` imports its module, loads no
    weights); below them the settings that must agree with each other, with the number of ranks
    (WORLD_SIZE, set by torchrun) and with the adapter's class."""

    def bad(key: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(f"{key} must be {allowed}, got {value!r}")

    for key, (ok, allowed) in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise bad(key, value, allowed)
    adapter = get_adapter(cfg.model.adapter)
    for name, (ok, allowed) in adapter.Settings.RANGES.items():
        value = getattr(cfg.family, name)
        if not ok(value):
            raise bad(f"family.{name}", value, allowed)
    for key, section in subsections(type(cfg)):
        values = functools.reduce(getattr, key.split("."), cfg)
        for name, (ok, allowed) in section.RANGES.items():
            if not ok(getattr(values, name)):
                raise bad(f"{key}.{name}", getattr(values, name), allowed)
    for i, beta in enumerate(cfg.optim.betas):
        if not (math.isfinite(beta) and 0 <= beta < 1):
            raise bad(f"optim.betas[{i}]", beta, "a finite number in [0, 1)")
    high = cfg.algo.clip_range_high
    if high is not None and not (math.isfinite(high) and high > 0):
        raise bad("algo.clip_range_high", high, "a finite number > 0, or null (= algo.clip_range)")
    if cfg.algo.global_std and not cfg.algo.std_normalise:
        raise ConfigError("algo.global_std true needs algo.std_normalise true: without it no std is taken")
    if not cfg.reward.weights:
        raise ConfigError(
            "reward.weights is empty: name at least one reward, e.g. {jpeg_compressibility: 1.0}"
        )
    for name, weight in cfg.reward.weights.items():
        if not math.isfinite(weight):
            raise bad(f"reward.weights.{name}", weight, "a finite number")
    if cfg.generation.compile and cfg.generation.compile_modules:
        raise ConfigError(
            "generation.compile compiles whole decoder layers and generation.compile_modules "
            f"{cfg.generation.compile_modules} parts of them: set one"
        )
    if any(not name for name in cfg.generation.compile_modules):
        raise bad("generation.compile_modules", cfg.generation.compile_modules, "non-empty class-name ends")
    kv = cfg.generation.kv_cache_gib
    if kv is not None and not POSITIVE[0](kv):
        raise bad("generation.kv_cache_gib", kv, "a finite number > 0, or null (sized from free memory)")
    _check_frozen_base(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules is empty: name the modules that receive LoRA")
    if cfg.distributed.mode == "async":
        check_async(cfg, world)
    elif cfg.rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must divide by the number of ranks "
            f"({world}): each rank takes an equal share of the step's prompts"
        )
    check_model_path(cfg.model.path)
    if adapter.kind == "diffusion":
        _check_sampling(cfg.sampling, adapter, cfg.model.adapter, loss_spec(cfg.algo.loss).logprobs)
    check_loss(cfg.algo)
    if cfg.rollout.backend == "vllm":
        _check_vllm(cfg, adapter)
    elif not cfg.rollout.vllm.logprobs:
        raise ConfigError(
            "rollout.vllm.logprobs false applies to rollout.backend vllm; the native engine records its "
            "log-probs at no extra cost"
        )
    _check_precision(cfg, adapter)
    check_health(cfg)


def fp8_trained(cfg: Config) -> bool:
    """The loss trains on transitions the rollout sampled in FP8: rollout.precision fp8 at every step
    (fp8.steps all) on the rollout's own samples (fp8.select 0) with a log-prob loss (not DiffusionNFT,
    which has no transitions). Then the trainer recomputes the old log-probs and corrects, unless the
    update runs the same FP8 GEMMs (train.precision fp8): then behaviour and trained policy are one
    function."""
    r = cfg.rollout
    return (
        r.precision == "fp8"
        and cfg.train.precision != "fp8"
        and r.fp8.steps == "all"
        and not r.fp8.select
        and loss_spec(cfg.algo.loss).logprobs
    )


def _check_precision(cfg: Config, adapter: type) -> None:
    """rollout.precision fp8 and Sol-RL's selection (rollout.fp8.select): a diffusion adapter, weights the
    rollout can quantise once per phase, and old log-probs of the trained precision."""
    r, f, a = cfg.rollout, cfg.rollout.fp8, cfg.algo
    if cfg.train.precision == "fp8" and (cfg.model.finetune != "lora" or adapter.kind != "diffusion"):
        raise ConfigError(
            "train.precision fp8 runs the frozen base of a LoRA run in FP8: it needs model.finetune lora and "
            f"a diffusion adapter (model.adapter {cfg.model.adapter!r}, finetune {cfg.model.finetune!r})"
        )
    if r.precision == "bf16":
        if f.select:
            raise ConfigError("rollout.fp8.select needs rollout.precision fp8 (it selects among FP8 samples)")
        return
    if adapter.kind != "diffusion":
        raise ConfigError(
            f"rollout.precision fp8 runs diffusion adapters only; model.adapter {cfg.model.adapter!r} is an "
            f"{adapter.kind} model"
        )
    if cfg.distributed.rollout_gather == "unit":
        raise ConfigError(
            "rollout.precision fp8 quantises the gathered weights once per rollout phase: it needs "
            "distributed.rollout_gather phase, not unit"
        )
    if f.select and 2 * f.select >= r.group_size:
        raise ConfigError(
            f"rollout.fp8.select {f.select}: the {f.select} best and worst samples of a group must "
            f"be fewer than rollout.group_size ({r.group_size})"
        )
    if f.steps == "untrained" and (f.select or not loss_spec(a.loss).logprobs):
        what = "rollout.fp8.select explores" if f.select else f"algo.loss {a.loss} trains"
        raise ConfigError(
            f"rollout.fp8.steps untrained: {what} on samples with no trained steps kept in bf16; use "
            "rollout.fp8.steps all (its default there)"
        )
    if fp8_trained(cfg) and a.old_logprob == "rollout":
        raise ConfigError(
            "algo.old_logprob rollout: with rollout.precision fp8 and rollout.fp8.steps all the rollout's "
            "log-probs are not the trainer's; the trainer recomputes them (algo.old_logprob recompute, the "
            "default there), or use rollout.fp8.steps untrained"
        )


def _check_vllm(cfg: Config, adapter: type) -> None:
    """rollout.backend vllm, before any model loads: an omni adapter, vLLM importable, settings it runs."""
    import importlib.util

    if adapter.kind != "omni":
        raise ConfigError(
            f"rollout.backend vllm runs autoregressive (omni) adapters; model.adapter {cfg.model.adapter!r} "
            "is a diffusion adapter (rollout.backend native)"
        )
    if cfg.generation.compile or cfg.generation.compile_modules:
        raise ConfigError(
            "generation.compile / compile_modules compile the native engine's decode step; rollout.backend "
            "vllm compiles its own (generation.cuda_graph false makes it eager): leave them off"
        )
    if cfg.generation.merge_lora:
        raise ConfigError(
            "generation.merge_lora merges the LoRA for the native engine's decode step; rollout.backend vllm "
            "places the LoRA itself (merged into the pushed weights, or as vLLM's adapter): leave it off"
        )
    if not cfg.rollout.vllm.logprobs and (cfg.algo.old_logprob, cfg.algo.correction) != ("recompute", "none"):
        raise ConfigError(
            "rollout.vllm.logprobs false: the rollout records no log-probs, so the trainer recomputes them "
            "and has nothing to correct against: needs algo.old_logprob recompute and algo.correction none "
            f"(got {cfg.algo.old_logprob}, {cfg.algo.correction})"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.backend vllm: the vllm package is not importable in this environment (GPU: pip "
            'install -e ".[vllm]"; CPU: bash scripts/vllm_cpu_env.sh builds its own venv; README.md, '
            '"Rollout backends")'
        )
    if cfg.generation.top_p < 1 or cfg.generation.top_k > 0:
        # vLLM reports log-probs after its top-k / top-p filter, which the trainer's recompute has not.
        raise ConfigError(
            "rollout.backend vllm records the log-probs of the distribution it samples from, after top-k / "
            f"top-p: training rollouts need generation.top_p 1 and top_k 0 (got {cfg.generation.top_p}, "
            f"{cfg.generation.top_k}); validation may filter"
        )


def _check_frozen_base(cfg: Config) -> None:
    """distributed.frozen_base and rollout_gather against FSDP, the launcher and each other, and a LoRA's
    compute dtype against its frozen base's."""
    d = cfg.distributed
    if d.fsdp and cfg.model.finetune == "lora" and cfg.model.dtype != d.param_dtype:
        # The frozen base computes in model.dtype and FSDP2 casts every unit's inputs to param_dtype: a
        # bfloat16 base fed float32 activations stops at its first layer (a dtype mismatch in a conv or
        # matmul), a sharded one would be gathered in float32 (twice its bytes).
        raise ConfigError(
            f"distributed.param_dtype {d.param_dtype} with model.dtype {cfg.model.dtype} in a LoRA run: the "
            f"frozen base computes in model.dtype, so the LoRA must too (set both to bfloat16 or both to "
            f"float32)"
        )
    if d.frozen_base == "replicate":
        return
    if not d.fsdp:
        raise ConfigError(
            f"distributed.frozen_base {d.frozen_base} needs distributed.fsdp true (FSDP2 shards it)"
        )


def check_model_path(path: str, what: str = "model.path") -> None:
    """A local-looking `path` (see `looks_local`) that does not exist is a ConfigError naming `what`, at
    once: it is never looked up on the hub."""
    if not os.path.exists(path) and looks_local(path):
        raise ConfigError(f"{what} {path!r} does not exist (a local path: it is not looked up on the hub)")


def looks_local(path: str) -> bool:
    """A path no hub id looks like (hub ids are `name` or `org/name`): absolute, relative to `.`, `..` or
    `~`, more than one `/`, or under a local directory that exists."""
    parts = path.split("/")
    return (
        path.startswith(("/", ".", "~"))
        or len(parts) > 2
        or path.endswith("/")
        or (len(parts) == 2 and os.path.isdir(parts[0]))
    )


def _check_sampling(s: SamplingConfig, adapter: type, name: str, logprobs: bool) -> None:
    """The diffusion rollout's settings against each other, the family's latent grid and the loss (whether
    it reads the rollout's log-probs: `LossSpec.logprobs`)."""
    multiple = adapter.pixel_multiple
    for key, value in (("sampling.height", s.height), ("sampling.width", s.width)):
        if value % multiple:
            raise ConfigError(
                f"{key} must be a multiple of {multiple} for model.adapter {name!r} (one latent "
                f"token per {multiple}x{multiple} pixels), got {value}"
            )
    if (s.sde_type == "ode" or s.noise_level == 0) and logprobs:  # a loss without log-probs takes any
        raise ConfigError(
            f"sampling.sde_type {s.sde_type!r} with sampling.noise_level {s.noise_level}: a training rollout "
            "needs a stochastic step (sde or cps, noise_level > 0); the ODE step has no log-prob to train"
        )
    if s.sde_type == "cps" and s.noise_level > 1:
        raise ConfigError(f"sampling.noise_level must be in (0, 1] with sde_type 'cps', got {s.noise_level}")
    if s.sde_window_size > s.num_steps:
        raise ConfigError(
            f"sampling.sde_window_size must be at most sampling.num_steps ({s.num_steps}), got "
            f"{s.sde_window_size}"
        )
    lo, hi = s.sde_window_range
    if s.sde_window_size and not 0 <= lo < hi:
        raise ConfigError(
            f"sampling.sde_window_range must be a non-empty range [lo, hi) with lo >= 0, got {[lo, hi]}"
        )
    try:  # the sampler's own rule: the window inside its range
        window(s.num_steps, s.sde_window_size, (lo, hi))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    schedule = s.sde_window_schedule
    if schedule in ("sliding", "sliding_compressed", "subset") and s.sde_window_size == 0:
        raise ConfigError(f"sampling.sde_window_schedule {schedule} needs sampling.sde_window_size > 0")
    if schedule == "dance" and s.sde_window_size and hi > s.num_steps - 1:
        raise ConfigError(
            f"sampling.sde_window_range {[lo, hi]} with sde_window_schedule dance: the last step "
            f"({s.num_steps - 1}) is the ODE step to sigma 0 and is never trained; hi must be at most "
            "sampling.num_steps - 1"
        )
    if s.ode_compress_ratio and schedule != "sliding_compressed":
        raise ConfigError(
            "sampling.ode_compress_ratio needs sampling.sde_window_schedule sliding_compressed (MixGRPO-"
            f"Flash: the compressed schedule follows one window shared by the whole batch), got {schedule}"
        )
    if schedule == "sliding_compressed" and not s.ode_compress_ratio:
        raise ConfigError(
            "sampling.sde_window_schedule sliding_compressed needs sampling.ode_compress_ratio > 0 (the "
            "reference's: 0.4)"
        )


def rollout_count(cfg: Config, world: int) -> int:
    """The number of rollout ranks that distributed.rollout_ranks names on `world` ranks (a count, or a
    fraction rounded to the nearest count)."""
    r = cfg.distributed.rollout_ranks
    return round(r * world) if 0 < r < 1 else int(r)


def check_async(cfg: Config, world: int) -> None:
    """distributed.mode async on `world` ranks: a ConfigError naming the field, before anything loads."""
    d = cfg.distributed
    r = d.rollout_ranks
    if not (math.isfinite(r) and r > 0 and (r < 1 or r == int(r))):
        raise ConfigError(
            f"distributed.rollout_ranks must be a count (1, 2, ...) or a fraction in (0, 1), got {r!r}"
        )
    if world < 2:
        raise ConfigError(
            f"distributed.mode async needs at least 2 ranks (one generates, one trains); this job has {world}"
        )
    n = rollout_count(cfg, world)
    if n < 1:
        raise ConfigError(f"distributed.rollout_ranks {r} of {world} ranks leaves no rollout rank")
    if n >= world:
        raise ConfigError(
            f"distributed.rollout_ranks {r} of {world} ranks leaves no training rank ({n} rollout ranks)"
        )
    if d.max_staleness < 0:
        raise ConfigError(f"distributed.max_staleness must be >= 0, got {d.max_staleness}")
    p = cfg.rollout.prompts_per_step
    for side, count in (("rollout", n), ("training", world - n)):
        if p % count:
            raise ConfigError(
                f"rollout.prompts_per_step ({p}) must divide by the number of {side} ranks ({count}): each "
                "takes an equal share of the step's prompts"
            )
    a = cfg.algo
    if d.max_staleness > 0 and (a.old_logprob != "recompute" or a.correction == "none"):
        raise ConfigError(
            f"distributed.max_staleness {d.max_staleness}: samples of an older policy need algo.old_logprob "
            f"recompute and algo.correction tis or mis (the truncated importance weight), got "
            f"{a.old_logprob} and {a.correction}; distributed.max_staleness 0 trains on the current policy"
        )
    for what, unsupported in (
        ("rollout.backend vllm", cfg.rollout.backend == "vllm"),
        ("rollout.precision fp8", cfg.rollout.precision == "fp8"),
        ("algo.loss diffusion_nft (its old policy lives with the trainer)", a.loss == "diffusion_nft"),
        (f"distributed.frozen_base {d.frozen_base}", d.frozen_base != "replicate"),
        ("distributed.rollout_gather unit", d.rollout_gather == "unit"),
    ):
        if unsupported:
            raise ConfigError(
                f"distributed.mode async does not run with {what}: use distributed.mode colocated"
            )


def check_health(cfg: Config) -> None:
    """The health section's values, at load (one ConfigError line naming the field)."""
    h = cfg.health
    for name in ("baseline_steps", "patience"):
        if getattr(h, name) < 1:
            raise ConfigError(f"health.{name} must be an integer >= 1, got {getattr(h, name)}")
    for name in ("parity_every", "guard_every"):
        if getattr(h, name) < 0:
            raise ConfigError(f"health.{name} must be an integer >= 0, got {getattr(h, name)}")
    fractions = ("diversity_min", "dark_max", "saturated_max", "entropy_min", "repetition_max", "silence_max")
    for name in fractions:
        v = getattr(h, name)
        if not (math.isfinite(v) and 0 <= v <= 1):
            raise ConfigError(f"health.{name} must be a number in [0, 1], got {v}")
    for name in ("guard_drop", "adapt_kl_init", "adapt_rate", "adapt_kl_max"):
        v = getattr(h, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"health.{name} must be a finite number > 0, got {v}")
    if set(h.parity_tolerance) != {"fp32", "bf16", "fp8", "vllm"}:
        raise ConfigError(
            "health.parity_tolerance must name exactly fp32, bf16, fp8 and vllm, got "
            f"{sorted(h.parity_tolerance)}"
        )
    if any(not (math.isfinite(v) and v > 0) for v in h.parity_tolerance.values()):
        raise ConfigError(f"health.parity_tolerance: every tolerance must be > 0, got {h.parity_tolerance}")
    if h.guard_every and not h.guard_prompts:
        raise ConfigError("health.guard_every > 0 needs health.guard_prompts (the guard set's prompts)")
    if h.on_alert == "adapt" and cfg.model.finetune == "full" and cfg.algo.kl_beta == 0:
        raise ConfigError(
            "health.on_alert adapt with model.finetune full needs algo.kl_beta > 0: a full fine-tune keeps "
            "its reference copy only for a KL term"
        )
