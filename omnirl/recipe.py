"""Reading a YAML recipe plus command-line overrides into a `Config` (`load_config`): YAML recipe -> strict
dataclasses -> tyro CLI overrides -> the value checks.

A recipe only supplies values. An unknown key, a value of the wrong type or a missing required value is
one `ConfigError` line naming the key and the file. CLI overrides are `--section.field value` (tyro); a
flag that names no field is refused with the closest one. `scripts/train.py --help` (omnirl.cli_help)
prints the fields with the attribute docstrings of omnirl.config.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Set as AbstractSet
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml

from omnirl.algos.losses import loss_spec
from omnirl.config import RECIPE_DIR, Config, ModelConfig
from omnirl.config_checks import check_values, fp8_trained, sections
from omnirl.errors import ConfigError
from omnirl.models import get_adapter

REQUIRED = ("model.path", "data.train_path")

# Settings that moved into their component's own section: the old flat name (a recipe's key or a flag) is
# refused with one line naming the new one.
RENAMED = {
    "algo.dppo_tau": "algo.flow_dppo.tau",
    "algo.nft_beta": "algo.diffusion_nft.beta",
    "algo.nft_old_decay_rate": "algo.diffusion_nft.old_decay_rate",
    "algo.nft_old_decay_max": "algo.diffusion_nft.old_decay_max",
    "algo.nft_old_decay_delay": "algo.diffusion_nft.old_decay_delay",
    "algo.dgpo_beta": "algo.dgpo.beta",
    "algo.dgpo_timesteps": "algo.dgpo.timesteps",
    "algo.dgpo_max_step": "algo.dgpo.max_step",
    "rollout.vllm_sleep_level": "rollout.vllm.sleep_level",
    "rollout.vllm_max_model_len": "rollout.vllm.max_model_len",
    "rollout.vllm_push_bucket_mib": "rollout.vllm.push_bucket_mib",
    "rollout.vllm_request_seeds": "rollout.vllm.request_seeds",
    "rollout.vllm_logprobs": "rollout.vllm.logprobs",
    "rollout.fp8_steps": "rollout.fp8.steps",
    "rollout.fp8_fast_accum": "rollout.fp8.fast_accum",
    "rollout.fp8_select": "rollout.fp8.select",
}

# Settings that became a value of another (whatever their value), and old values renamed ("name value"):
# refused as the moved settings are, with one line naming the new value.
RENAMED_VALUES = {
    "sampling.sde_window_random": "sampling.sde_window_schedule dance",
    "sampling.sde_window_schedule random": "sampling.sde_window_schedule contiguous",
}


@functools.cache
def config_class(adapter: str) -> type[Config]:
    """`Config` with its `family` section typed as the `Settings` of `adapter` (an unknown adapter is a
    ConfigError naming the known ones), so the recipe's `family:` keys and `--family.x` overrides are
    checked like any other section's. Imports the adapter's module, which loads no weights."""
    # The families' modules import diffusers / transformers, whose import warns that the optional
    # torchvision is missing (a fallback omnirl does not need): quiet while the recipe is checked, so
    # that an error in it is its one line.
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        settings = get_adapter(adapter).Settings
    finally:
        transformers.logging.set_verbosity(verbosity)
    return dataclasses.make_dataclass(
        "Config",
        [("family", settings, field(default_factory=settings))],
        bases=(Config,),
        namespace={"__doc__": Config.__doc__},
    )


def config_for(adapter: str) -> Config:
    """The default config of `adapter`, with its family settings (tests and scripts build on it)."""
    cfg = config_class(adapter)()
    cfg.model.adapter = adapter
    return cfg


def resolve_recipe(name: str) -> Path:
    """`--recipe NAME` is yaml/NAME.yaml, or a path to a YAML file."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        return path
    path = RECIPE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown recipe {name!r}: no {path}; known recipes: {', '.join(known)}")
    return path


