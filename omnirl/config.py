"""Every config section as a dataclass, and `load_config`: YAML recipe -> strict dataclasses -> CLI overrides.

A recipe only supplies values. An unknown key, a value of the wrong type or a missing required value is
a `ConfigError` naming the key and the file. CLI overrides are `--section.field value` (tyro), and
`--help` prints every field with the attribute docstrings below.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = REPO_ROOT / "yaml"


class ConfigError(ValueError):
    """A recipe or override that cannot become a valid config."""


@dataclass
class RunConfig:
    name: str = "omnirl"
    """Run name, used in logs."""
    output_dir: str = "outputs/omnirl"
    """Where logs, samples, checkpoints and exported weights go."""
    seed: int = 0
    """Base seed: request seeds derive from (seed, step, global request index), never from the rank."""
    steps: int = 100
    """Number of RL steps (rollout -> reward -> advantage -> update)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local directory or hub id of the model (diffusers layout for diffusion models). Required."""
    adapter: str = "sd3"
    """Adapter name (see omnirl.models.ADAPTERS)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight and compute dtype of the frozen parts (text encoders, VAE, the frozen transformer base)."""
    finetune: Literal["lora", "full"] = "lora"
    """Train a LoRA (base frozen and replicated) or every transformer weight (FSDP2-sharded)."""
    gradient_checkpointing: bool = False
    """Recompute activations of each transformer block in the backward pass."""


@dataclass
class LoraConfig:
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA alpha (the update is scaled by alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names (peft suffix match) that receive LoRA."""
    init: Literal["default", "gaussian"] = "default"
    """peft init_lora_weights: 'default' (B = 0, so the first policy equals the base) or 'gaussian'."""
    dropout: float = 0.0
    """LoRA dropout. Keep 0: dropout breaks the match of rollout and trainer log-probs."""


@dataclass
class SamplingConfig:
    height: int = 512
    """Image height in pixels."""
    width: int = 512
    """Image width in pixels."""
    num_steps: int = 10
    """Denoising steps of a training rollout."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale (1 = no guidance)."""
    noise_level: float = 0.7
    """SDE noise level a (0 = the deterministic ODE sampler)."""
    sde_type: Literal["sde", "cps", "ode"] = "sde"
    """Stochastic step: 'sde' (Flow-GRPO), 'cps' (coefficient-preserving) or 'ode'."""
    sde_window_size: int = 0
    """Trained SDE steps per sample (ODE outside the window); 0 trains every step."""
    sde_window_range: tuple[int, int] = (0, 1)
    """The window start is drawn per request, uniformly from [lo, hi)."""
    negative_prompt: str = ""
    """Negative prompt of the unconditional CFG branch."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    """Prompts per RL step over all ranks (each rank takes an equal share)."""
    group_size: int = 8
    """Samples per prompt (a GRPO group)."""
    max_num_seqs: int = 32
    """Most requests in one packed transformer forward (CFG rows not counted)."""


@dataclass
class DataConfig:
    train_path: str = ""
    """JSONL file of prompts ({"prompt": ...} per line). Required."""
    val_path: str = ""
    """Optional JSONL of validation prompts."""


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Reward name -> weight; the reward is the weighted sum (see omnirl.rewards.REWARDS)."""
    num_workers: int = 2
    """Threads that score finished samples."""
    timeout_s: float = 300.0
    """A scorer that takes longer than this for one batch is an error."""


@dataclass
class AlgoConfig:
    loss: str = "flow_grpo"
    """Loss name (see omnirl.algos.losses.LOSSES)."""
    clip_range: float = 1e-4
    """PPO clip range epsilon of the importance ratio."""
    kl_beta: float = 0.0
    """Weight of the KL term to the reference policy (0 = off)."""
    adv_clip: float = 5.0
    """Advantages are clamped to [-adv_clip, adv_clip]."""
    global_std: bool = False
    """Normalise advantages by the std of all rewards of the step (all ranks) instead of the group's."""
    old_logprob: Literal["rollout", "recompute"] = "rollout"
    """Log-prob of the behaviour policy in the ratio: the one the rollout recorded, or recomputed by the
    trainer before the first update."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Gradient norm clip (0 = off)."""
    micro_batch_size: int = 8
    """(sample, trained step) pairs per forward/backward."""
    mini_batches: int = 1
    """Optimizer steps per rollout: the step's pairs are split into this many mini-batches."""
    epochs: int = 1
    """Passes over the rollout's data per RL step."""


@dataclass
class DistributedConfig:
    fsdp: bool = True
    """Wrap the transformer with FSDP2 (LoRA: only the adapter is sharded; full: everything)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gathered parameters in forward/backward."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gradient reduction."""
    timeout_s: int = 600
    """Collective timeout: a rank that dies or hangs ends the job after this long."""


@dataclass
class LogConfig:
    image_every: int = 10
    """Write a grid of sample images to tensorboard every N steps (0 = never)."""
    tensorboard: bool = True
    """Write tensorboard event files under output_dir/tb."""


@dataclass
class ValidationConfig:
    every: int = 0
    """Validate every N steps on data.val_path with the ODE sampler (0 = never)."""
    num_steps: int = 10
    """Denoising steps of a validation rollout."""


@dataclass
class ExportConfig:
    lora_at_end: bool = True
    """Write the LoRA in the diffusers format (pytorch_lora_weights.safetensors) when training ends."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log: LogConfig = field(default_factory=LogConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


REQUIRED = ("model.path", "data.train_path")


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

    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad(f"a mapping of {tp.__name__} fields")
        return _build(tp, value, key, src)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, src)
    if origin is Literal:
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
            raise ConfigError(f"{src}: unknown key {where!r} (known keys here: {', '.join(names)})")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(hints[k], v, f"{prefix}.{k}" if prefix else k, src)
    return cls(**kwargs)


def config_from_dict(data: dict, src: str = "<dict>") -> Config:
    """Strict conversion of a nested mapping (a parsed recipe) into a `Config`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{src}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return _build(Config, data, "", src)


def check_required(cfg: Config, src: str) -> None:
    for key in REQUIRED:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) in ("", None):
            raise ConfigError(f"{src}: missing required value {key!r}")


def load_recipe(recipe: str) -> tuple[Config, Path]:
    path = resolve_recipe(recipe)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return config_from_dict(data or {}, str(path)), path


def load_config(recipe: str, overrides: list[str]) -> Config:
    """Recipe YAML -> strict `Config` -> tyro CLI overrides (`--optim.lr 1e-4`)."""
    import tyro

    cfg, path = load_recipe(recipe)
    cfg = tyro.cli(Config, default=cfg, args=overrides, description=f"omnirl recipe {path}")
    check_required(cfg, str(path))
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
