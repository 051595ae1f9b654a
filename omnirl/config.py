"""Every config section as a dataclass; omnirl.recipe reads a YAML recipe and CLI overrides into them.

The attribute docstrings below document the fields: `--help` prints every field with them.

A model family's own settings are not a section here: each adapter class names its `Settings` dataclass
(omnirl.models), and the recipe's `family:` section is checked against the one of `model.adapter`, as
strictly as the sections below (`omnirl.recipe.config_class`). The rollout's sections live in
omnirl.config_rollout and are exported here. This module imports nothing of omnirl but that one, which
imports nothing of omnirl: every other module may import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

# The rollout's sections, exported here as this module's own.
from omnirl.config_rollout import FP8Config as FP8Config
from omnirl.config_rollout import GenerationConfig as GenerationConfig
from omnirl.config_rollout import RolloutConfig as RolloutConfig
from omnirl.config_rollout import SamplingConfig as SamplingConfig
from omnirl.config_rollout import VLLMConfig as VLLMConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = REPO_ROOT / "yaml"


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
    compile_cache: str = "auto"
    """Where inductor keeps what it compiles (rollout.compile, train.compile, generation.compile) for later
    processes: 'auto' is TORCHINDUCTOR_CACHE_DIR where the user set it, else ~/.cache/omnirl/torchinductor
    (under XDG_CACHE_HOME where that is set), which outlives /tmp, inductor's own default; a path takes that
    directory. A run of shapes compiled before loads its graphs from there in step 0 instead of compiling
    them (docs/update.md#compiled-update-traincompile). Step 0's memory probes are kept there too, in its
    omnirl-memory-probes folder, for the next run of the same shapes (omnirl.probe_cache)."""


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
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations of each transformer block in the backward pass. 'auto': off unless the update
    would not fit the device without it, decided at the first update from one measured micro-batch and
    printed with its reason (omnirl.autotune; docs/memory.md)."""
    weights: Literal["pretrained", "random"] = "pretrained"
    """pretrained: the weights at model.path. random: every model built from its config at model.path with
    random weights (omnirl.models.random_init), the same on every rank, reading no weight files: for
    measuring memory and speed without the checkpoint's weights (a config-only checkpoint will do)."""


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
class DataConfig:
    train_path: str = ""
    """JSONL file of prompts ({"prompt": ...} per line). Required."""
    val_path: str = ""
    """Optional JSONL of validation prompts."""
    format: Literal["prompts", "edit", "mmk12"] = "prompts"
    """Row schema of the data files: 'prompts' ({"prompt": ..., any other keys}), 'edit' (source image,
    instruction, optional target image, target text and region: omnirl.data.edit) or 'mmk12' (parquet or
    JSONL of image, question, answer, optional choices: omnirl.data.mmk12)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row (not JSON, not an object, no non-empty "prompt", an unreadable image) or one whose
    prompt is too long for the model: 'error' stops with the file and line; 'skip' drops it, warns with
    each file:line once at start and logs data/skipped_rows at step 0. Too long, checked once the model's
    tokenizer is loaded (prompts are refused, not truncated): an omni model's prompt with
    generation.max_new_tokens past the model's context, or a Qwen-Image-Edit instruction with its
    condition image's tokens past the largest family.prompt_length_buckets. SD3, Qwen-Image and Wan
    truncate prompts to their text encoder's limit, as their pipelines do."""


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Reward name -> weight; the reward is the weighted sum (see omnirl.rewards.REWARDS)."""
    paths: dict[str, str] = field(default_factory=dict)
    """Reward name -> the local checkpoint directory of a reward whose weights live on a hub (clip_video,
    hpsv3); the reward is built with it (`Reward(path)`)."""
    num_workers: int = 2
    """Threads that score finished samples."""
    timeout_s: float = 300.0
    """A scorer that takes longer than this for one batch is an error."""


# A loss's own settings are the section of AlgoConfig named as the loss is in omnirl.algos.losses.LOSSES
# (algo.<loss>.<field>); each checks its numbers in RANGES, as a family's `Settings` does.


@dataclass
class FlowDPPOConfig:
    """flow_dppo's divergence mask (omnirl.algos.losses.flow_dppo_loss)."""

    tau: float = 1e-5
    """The divergence D_t (the exact KL between the step Gaussians of the policy and of the rollout) from
    which a row whose ratio moved in its advantage's direction is masked out."""

    RANGES: ClassVar[dict] = {"tau": ((lambda v: math.isfinite(v) and v > 0), "a finite number > 0")}


@dataclass
class DiffusionNFTConfig:
    """diffusion_nft's implicit policies and its soft-updated old policy (omnirl.algos.losses,
    omnirl.ops.nft)."""

    beta: float = 1.0
    """How far the implicit positive / negative policies move from the old velocity:
    v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) v_old - beta v_theta."""
    old_decay_rate: float = 0.001
    """The old policy (which samples the rollouts and gives v_old) is a soft-updated copy of the trained
    weights, theta_old <- eta theta_old + (1 - eta) theta after every update, with
    eta = min(old_decay_rate * (s - old_decay_delay), old_decay_max) after s optimizer steps (0 while
    s < old_decay_delay). The defaults are DiffusionNFT's (its decay_type 1: 0.001 per step, at most 0.5, no
    delay); its decay_type 2 is rate 0.0075, max 0.999, delay 75. A rate or max of 0 keeps no copy: the old
    policy is the one that sampled the rollout (decay_type 0)."""
    old_decay_max: float = 0.5
    """The largest eta of the old policy's soft update (see old_decay_rate), < 1."""
    old_decay_delay: int = 0
    """Optimizer steps before the old policy's eta starts to grow (see old_decay_rate)."""

    RANGES: ClassVar[dict] = {
        "beta": ((lambda v: math.isfinite(v) and v > 0), "a finite number > 0"),
        "old_decay_rate": ((lambda v: math.isfinite(v) and v >= 0), "a finite number >= 0"),
        "old_decay_max": ((lambda v: math.isfinite(v) and 0 <= v < 1), "a number in [0, 1)"),
        "old_decay_delay": ((lambda v: v >= 0), "an integer >= 0"),
    }


@dataclass
class DGPOConfig:
    """dgpo's group preference and its trained times (omnirl.algos.losses.dgpo_loss, omnirl.ops.dgpo)."""

    beta: float = 100.0
    """The scale of a group's preference margin: each (group, time) weighs its rows by
    sigmoid(sum over the group of A_i beta (dsm_i - dsm_ref_i) / group_size) (the reference's beta_dpo)."""
    timesteps: int = 4
    """The times each sample is trained at per update, drawn per group without replacement from the steps
    0 .. max_step of the rollout's schedule (the reference's num_train_timesteps)."""
    max_step: int = 6
    """The last step index of the rollout's schedule whose sigma a trained time may be (the reference's
    trunc_steps: the low-noise end of the schedule is not trained)."""
    trust_region: bool = False
    """The reference's PPO-style trust region (its clip_dsm) around an EMA copy of the trained weights: a
    row whose ratio exp(dsm_ema - dsm) has left 1 + clip_range (advantage > 0) or 1 - clip_range
    (otherwise) adds no gradient (its dsm is detached; algo.clip_range, the reference's 1e-3). The copy
    follows the weights after every optimizer step s (from 0): ema <- ema + (1 - d) (theta - ema),
    d = min(0.3, 0.001 s) (the reference's ema_ref)."""
    clip_kl: bool = False
    """With trust_region, a clipped row's KL term adds no gradient either (the reference's clip_kl)."""
    ema_ref: bool = False
    """The group margins compare the policy with the EMA copy (see trust_region) instead of the reference
    policy, the LoRA off (the reference's use_ema_ref); the KL term still compares with the reference
    policy."""
    ema_rollout_after: int | None = None
    """Rollouts sample with the EMA copy's weights (see trust_region) once more than this many optimizer
    steps have been taken (the reference's switch_ema_ref); null: always with the policy's."""

    RANGES: ClassVar[dict] = {
        "beta": ((lambda v: math.isfinite(v) and v > 0), "a finite number > 0"),
        "timesteps": ((lambda v: v >= 1), "an integer >= 1"),
        "max_step": ((lambda v: v >= 0), "an integer >= 0"),
        "ema_rollout_after": ((lambda v: v is None or v >= 0), "null or an integer >= 0"),
    }


@dataclass
class AlgoConfig:
    loss: str = "flow_grpo"
    """Loss name (see omnirl.algos.losses.LOSSES)."""
    clip_range: float = 1e-4
    """PPO clip range epsilon of the importance ratio."""
    kl_beta: float = 0.0
    """Weight of the KL term to the reference policy (0 = off)."""
    kl_form: Literal["flow_grpo", "exact"] = "flow_grpo"
    """Diffusion losses: the KL term per trained step. 'flow_grpo' (flow_grpo's and so its published
    kl_beta's): mean over latent dims of (mu_theta - mu_ref)^2 / (2 s_t^2), s_t the SDE coefficient
    a sqrt(sigma / (1 - sigma)) before the sqrt(|dt|) factor. 'exact': the Gaussian KL, divided by the
    step's variance s_t^2 |dt|, i.e. 1 / |dt| larger (on SD3.5's 10-step shift-3 schedule 4-25x on the
    first nine steps, ~110x on the last), so the same kl_beta weighs it that much more. Equal for CPS and
    dance_sde: their references' s_t is the step's whole std (dance_sde: a sqrt(|dt|), VeRL-Omni's)."""
    adv_clip: float | None = 5.0
    """Advantages are clamped to [-adv_clip, adv_clip]; null leaves them unclamped (Flow-DPPO's references,
    UniRL and VeRL-Omni: one success in a group of 48 keeps its sqrt(47) = 6.86). diffusion_nft needs a
    number: it maps A to its optimality probability A / (2 adv_clip) + 0.5."""
    global_std: bool = False
    """Normalise advantages by the std of all rewards of the step (all ranks) instead of the group's."""
    old_logprob: Literal["rollout", "recompute"] = "rollout"
    """Log-prob of the behaviour policy in the ratio: the one the rollout recorded, or recomputed by the
    trainer before the first update."""
    clip_range_high: float | None = None
    """Token losses (grpo, gspo): upper clip epsilon, the ratio being clipped to [1 - clip_range,
    1 + clip_range_high]; above clip_range it is DAPO's clip-higher. None = clip_range."""
    aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"
    """Token losses: mean over all tokens of the mini-batch, mean of each response's token mean, or
    Dr.GRPO's token sum over generation.max_new_tokens per response (omnirl.algos.losses.grpo_loss)."""
    std_normalise: bool = True
    """Divide advantages by the reward std (False: Dr.GRPO's plain r - group mean; needs global_std off)."""
    correction: Literal["none", "tis", "mis"] = "none"
    """Rollout correction with old_logprob recompute: weight each token's loss by the ratio of trainer to
    rollout probability, truncated at correction_threshold (tis) or zeroed outside [1/C, C] (mis).
    old_logprob rollout is the bypass mode: nothing to correct (omnirl.algos.correction)."""
    correction_level: Literal["token", "sequence"] = "token"
    """Correction ratio per token, or per response (the product of its token ratios)."""
    correction_threshold: float = 2.0
    """The correction's C (> 1)."""
    flow_dppo: FlowDPPOConfig = field(default_factory=FlowDPPOConfig)
    """algo.loss flow_dppo: its own settings."""
    diffusion_nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)
    """algo.loss diffusion_nft: its own settings."""
    dgpo: DGPOConfig = field(default_factory=DGPOConfig)
    """algo.loss dgpo: its own settings."""


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
    """Rows per training forward/backward: (sample, trained step) pairs of a diffusion model, responses of
    an omni model."""
    micro_batch_tokens: int = 0
    """Omni models: most tokens in one training forward/backward, counted as the micro-batch pads them:
    rows x (longest prompt + longest response). Rows join a micro-batch while both this and
    micro_batch_size allow (a row longer than the budget runs alone); 0 = no token budget."""
    mini_batches: int = 1
    """Optimizer steps per rollout: the step's pairs are split into this many mini-batches."""
    epochs: int = 1
    """Passes over the rollout's data per RL step (flow_dppo is meant for several: its mask keeps every
    pass inside the trust region around the rollout's policy)."""