def _convert(tp: Any, value: Any, key: str, src: str) -> Any:
    """Check and convert one YAML value to the annotated type, naming key and file on failure."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{src}: {key}: expected {expected}, got {value!r} ({type(value).__name__})")

    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # (an annotation: a class, not an instance)
        if not isinstance(value, dict):
            raise bad(f"a mapping of {tp.__name__} fields")
        return _build(tp, value, key, src)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if is_bool_or_literal(tp):  # e.g. bool | Literal["auto"]: true, false or one of the words
            words = [w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a)]
            if isinstance(value, bool) or value in words:
                return value
            raise bad("true, false or " + ", ".join(repr(w) for w in words))
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, src)
    if origin is Literal:
        if f"{key} {value}" in RENAMED_VALUES:
            raise ConfigError(f"{src}: {key} {value} is now {RENAMED_VALUES[f'{key} {value}']}")
        if value not in args:
            raise bad("one of " + ", ".join(repr(a) for a in args))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad("a list")
        return [_convert(args[0], v, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad(f"a list of {len(args)} values")
        return tuple(_convert(a, v, f"{key}[{i}]", src) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad("a mapping")
        return {
            _convert(args[0], k, key, src): _convert(args[1], v, f"{key}.{k}", src) for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if tp is float:
        # PyYAML reads 3e-4 (no dot) as a string; accept numeric strings, reject anything else.
        if isinstance(value, bool):
            raise bad("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad("a number") from None
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    raise AssertionError(f"unsupported config type {tp} at {key}")


def _build(cls: type, data: dict, prefix: str, src: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            new = RENAMED.get(where) or RENAMED_VALUES.get(where)
            if new:
                raise ConfigError(f"{src}: {where} is now {new}")
            raise ConfigError(f"{src}: unknown key {where!r} (known keys here: {', '.join(names)})")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(hints[k], v, f"{prefix}.{k}" if prefix else k, src)
    return cls(**kwargs)


def recipe_adapter(data: dict, src: str) -> str:
    """The adapter a parsed recipe names (model.adapter, else the default), checked to be a string."""
    model = data.get("model", {})
    adapter = model.get("adapter", ModelConfig.adapter) if isinstance(model, dict) else ModelConfig.adapter
    if not isinstance(adapter, str):
        raise ConfigError(f"{src}: model.adapter: expected a string, got {adapter!r}")
    return adapter


def config_from_dict(data: dict, src: str = "<dict>", adapter: str | None = None) -> Config:
    """Strict conversion of a nested mapping (a parsed recipe) into a `Config` whose `family` section is
    the settings of `adapter` (default: the recipe's model.adapter)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: a recipe must be a mapping of sections, got {type(data).__name__}")
    adapter = adapter or recipe_adapter(data, src)
    data = {**data, "model": {**data.get("model", {}), "adapter": adapter}}
    return _build(config_class(adapter), data, "", src)


def dotted_keys(data: dict, prefix: str = "") -> list[str]:
    """The "section.field" names a parsed recipe sets, those of the sections inside a section too
    ("algo.dgpo.beta")."""
    keys = []
    for key, value in data.items():
        keys.append(prefix + str(key))
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


def check_required(cfg: Config, src: str) -> None:
    for key in REQUIRED:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) in ("", None):
            raise ConfigError(f"{src}: missing required value {key!r}")


def load_recipe(recipe: str, adapter: str | None = None) -> tuple[Config, Path]:
    path = resolve_recipe(recipe)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return config_from_dict(data or {}, str(path), adapter), path


def override_adapter(overrides: list[str]) -> str | None:
    """The value of a `--model.adapter NAME` (or `=NAME`) override: it decides the `family` section."""
    for i, arg in enumerate(overrides):
        if arg == "--model.adapter" and i + 1 < len(overrides):
            return overrides[i + 1]
        if arg.startswith("--model.adapter="):
            return arg.split("=", 1)[1]
    return None


