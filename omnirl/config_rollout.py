"""The rollout's config sections: sampling (diffusion), generation (omni), rollout and its vllm and fp8
sections. omnirl.config holds them in Config beside the other sections and exports them as its own.

The attribute docstrings below document the fields: `--help` prints every field with them. This module
imports nothing of omnirl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


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
    sde_type: Literal["sde", "cps", "dance_sde", "ode"] = "sde"
    """Stochastic step: 'sde' (Flow-GRPO), 'cps' (coefficient-preserving), 'dance_sde' (DanceGRPO) or
    'ode'."""
    sde_window_size: int = 0
    """Trained SDE steps per sample W (ODE outside the window); 0 trains every step but the last (as
    flow_grpo's timestep_fraction 0.99: the last step, to sigma 0, is a very sharply peaked Gaussian)."""
    sde_window_range: tuple[int, int] = (0, 1)
    """[lo, hi): the steps a window (or subset) of W > 0 may cover. A window's start is drawn per request,
    uniformly from lo .. hi - W, so the window stays inside the range (flow_grpo's and VeRL-Omni's draw):
    [0, 5) with W = 2 trains two consecutive steps among 0-4. Needs lo + W <= hi <= num_steps."""
    sde_window_schedule: Literal["contiguous", "dance", "subset", "sliding", "sliding_compressed"] = (
        "contiguous"
    )
    """Which steps of each sample train and which take the SDE step (the ODE step elsewhere). 'contiguous'
    (flow_grpo, VeRL-Omni): each request's window of sde_window_size steps from a start drawn in
    sde_window_range, the SDE on it alone. 'dance' (DanceGRPO): every step but the last takes the SDE step,
    and sde_window_size of them, drawn per request without replacement from sde_window_range, train (its
    timestep_fraction f over T steps is a size of int(f (T - 1)) in [0, T - 1); the last step is the ODE
    step to sigma 0, whose result is the x0 prediction DanceGRPO decodes).
    'subset' (VeRL-Omni's LTX-2 Flow-GRPO: 3 of the first 10 steps): that draw, the SDE on the trained steps
    alone. 'sliding' (MixGRPO's progressive strategy): one window for every request of a step, at lo first,
    moving by sde_window_stride steps every sde_window_shift_interval RL steps; at the end of the range it
    shrinks to the steps left (W, ..., 2, 1), and once its start would reach hi it goes back to lo (the
    reference first spends one period on an empty window, which trains nothing: skipped here); MixGRPO's
    range is [0, num_steps - 2): it never trains the last two steps. 'sliding_compressed' (MixGRPO-Flash):
    the sliding window, and the ODE after it on a compressed schedule (ode_compress_ratio)."""
    sde_window_shift_interval: int = 25
    """sliding: RL steps between two moves of the window (MixGRPO's iters_per_group)."""
    sde_window_stride: int = 1
    """sliding: steps the window moves at a time (MixGRPO's prog_overlap_step)."""
    ode_solver: Literal["euler", "dpm2"] = "euler"
    """The ODE step after a row's window: 'euler' (the diffusers pipelines' flow-matching Euler step) or
    'dpm2' (DPM-Solver++ 2M multistep on the data prediction x0 = x - sigma v, MixGRPO-Flash's solver
    after the window: second order from the previous step's x0; its first-order steps, the one to sigma 0
    included, are exactly Euler). Steps before and inside the window are unchanged, except in a noise-free
    rollout (noise_level 0 or sde_type ode, validation's included), which takes dpm2 at every step."""
    ode_compress_ratio: float = 0.0
    """MixGRPO-Flash: after the window, the ODE runs on a compressed schedule: int(max(ratio (T - L), 1))
    points (L the window's last step; at least the step to sigma 0) evenly spaced in unshifted time from
    sigma_{L+1} to 0 and shifted as the schedule is, instead of the T - L - 1 steps left (0 = off; the
    reference's 0.4). A setting of sde_window_schedule sliding_compressed alone, which needs it > 0."""
    shared_initial_noise: bool = False
    """All samples of a prompt start from the same initial latents, drawn from the group's own seed
    (DanceGRPO); the SDE noise stays per sample."""
    negative_prompt: str = ""
    """Negative prompt of the unconditional CFG branch."""


@dataclass
class GenerationConfig:
    """Sampling of text-output (omni) models in training rollouts; diffusion recipes leave it out. The
    requests per forward are bounded by rollout.max_num_seqs."""

    temperature: float = 1.0
    """Softmax temperature. The log-prob recorded by the rollout and recomputed by the trainer is
    log_softmax(logits / temperature) over the full vocabulary at the sampled token."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p (1 = off).
    It shapes sampling only, never the recorded log-prob."""
    top_k: int = 0
    """Draw from the k most likely tokens (0 = off). It shapes sampling only, never the recorded log-prob."""
    max_new_tokens: int = 1024
    """Most tokens generated per response (a response cut here has no stop token); also the constant
    length of algo.aggregation dr_grpo."""
    stop: list[str] = field(default_factory=list)
    """Extra stop tokens, each a single token of the tokenizer written as text (e.g. "<|im_end|>"; it
    becomes GenerationParams.stop_token_ids); a response also ends at the model's EOS tokens. The stop
    token is part of the response and is trained."""
    kv_cache_gib: float | None = None
    """KV-cache budget per rank in GiB (> 0), or null: generation.kv_cache_fraction of the device memory
    free when the rollout starts (after the weights, with the optimizer state asleep; like a serving
    engine's memory utilisation). The engine keeps rollout.max_num_seqs rows ("slots") of the longest
    prompt plus max_new_tokens tokens each, or as many as fit in this budget."""
    kv_cache_fraction: float = 0.5
    """With kv_cache_gib null: the fraction of the free device memory (rollout.memory_budget_gib when set)
    the KV cache takes; the rest is left to the forwards' activations. In (0, 1)."""
    max_prefill_tokens: int = 16384
    """Padded prompt tokens per prefill forward of the native engine (distinct prompts in a group x the
    longest of them: a group's samples share one prefill; a prompt longer than this is prefilled alone):
    a prefill's memory (its KV before the copy into the slots, the MoE and attention work space) grows
    with them and is not part of the KV budget, so this bounds what the rollout needs beside the weights
    and the KV cache. rollout.backend vllm schedules its own (chunked) prefill."""
    kv_windows: int = 4
    """KV windows of the native engine's decode step (>= 1): a step attends to the narrowest of this many
    widths of the KV cache (multiples of 64 columns, the widest the whole cache) that holds every busy
    slot's tokens, so while the rows are short the attention reads a fraction of the cache (one CUDA
    graph per window). 1 attends to the whole cache in every step."""
    row_buckets: int = 1
    """Slot counts of the native engine's decode step (>= 1): a step computes the smallest of this many
    sizes (all rollout.max_num_seqs slots and halvings of them) that holds the busy slots, which are first
    moved to the lowest slots (their KV rows copied on the device), so the tail of a rollout, where most
    responses have stopped, does not compute every slot (one CUDA graph per size and KV window). 1
    computes every slot in every step."""
    merge_lora: bool = False
    """The native engine runs each LoRA linear of the rollout as one GEMM on a merged copy of its weight (W +
    scale B A, summed in float32 once per rollout), as the vLLM backend pushes it, instead of the base GEMM
    plus the adapter's two GEMMs, scaling and add per layer. The copies take the adapted weights' bytes
    once more for the rollout (counted before the KV cache's share of the free memory); the trainer's
    parameters are not written. Its samples and log-probs are the unmerged ones up to rounding (bf16:
    W + scale B A rounds once: on a bf16 thinker the mean |rollout - trainer| log-prob rose from 0.024 to
    0.037), so keep it off where the rollout's log-probs are the old ones (algo.old_logprob rollout). No
    effect with a full fine-tune or distributed.rollout_gather unit."""
    cuda_graph: bool = True
    """On CUDA, capture the decode step once per rollout as a CUDA graph and replay it (the step's
    kernels launched at once instead of one by one from Python); off runs it eagerly. No effect on CPU."""
    compile_modules: list[str] = field(default_factory=list)
    """Parts of the decoder layers the native engine's decode step runs compiled (torch.compile, inductor):
    the modules whose class names end with one of these, e.g. [RMSNorm, TopKRouter] (the norms and the MoE
    router: element-wise work, ~7 kernels each per step, fused into one or two; the mmk12 recipe's) or
    SparseMoeBlock (the whole MoE block, measured slower: its fused combine kernel is). [] compiles none;
    generation.compile compiles whole layers instead. Compiled on the first rollout (and once more, sizes
    symbolic, at other shapes); measured in benchmarks/results/omni_native_decode_parts.md."""
    compile: bool = False
    """Run the decoder layers compiled (torch.compile, inductor) in the native engine's decode steps:
    fewer, fused kernels per step (the CUDA graph then replays those). Compiled on the first rollout, and
    once more with the slot and KV sizes symbolic at the first step of another KV window or slot count;
    the prefill and the trainer stay eager. rollout.backend vllm compiles its own. Off by default: on a
    MoE thinker the compiled decode step is 2x slower than the eager one replayed as a CUDA graph (inductor
    copies each layer's KV window expanded to every query head; benchmarks/RESULTS.md):
    generation.compile_modules compiles the parts that pay."""


@dataclass
class VLLMConfig:
    """rollout.backend vllm: the vLLM engine's own settings (omnirl.rollout.vllm_engine)."""

    sleep_level: int = 1
    """vLLM's sleep level during training (1: weights offloaded to host memory and the KV cache freed; 2:
    both discarded, every weight re-pushed at the next rollout). CUDA only: on CPU the calls run and are
    logged, and free nothing."""
    max_model_len: int = 0
    """The longest prompt + response vLLM admits (0 = the model's own limit)."""
    push_bucket_mib: int = 512
    """A weight push (merged MoE LoRA, full fine-tune) goes in buckets of this size."""
    request_seeds: bool = True
    """Every request samples from its own seed (run.seed and its index), so a rollout is reproducible
    request by request, as the native engine's is. vLLM then draws each seeded request's noise separately in
    every decode step (its batched sampler serves unseeded requests only); false samples all requests from
    vLLM's own generator, reproducible only for the same batch and schedule."""
    logprobs: bool = True
    """vLLM returns the log-prob of every sampled token, which algo.correction weighs against the trainer's
    and the consistency/* metrics compare. false: it returns none and skips the host work of turning them
    into lists at every step; the trainer's recomputed log-probs are then the only ones (needs
    algo.old_logprob recompute and algo.correction none, the defaults then), and no consistency/* metrics
    are logged."""

    RANGES: ClassVar[dict] = {  # checked when the recipe loads (omnirl.config_checks)
        "sleep_level": ((lambda v: v in (1, 2)), "1 or 2"),
        "max_model_len": ((lambda v: v >= 0), "an integer >= 0 (0 = the model's own limit)"),
        "push_bucket_mib": ((lambda v: v >= 1), "an integer >= 1"),
    }


@dataclass
class FP8Config:
    """rollout.precision fp8: which steps run FP8, how its GEMMs accumulate, and Sol-RL's selection
    (omnirl.rollout.fp8, docs/fp8_rollout.md)."""

    steps: Literal["untrained", "all"] = "untrained"
    """The denoising steps that run in FP8. 'untrained': only the steps no row of a packed batch trains
    (outside every row's SDE window); a step that trains some row runs in the policy's own precision, so
    the old log-probs of every trained transition are the trainer's and need neither a recompute nor a
    correction. 'all': every step; the trainer then recomputes the old log-probs (algo.old_logprob defaults
    to recompute) and weights each trained step by the ratio of its to the rollout's probability
    (algo.correction defaults to tis; omnirl.algos.correction)."""
    fast_accum: bool = True
    """The FP8 GEMMs accumulate in the tensor cores' own precision, without cuBLASLt's periodic promotion to
    float32 (its fast-accumulation mode, the default of torchao's float8 inference configs). false
    promotes: slower, closer to the bf16 rollout (docs/fp8_rollout.md)."""
    select: int = 0
    """0 trains on the FP8 samples themselves. K > 0 is Sol-RL's two stages: of each group, the K best and
    the K worst FP8 samples by reward are generated again in bf16 from the same seeds and scored again, and
    the update trains on those 2K samples alone (rollout.group_size must exceed 2K; no correction is
    needed, they come from the trained precision)."""

    RANGES: ClassVar[dict] = {"select": ((lambda v: v >= 0), "an integer >= 0")}


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8
    """Prompts per RL step over all ranks (each rank takes an equal share)."""
    group_size: int = 8
    """Samples per prompt (a GRPO group)."""
    max_num_seqs: int = 32
    """Most requests in one packed transformer forward (CFG rows not counted)."""
    max_num_batched_tokens: int = 0
    """Most transformer tokens in one packed forward: rows x the longest row's tokens (image + text), a
    request counting twice when its CFG rows share the forward (fused_cfg); 0 = no token budget."""
    fused_cfg: bool = True
    """Run CFG's conditional and unconditional rows in one forward (else two forwards of half the rows:
    less peak memory, more launches)."""
    memory_budget_gib: float = 0.0
    """Device memory, in GiB, the rollout may use beyond what is allocated when it starts; 0 = what the
    accelerator reports free (on CPU, where there is no device memory: the host's available memory for the
    KV cache, and no check of diffusion batches). A diffusion rollout measures the memory of two batch
    sizes (from the adapter's memory_probe_rows up, never past its largest batch) on its first batch of
    each kind and stops before any sample is generated when rollout.max_num_seqs rows would not fit (or a
    probe runs out of memory), naming the largest value that does."""
    backend: Literal["native", "vllm"] = "native"
    """Omni adapters: the rollout engine. 'native': omnirl's GenerationEngine on the actor's own module (no
    weight copy). 'vllm': vLLM in-process on every rank, its own weights pushed from memory after every
    update and verified; with it algo.old_logprob defaults to recompute and algo.correction to tis
    (omnirl.rollout.vllm_engine; docs/rollout_backends.md)."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks for rollout (training stays eager); batches are
    padded to a few bucket sizes (rollout.diffusion.bucket_size) so that a rollout compiles each shape once
    and never recompiles."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Diffusion adapters: the precision of the transformer blocks' linear layers in the rollout. 'fp8':
    float8 e4m3 with per-row weight and activation scales (omnirl.rollout.fp8; each family states which
    block layers stay in bf16), on NVIDIA GPUs of compute capability 8.9 or newer (the CPU emulates it);
    it pays with rollout.compile. Training stays in the model's precision (rollout.fp8.steps says which
    steps run FP8)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """rollout.backend vllm: the vLLM backend's own settings."""
    fp8: FP8Config = field(default_factory=FP8Config)
    """rollout.precision fp8: the FP8 rollout's own settings."""