@dataclass
class TrainConfig:
    compile: bool = False
    """torch.compile the transformer's repeated blocks for the update too (forward, backward, the KL
    reference pass), block by block as rollout.compile does for the rollout; micro-batches are padded to a
    few row counts so that no step recompiles (benchmarks/RESULTS.md has what it gives)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """The update's GEMMs of the frozen base of a LoRA run: 'fp8' runs them (the forward and the activation
    gradient of the backward) in float8 e4m3 with row-wise scales, the same GEMM an FP8 rollout runs, the
    base quantised once per run in both layouts; the LoRA branches and the layers the family keeps in bf16
    stay in the model's precision (omnirl.train_fp8, docs/fp8_rollout.md). Needs model.finetune lora and a
    device with FP8 matmuls (or the CPU's emulation)."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A non-finite sample, loss or gradient norm in a step: 'skip' drops that optimizer step on every rank
    (counted in train/skipped_nonfinite), 'stop' ends the run naming the step. Either way a step whose
    every sample is non-finite, or a run that skipped every update, ends the run and exports nothing. A
    non-finite reward is always an error (a scorer bug, raised by the reward pool); advantages of finite
    rewards are finite."""


@dataclass
class DistributedConfig:
    fsdp: bool = True
    """Wrap the transformer with FSDP2 (LoRA: only the adapter is sharded; full: everything)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gathered parameters in forward/backward."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gradient reduction."""
    frozen_base: Literal["replicate", "shard", "offload"] = "replicate"
    """Where the frozen weights live: the base of a LoRA run, and the reference copy of a full fine-tune
    with KL. 'replicate': a whole copy on every rank (a full fine-tune's reference copy: sharded like the
    actor), no all-gather of the base; 'shard': FSDP2 shards them with the trained parameters (1/N per
    rank), each forward and backward gathers one unit at a time and frees it after; 'offload': sharded as
    with 'shard' and kept in pinned host memory (FSDP2's CPUOffloadPolicy), each unit copied to the device
    when it runs; the trained parameters of those units, their gradients and AdamW state then live in
    host memory too and the optimizer steps on the CPU. Needs distributed.fsdp (docs/memory.md)."""
    rollout_gather: Literal["phase", "unit"] = "phase"
    """How the rollout reads sharded or offloaded weights: 'phase' gathers all of them once for the whole
    rollout (a whole model copy on the device, also from host memory with 'offload', freed after; no
    collective inside the rollout; a gather that cannot fit in the free memory is refused before it starts,
    naming both sizes); 'unit' gathers one FSDP unit per forward and frees it after, the next unit's
    gather issued ahead (FSDP2 forward prefetch), so every rank runs the same number of forwards (a rank
    with fewer batches runs padding batches). Omni models: one rank only (ranks decode different numbers
    of steps) and no CUDA graph."""
    mode: Literal["colocated", "async"] = "colocated"
    """'colocated': every rank generates and trains, one phase after the other. 'async': some ranks only
    generate (distributed.rollout_ranks) and the others only train, at the same time: the rollout ranks
    generate step k + 1 with the policy of step k while the training ranks update on step k's samples;
    the trained tensors go to the rollout ranks by a broadcast after each update (omnirl.async_mode;
    docs/async.md)."""
    rollout_ranks: float = 0.5
    """distributed.mode async: the ranks that generate, as a count (1, 2, ...) or as a fraction of the
    job's ranks (0 < f < 1, rounded); the last ranks of the job generate, the first ones train, and
    both sides need at least one rank."""
    max_staleness: int = 1
    """distributed.mode async: how many updates older than the one it is trained after a sample's policy
    may be. 0 makes the rollout wait for every update (the colocated algorithm on disjoint ranks); s >= 1
    lets the rollout of step k use the policy of step k - s, and the loss weights each sample by the
    truncated importance weight of the trainer's to the rollout's probability (algo.old_logprob
    recompute, algo.correction tis or mis)."""
    timeout_s: int = 600
    """Collective timeout: a rank that hangs ends the job after this long (NCCL's watchdog takes about a
    minute more); one that raises or dies ends it at once (torchrun stops the other ranks)."""


@dataclass
class MemoryConfig:
    sleep: bool | Literal["auto"] = "auto"
    """Between phases, move what a phase does not use to pinned host memory and back (rollout: optimizer
    state and a full fine-tune's reference copy; training: text encoders, VAE and reward models). Off keeps
    everything on the device: faster where it all fits, the same results either way. 'auto': step 0 sleeps
    as true; from then on each group stays on the device where step 0's measured peak of the phase it
    sleeps through, plus the group, fits the device with a margin (omnirl.autotune; printed with its
    numbers). On CPU, and with a rollout engine holding weights of its own (vLLM), as true."""


@dataclass
class LogConfig:
    image_every: int = 10
    """Every N steps (0 = never) write samples under output_dir/samples and to tensorboard: a grid of
    images (diffusion models) or the first responses as text (omni models)."""
    tensorboard: bool = True
    """Write tensorboard event files under output_dir/tb."""


@dataclass
class ValidationConfig:
    every: int = 0
    """Validate every N steps on data.val_path (0 = never): diffusion models with the ODE sampler, omni
    models with num_samples responses per prompt at the temperature and top_p below."""
    num_steps: int = 10
    """Denoising steps of a validation rollout."""
    num_samples: int = 1
    """Samples (images or responses) per validation prompt."""
    temperature: float = 1.0
    """Omni models: sampling temperature of validation responses (generation.* applies otherwise)."""
    top_p: float = 1.0
    """Omni models: nucleus sampling of validation responses (1 = off)."""


@dataclass
class ExportConfig:
    lora_at_end: bool = True
    """Write the LoRA to output_dir/lora when training ends: in the diffusers format
    (pytorch_lora_weights.safetensors) for diffusion models, as a peft adapter for omni models."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save a checkpoint every N steps and after the last step (0 = never), under output_dir/checkpoints."""
    keep: int = 3
    """Keep the newest K checkpoints; older ones are deleted after each save."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in output_dir/checkpoints (start fresh if there
    is none); a path: continue from that checkpoint directory; '': start fresh. Continuing must not write
    over newer checkpoints: '' over existing ones, or an older path among newer ones, is an error. A
    checkpoint of another adapter, model path, finetune mode or LoRA shape is an error."""


@dataclass
class HealthConfig:
    """The run's self-checks (omnirl.health, docs/health.md): the LoRA proof before the first step, the
    rollout-vs-trainer parity gate, the reward-hacking monitors and what an alert does."""

    on_alert: Literal["warn", "stop", "adapt"] = "warn"
    """What a monitor's alert does: 'warn' prints one line (metric, value, threshold, step); 'stop' saves a
    checkpoint and ends the run (exit status 1); 'adapt' raises algo.kl_beta while an alert holds and
    relaxes it once the metric recovers (the adaptive KL controller of Ziegler et al. 2019)."""
    monitors: bool = True
    """Log the sample statistics every step (health/*): in-group diversity, image, video, audio and
    response statistics; off also turns off the alerts they raise."""
    baseline_steps: int = 3
    """The first steps of the run whose in-group diversity is the reference of health/diversity_ratio."""
    diversity_min: float = 0.5
    """Alert when the step's in-group diversity falls below this fraction of the first steps'."""
    dark_max: float = 0.9
    """Alert when the fraction of dark pixels (luma < 0.05) of the step's images passes this."""
    saturated_max: float = 0.9
    """Alert when the fraction of clipped pixels (a channel at 0 or 1) of the step's images passes this."""
    entropy_min: float = 0.5
    """Alert when the images' colour entropy falls below this fraction of the first steps'."""
    repetition_max: float = 0.5
    """Omni models: alert when the fraction of repeated 3-grams of the responses passes this."""
    silence_max: float = 0.9
    """Audio: alert when the fraction of silent 10 ms frames (below -60 dBFS) passes this."""
    patience: int = 2
    """Consecutive steps a metric must stay past its threshold before it alerts (and, with adapt, before
    the KL weight relaxes again)."""
    parity: bool = True
    """The parity gate: at the first update and every parity_every steps, the trainer's log-prob of the
    rollout's recorded steps (tokens) against the rollout's; past the tolerance of the run's precision the
    run stops with one line."""
    parity_every: int = 50
    """Steps between two parity checks after the first update (0: only the first)."""
    parity_tolerance: dict[str, float] = field(
        default_factory=lambda: {"fp32": 1e-3, "bf16": 5e-2, "fp8": 0.5, "vllm": 0.5}
    )
    """Largest mean |trainer - rollout| log-prob gap of a timestep (diffusion) or of the tokens (omni),
    per precision of the rollout: fp32, bf16, fp8 (rollout.precision fp8) and vllm (rollout.backend)."""
    lora_proof: bool = True
    """Count the LoRA modules per expert, stream and copy before the first step (a target that binds
    nothing, or an expert left without LoRA, is an error), and check after the first optimizer step that
    the module the rollout runs changed."""
    guard_prompts: list[str] = field(default_factory=list)
    """Held-out prompts generated every guard_every steps with fixed seeds (the validation sampler) and
    scored by guard_reward and the training reward; a grid of them goes to tensorboard (guard)."""
    guard_every: int = 0
    """Steps between two guard generations (0: never)."""
    guard_reward: dict[str, float] = field(default_factory=dict)
    """Reward name -> weight of the guard's own score (empty: the training reward alone)."""
    guard_drop: float = 0.2
    """Alert when the guard reward falls this fraction of its first value's magnitude below that value while
    the training reward is above its first steps' mean."""
    adapt_kl_init: float = 0.1
    """adapt: the KL weight an alert starts from when algo.kl_beta is 0."""
    adapt_rate: float = 0.5
    """adapt: the controller's gain K: beta <- beta (1 + K e), e in [-1, 1] the metric's clipped
    relative distance from its threshold."""
    adapt_kl_max: float = 10.0
    """adapt: the largest KL weight the controller sets."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    log: LogConfig = field(default_factory=LogConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    family: Any = None
    """The model family's own settings: an instance of the `Settings` dataclass of the adapter named by
    model.adapter. `omnirl.recipe.config_class` types it; a plain `Config()` has none."""