def load_config(recipe: str, overrides: list[str]) -> Config:
    """Recipe YAML -> strict `Config` -> tyro CLI overrides (`--optim.lr 1e-4`)."""
    import tyro

    cfg, path = load_recipe(recipe, override_adapter(overrides))
    check_flags(type(cfg), overrides)
    check_dict_flags(cfg, overrides)
    args = bool_values(type(cfg), overrides)
    cfg = tyro.cli(type(cfg), default=cfg, args=args, description=f"omnirl recipe {path}")
    given = set(dotted_keys(yaml.safe_load(path.read_text()) or {}))
    command_line = {a[2:].split("=", 1)[0] for a in overrides if a.startswith("--")}
    backend_defaults(cfg, given | command_line, command_line)
    check_required(cfg, str(path))
    check_values(cfg)
    return cfg


# The native engine's decode-step settings, which the vLLM backend does not run.
NATIVE_DECODE = ("generation.compile", "generation.compile_modules", "generation.merge_lora")


def backend_defaults(
    cfg: Config, given: AbstractSet[str], command_line: AbstractSet[str] = frozenset()
) -> None:
    """A recipe written for the native engine switched to vLLM on the command line (`command_line`: the
    "section.field" names set there): its native decode settings (`NATIVE_DECODE`) do not apply and return
    to their defaults, unless the command line sets them too (then `config_checks` refuses them: they
    are the native engine's alone).

    rollout.backend vllm, and an FP8 rollout whose trained transitions ran in FP8 (`fp8_trained`:
    rollout.fp8.steps all, trained on its own samples with a log-prob loss): the rollout's kernels are not
    the trainer's, so the trainer recomputes the old log-probs (algo.old_logprob recompute) and corrects for
    the rollout's mismatch (algo.correction tis), unless the recipe or the command line sets these (`given`:
    the "section.field" names they set). Sol-RL's exploration (rollout.fp8.select) and DiffusionNFT (no
    transitions) run every step in FP8: rollout.fp8.steps all unless given. Otherwise the dataclass
    defaults stay."""
    r = cfg.rollout
    if r.backend == "vllm" and "rollout.backend" in command_line:
        defaults = type(cfg)()
        for key in set(NATIVE_DECODE) - command_line:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, getattr(getattr(defaults, section), name))
    explore = r.fp8.select or not loss_spec(cfg.algo.loss).logprobs
    if r.precision == "fp8" and explore and "rollout.fp8.steps" not in given:
        r.fp8.steps = "all"
    if r.backend != "vllm" and not fp8_trained(cfg):
        return
    if "algo.old_logprob" not in given:
        cfg.algo.old_logprob = "recompute"
    if "algo.correction" not in given:
        # Without the rollout's log-probs (rollout.vllm.logprobs false) there is nothing to correct against.
        vllm_silent = r.backend == "vllm" and not r.vllm.logprobs
        cfg.algo.correction = "none" if vllm_silent else "tis"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def is_bool_or_literal(tp: Any) -> bool:
    """A field that takes true, false or one of some words (`bool | Literal["auto"]`)."""
    args = typing.get_args(tp)
    return (
        typing.get_origin(tp) in (typing.Union, types.UnionType)
        and bool in args
        and any(typing.get_origin(a) is Literal for a in args)
    )


def check_flags(config_cls: type[Config], overrides: list[str]) -> None:
    """Every `--section.field` (or `--section.field=value`, `--section.no-flag`; `--section.sub.field` for a
    section inside a section) names a field of `config_cls` (a dict field's entries are
    `--section.field.KEY`): an unknown one is a ConfigError naming that flag alone, with the new name of a
    renamed setting (`RENAMED`), the new value of one that became a value (`RENAMED_VALUES`, as an old
    value is) or the closest field's flag when one is close (difflib)."""
    import difflib

    fields, flags, dicts = set(), set(), []
    for section, cls in sections(config_cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            fields.add(f"{section}.{f.name}")
            if tp is bool or is_bool_or_literal(tp):
                flags.add(f"{section}.no_{f.name}")
            if typing.get_origin(tp) is dict:
                dicts.append(f"{section}.{f.name}.")
    for i, arg in enumerate(overrides):
        if not arg.startswith("--") or arg in ("--help", "--help-all"):
            continue
        name = arg[2:].split("=", 1)[0]
        flag = arg.split("=", 1)[0]
        if name.replace("-", "_") in fields:
            value = arg.split("=", 1)[1] if "=" in arg else (overrides[i + 1 : i + 2] or [""])[0]
            old = f"{name.replace('-', '_')} {value}"
            if old in RENAMED_VALUES:
                raise ConfigError(f"{flag} {value} is now --{RENAMED_VALUES[old]}")
        if name.replace("-", "_") in fields | flags or name.startswith(tuple(dicts)):
            continue
        name = name.replace("-", "_")
        section, _, leaf = name.rpartition(".")
        old = f"{section}.{leaf.removeprefix('no_')}"
        if old in RENAMED_VALUES:
            raise ConfigError(f"{flag} is now --{RENAMED_VALUES[old]}")
        if old in RENAMED:
            new_section, _, new_leaf = RENAMED[old].rpartition(".")
            new = f"{new_section}.no_{new_leaf}" if leaf.startswith("no_") else RENAMED[old]
            raise ConfigError(f"{flag} is now --{new}")
        close = difflib.get_close_matches(name, sorted(fields), n=1)
        hint = f"did you mean --{close[0]}?" if close else "--help lists the options"
        raise ConfigError(f"unrecognized option {flag} ({hint})")


def check_dict_flags(cfg: Config, overrides: list[str]) -> None:
    """A dict field (`reward.weights`, `reward.paths`) takes one entry per flag, `--section.field.KEY VALUE`,
    for a KEY the recipe's dict holds (the command line sets entries, the recipe's YAML adds them): the
    field alone, or a KEY it does not hold, is a ConfigError naming the flag and the entries there are."""
    for arg in overrides:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        section, _, rest = flag[2:].replace("-", "_").partition(".")
        field, _, key = rest.partition(".")
        entries = getattr(getattr(cfg, section, None), field, None)
        if not isinstance(entries, dict):
            continue
        known = ", ".join(sorted(entries)) or "none"
        if not key:
            raise ConfigError(
                f"{flag} takes one entry per flag: --{section}.{field}.KEY VALUE (this recipe's entries: "
                f"{known})"
            )
        if key not in entries:
            raise ConfigError(
                f"{flag}: this recipe's {section}.{field} has no entry {key!r} (its entries: {known}); the "
                "command line sets entries, the recipe's YAML adds them"
            )


def bool_values(config_cls: type[Config], overrides: list[str]) -> list[str]:
    """`--section.flag true|false` (or `=true|false`, any case) as tyro's `--section.flag` /
    `--section.no-flag`, so a boolean field of `config_cls` takes a value like every other field; other
    arguments pass as they are."""
    flags, worded = set(), set()
    for section, cls in sections(config_cls):
        fields = typing.get_type_hints(cls).items()
        flags |= {f"{section}.{name}" for name, tp in fields if tp is bool}
        worded |= {f"{section}.{name}" for name, tp in fields if is_bool_or_literal(tp)}
    out, i = [], 0
    while i < len(overrides):
        arg, value = overrides[i], None
        name = arg[2:].replace("-", "_") if arg.startswith("--") else ""
        if "=" in name:
            name, value = name.split("=", 1)
        elif name in flags and i + 1 < len(overrides) and overrides[i + 1].lower() in ("true", "false"):
            value, i = overrides[i + 1], i + 1
        if name.replace(".no_", ".", 1) in worded and ".no_" in name and value is None:
            out += [f"--{name.replace('.no_', '.', 1)}", "False"]  # --section.no-field: false
            i += 1
            continue
        if name in worded:  # bool | Literal[...]: tyro takes True / False; a bare flag means true
            following = overrides[i + 1] if value is None and i + 1 < len(overrides) else None
            if value is None and (following is None or following.startswith("--")):
                value = "true"
            elif value is None:
                value, i = following, i + 1
            assert value is not None
            word = {"true": "True", "false": "False"}.get(value.lower(), value)
            out += [f"--{name}", word]
            i += 1
            continue
        if name in flags and value is not None and value.lower() in ("true", "false"):
            section, _, field_name = name.rpartition(".")
            arg = f"--{section}.{field_name}" if value.lower() == "true" else f"--{section}.no-{field_name}"
        out.append(arg)
        i += 1
    return out
