"""The records that flow through omnirl and the adapter Protocols.

A `Request` is one sample to generate. A `Trajectory` is what the rollout hands the trainer for it:
the latents entering and leaving each trained denoising step, the sigmas, the rollout log-prob of
each trained step, and the prompt embeddings, so that training never re-runs the text encoders.

An omni (autoregressive) rollout hands the trainer an `OmniTrajectory`: prompt and response token ids,
the per-token rollout log-probs and the multimodal inputs needed to recompute them.

Adapters are `typing.Protocol`s: an adapter is any class with these methods, and adapters share no
implementation (shared math lives in `flow_sde.py` and, for the omni models, `lm.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

import peft
import torch
from torch import nn
from transformers import PreTrainedModel

if TYPE_CHECKING:  # omnirl.data.prompts imports this module
    from omnirl.data.prompts import PromptRow
    from omnirl.models.flow_sde import Pool

# What a diffusion adapter's denoising loop runs before each step (`DiffusionAdapter.rollout`'s `on_step`),
# told whether the step trains any row of the batch.
StepHook = Callable[[bool], None]


@dataclass(frozen=True)
class SamplingParams:
    """Every setting that must be uniform inside one transformer forward (the compatibility key).

    Per-row state (seed, initial noise, SDE window position) is not here: it lives on the `Request`
    or is drawn from the request's own generator.
    """

    height: int
    width: int
    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_type: str  # "sde" | "cps" | "dance_sde" | "ode"
    sde_window_size: int  # trained steps per sample; 0 = every step
    sde_window_range: tuple[int, int]  # [lo, hi): the steps a row's trained ones lie in
    record_logprobs: bool = True  # False (validation): nothing is trained from it, so no window
    record_mean: bool = False  # also record each trained step's mean (losses that compare means: flow_dppo)
    ode_solver: str = (
        "euler"  # "euler" | "dpm2": the ODE step after a row's window (flow_sde.WindowedSampler)
    )
    # Which weights the forward runs, one per batch: "policy", "old" (DiffusionNFT's soft-updated old
    # policy) or "ema" (DGPO's EMA copy), swapped into the trained parameters by its ops for the whole
    # generate call
    lora: str = "policy"
    shared_initial_noise: bool = False  # a group's samples start from one draw (its group_seed)
    # Which steps each row trains and samples with the SDE: a name of flow_sde.PLANNERS
    sde_window_schedule: str = "contiguous"
    ode_compress_ratio: float = (
        0.0  # sliding_compressed (MixGRPO-Flash): the ODE after the window, compressed
    )
    # CFG's conditional and unconditional rows share one forward (rollout.fused_cfg), or run as two
    fused_cfg: bool = True
    # False: the outputs hold the final latents only, no VAE decode (every reward of the recipe reads
    # latents); what is shown (sample logging) is decoded apart
    decode: bool = True

    @property
    def key(self) -> tuple:
        """The compatibility key: requests with equal keys may share a forward. Every field is in it."""
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class GenerationParams:
    """Sampling settings of one autoregressive (omni) request. The generation engine applies every field
    per row, so requests with different settings share a batch.

    The recorded log-prob of a token is always log_softmax(logits / temperature) over the whole output
    vocabulary (`omnirl.models.lm.output_logprobs`): top-p and top-k only shape which token is drawn.
    top_k 1 is greedy decoding.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: keep the most probable tokens whose mass reaches top_p (1 = off)
    top_k: int = 0  # keep the k most probable tokens (0 = off, 1 = greedy)
    stop_token_ids: tuple[int, ...] = ()  # stop on these as well as on the model's EOS tokens


# A request's parameters: SamplingParams (diffusion) or GenerationParams (omni, autoregressive).
P = TypeVar("P", SamplingParams, GenerationParams)


@dataclass
class Request(Generic[P]):
    """One sample to generate. Its noise depends only on `seed` (and, for initial noise shared by a group,
    on `group_seed`), never on which batch it lands in. `Request[SamplingParams]` is a diffusion model's,
    `Request[GenerationParams]` an omni model's."""

    prompt: str
    group_id: int  # the prompt this sample belongs to (advantages are computed within a group)
    index: int  # global request index of the step; the seed derives from it
    seed: int  # derive_seed(base_seed, step, index)
    params: P
    negative_prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # the data row (e.g. the OCR target text)
    inputs: dict[str, Any] = field(default_factory=dict)  # multimodal inputs, e.g. {"image": PIL.Image}
    group_seed: int = 0  # derive_seed of the group alone: its shared initial noise (never the batch's)


MODALITIES = ("image", "video", "audio", "text", "latent")


@dataclass
class Latent:
    """A diffusion sample before its decode, and what it was denoised with: what a latent reward reads
    (docs/extending.md, "How to add a reward") instead of pixels. Host tensors without a batch dimension,
    shared with the sample's `Trajectory` (no copy)."""

    latents: torch.Tensor  # [*latent_shape] the final (clean) latents, in the transformer's latent space
    embeds: dict[str, torch.Tensor]  # the conditioning the transformer was called with (Trajectory.embeds)
    seed: int  # the request's seed: a latent reward's own noise derives from it, never from the batch


@dataclass
class Output:
    """What one sample produced, with its modality: an image, a video (with its fps), an audio track (with
    its sample rate), several of them (a video and its own audio track), the text of an omni model, and,
    for a family whose rewards may read latents, its final latents with their conditioning (`latent`).
    Host tensors without a batch dimension."""

    image: torch.Tensor | None = None  # [3, H, W] float32 in [0, 1]
    video: torch.Tensor | None = None  # [F, 3, H, W] float32 in [0, 1]
    fps: float = 0.0
    audio: torch.Tensor | None = None  # [C, T] float32 in [-1, 1]
    sample_rate: int = 0
    text: str | None = None
    latent: Latent | None = None

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(m for m in MODALITIES if getattr(self, m) is not None)


@dataclass
class Trajectory:
    """A finished diffusion rollout of one request, on the host.

    K is the number of trained (SDE) steps; shapes are per sample, without a batch dimension.
    """

    request: Request[SamplingParams]
    latents: torch.Tensor  # [K, *latent_shape] latents entering each trained step
    next_latents: torch.Tensor  # [K, *latent_shape] latents leaving each trained step
    step_indices: torch.Tensor  # [K] int64, position of each trained step in the schedule
    logprobs: torch.Tensor  # [K] float32, rollout log-prob of each trained step (0 where not recorded)
    sigmas: torch.Tensor  # [num_steps + 1] float32, the full sigma schedule (last = 0)
    embeds: dict[str, torch.Tensor]  # prompt (and negative) embeddings the transformer was called with
    output: Output  # the decoded sample (an image [3, H, W] for the image families)
    final_latents: torch.Tensor  # [*latent_shape]
    means: torch.Tensor | None = None  # [K, *latent_shape] each trained step's mean (params.record_mean)
    # [K, S] each stream's log-prob of each trained step, for a latent that joins S streams (the adapter's
    # `logprob_pool`: LTX-2's video and audio); `logprobs` is their weighted sum
    stream_logprobs: torch.Tensor | None = None
    reward: float = float("nan")
    advantage: float = 0.0


@dataclass
class OmniTrajectory:
    """A finished autoregressive rollout of one request, on the host (shapes without a batch dimension).

    `prompt_ids` + `mm_inputs` are exactly what the adapter's `prepare` made of the request, so the trainer
    re-scores the response on the same inputs (`OmniAdapter.token_logprobs`) without the processor.
    """

    request: Request[GenerationParams]
    prompt_ids: torch.Tensor  # [P] int64, chat template applied, placeholders expanded
    response_ids: torch.Tensor  # [T] int64, the stop token included when generation stopped on one
    logprobs: torch.Tensor | None  # [T] float32, the policy's log-prob of each token (models/lm.py
    # output_logprobs); None where the rollout recorded none (rollout.vllm.logprobs false)
    mm_inputs: dict[str, torch.Tensor]  # e.g. pixel_values [N, D], image_grid_thw [I, 3],
    # input_features [A, M, F], feature_attention_mask [A, F]
    finish_reason: str  # "stop" (a stop / EOS token) | "length" (max_new_tokens)
    text: str  # the decoded response, special tokens skipped
    reward: float = float("nan")
    advantage: float = 0.0

    @property
    def output(self) -> Output:
        return Output(text=self.text)

    def prompt_inputs(self) -> dict[str, torch.Tensor]:
        """The prompt as `prepare` returned it: the input of `OmniAdapter.collate`."""
        return {"input_ids": self.prompt_ids, **self.mm_inputs}


class OmniAdapter(Protocol):
    """What the generation engine and the trainer need from an autoregressive omni-modal family.

    An adapter is built as `Adapter(cfg, device)`: it loads the model and processor named by `cfg.model`,
    keeps only the stage `cfg.model.stage` trains (modules it does not use are never built or are deleted
    before any sharding), injects the LoRA of `cfg.lora` into the language model's decoder layers, and
    handles the family's config quirks. Rollout and trainer score tokens through the same `model` and
    `lm_head` through one definition (`omnirl.models.lm.output_logprobs`), so their log-probs agree.
    """

    kind: ClassVar[Literal["omni"]]  # the trainer runs it with omnirl.ops.omni.OmniOps
    modalities: ClassVar[frozenset[str]]  # what its outputs hold ({"text"})
    # The dataclass of the family's own settings (the recipe's `family:`), whose class attribute RANGES
    # (field -> (predicate, what is allowed)) config_checks checks when the recipe loads.
    Settings: ClassVar[type]
    device: torch.device  # where the model runs (the rank's accelerator, or the host)
    model: nn.Module  # the trained module and FSDP root: forward(**batch, position_ids, ...) -> [B, L, H]
    lm_head: nn.Module  # the output projection, a child of `model`, applied by callers where they need it
    # The transformers model whose body and head `model` wraps: its config, generation, peft state and
    # the names of its weights (what the vLLM engine loads and pushes).
    hf_model: PreTrainedModel
    lora_config: peft.LoraConfig | None  # the injected LoRA's settings; None for a full fine-tune
    processor: Any  # the transformers processor: chat template, image / audio features, placeholders
    tokenizer: Any
    eos_token_ids: tuple[int, ...]  # generation stops on these (the checkpoint's generation_config)
    placeholder_token_ids: tuple[int, ...]  # image / video / audio pads: never emitted (see models/lm.py)
    pad_token_id: int

    @property
    def policy(self) -> nn.Module:
        """The same module as `model`: what the trainer shards, checkpoints and optimizes."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """Modules to wrap with `fully_shard` before the root: decoder layers, encoders, `lm_head`."""
        ...

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (the LoRA, or the whole trained stage)."""
        ...

    def prepare(self, request: Request[GenerationParams]) -> dict[str, torch.Tensor]:
        """The request's prompt as host tensors without a batch dimension: input_ids [P] (chat template with
        the image / audio placeholders expanded by the processor) and the multimodal tensors. A function
        of the request's prompt and inputs only (`prepare_once` shares it among a group's samples)."""
        ...

    def collate(self, inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Batch `prepare` outputs for `model`: input_ids and attention_mask [B, P] left-padded, the
        multimodal tensors concatenated in row order."""
        ...

    def rope_positions(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """M-RoPE positions [3, B, L] of a collated batch (padding ignored), the model's get_rope_index."""
        ...

    def token_logprobs(
        self,
        model_inputs: dict[str, torch.Tensor],
        sequences: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        """[B, T] float32 log-probs of response tokens `sequences` [B, T] (right-padded, `response_mask`
        [B, T]) after the collated prompts `model_inputs`; 0 where the mask is 0. Differentiable."""
        ...

    @property
    def context_tokens(self) -> int:
        """The longest prompt + response the language model is made for."""
        ...

    def prompt_tokens(self, row: PromptRow) -> int:
        """Tokens of a data row's prompt as `prepare` makes them (checked against `context_tokens` before
        step 0), counted without running the processor on its image."""
        ...

    def kv_layout(self) -> tuple[int, int, int, torch.dtype]:
        """(decoder layers, KV heads, head dim, dtype) of the decoder's KV cache, for the engine's slots."""
        ...

    def decoder_layers(self) -> list[nn.Module]:
        """The language model's decoder layers, in order: what generation.compile compiles."""
        ...

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes over all decoder layers (for the engine's memory budget)."""
        ...

    def lora_disabled(self) -> AbstractContextManager[None]:
        """A context in which `model` runs with its LoRA layers off: the reference policy of a LoRA run
        (the KL term), with no second copy of the weights."""
        ...

    def export_lora(self, out_dir: str, state_dict: dict | None = None) -> None:
        """Write the LoRA as a peft adapter (adapter_config.json + adapter_model.safetensors). An FSDP run
        passes the gathered full state dict of `model`."""
        ...

    def export_merged(self, out_dir: str, dtype: torch.dtype) -> None:
        """Write the trained model in `dtype` as a transformers directory (the LoRA merged in) with its
        processor, loadable as model.path."""
        ...


class DecodesLatents(Protocol):
    """A diffusion adapter whose outputs carry their latents ("latent" in its `modalities`): its rollout
    skips the decode when `SamplingParams.decode` is False (every reward reads latents), and what is shown
    is decoded apart."""

    def decode(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Images [3, H, W] in [0, 1] on the host of final latents [B, *latent_shape] (host or device)."""
        ...


class DiffusionAdapter(Protocol):
    """What the rollout engine and the trainer need from a diffusion model family.

    An adapter is built as `Adapter(cfg, device)` and reads its own settings from `cfg.family` (an instance
    of its `Settings`). Nothing outside `omnirl/models/` names its transformer(s): the trainer, the engine,
    checkpoints and export go through `policy` and the methods below. A family of several experts (one
    transformer per noise range) makes `policy` one module holding them (`policy[name]`) and routes each
    row of a batch to the expert that owns its sigma inside `velocity`, so one micro-batch may hold rows of
    several experts; the trajectory's sigmas (`sigmas[step_indices]`) decide the expert again when the
    trainer replays a step.
    """

    kind: ClassVar[Literal["diffusion"]]  # the trainer runs it with omnirl.ops.diffusion.DiffusionOps
    modalities: ClassVar[frozenset[str]]  # what its outputs hold, e.g. {"image"}
    # The dataclass of the family's own settings (the recipe's `family:`), whose class attribute RANGES
    # (field -> (predicate, what is allowed)) config_checks checks when the recipe loads.
    Settings: ClassVar[type]
    # Sampling height and width must be multiples of this many pixels (the VAE's factor times the
    # transformer's patch): config_checks checks the recipe's before the model loads.
    pixel_multiple: ClassVar[int]
    device: torch.device  # where the model runs (the rank's accelerator, or the host)
    # The rows from which a rollout's peak memory grows linearly: the largest chunk of any phase it runs in
    # fixed chunks (a VAE decode of N videos at a time: N), else 1. The engine measures a batch's cost at
    # this many rows and twice as many, since a chunked phase's peak stops growing once a chunk is full.
    memory_probe_rows: int
    # The linear layers of a block (`fsdp_units`), by their names within it, that an FP8 rollout keeps in
    # bf16 (rollout.precision fp8: omnirl.rollout.fp8): the AdaLN modulation.
    fp8_keep_bf16: ClassVar[tuple[str, ...]]

    @property
    def policy(self) -> nn.Module:
        """The trained module (LoRA injected or fully trainable): one transformer, or one module holding
        the experts."""
        ...

    def prompt_problem(self, row: PromptRow) -> str | None:
        """Why a data row's prompt cannot run (longer than the family runs without truncating), or None;
        checked for every row before step 0."""
        ...

    def compat_key(self, request: Request[SamplingParams]) -> tuple:
        """Everything that must be uniform inside one forward: `request.params.key` plus what the
        family adds (a prompt-length bucket, a condition-image size)."""
        ...

    def num_tokens(self, request: Request[SamplingParams]) -> int:
        """Transformer tokens of one request per forward row (image + text), for max_num_batched_tokens."""
        ...

    def batch_embeds(
        self, embeds: list[dict[str, torch.Tensor]], bucketed: bool = False
    ) -> dict[str, torch.Tensor]:
        """Collate per-sample `Trajectory.embeds` into a batch for `velocity` (padding where lengths vary).
        `bucketed` (a compiled update): where lengths vary, pad to the family's length buckets, so that a
        compiled update meets few shapes."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """The repeated blocks to wrap with `fully_shard` (the root is wrapped after them)."""
        ...

    def logprob_pool(self, params: SamplingParams) -> Pool | None:
        """How a step's log-prob pools a latent that joins several streams (`flow_sde.Pool`: LTX-2's video
        and audio tokens), the same in the rollout and the trainer; None: the mean over all latent dims."""
        ...

    def rollout(
        self, requests: list[Request[SamplingParams]], on_step: StepHook | None = None
    ) -> list[Trajectory]:
        """Generate every request, as one packed denoising loop; all must share `params.key`. `on_step`,
        when given, runs before each denoising step told whether the step trains any row of the batch
        (`flow_sde.WindowedSampler`: pass it to the sampler and step through `sampler.steps()`); the engine
        sets a step's precision with it (rollout.fp8.steps untrained)."""
        ...

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: dict[str, torch.Tensor],
        guidance_scale: float,
        fused_cfg: bool = True,
        policy: nn.Module | None = None,
    ) -> torch.Tensor:
        """The guided velocity for a batch: latents [B, *latent], sigmas [B], embeds batched on dim 0.
        `policy` replaces the trained one (the frozen reference copy of a full fine-tune)."""
        ...

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (the LoRA, or the whole transformer)."""
        ...

    def lora_disabled(self) -> AbstractContextManager[None]:
        """A context in which `policy` runs with its LoRA off: the reference policy of a LoRA run."""
        ...

    def export_lora(self, out_dir: str, state_dict: dict | None = None) -> None:
        """Write the LoRA in the family's diffusers format (`load_lora_weights` reads it). An FSDP run
        passes the gathered full state dict of `policy`."""
        ...

    def export_merged(self, out_dir: str, dtype: torch.dtype) -> None:
        """Write the whole pipeline of model.path in `dtype` with every trained component's weights in it
        (the LoRA fused in, or the fully fine-tuned modules): every expert of a family of several."""
        ...

    @classmethod
    def lora_files(cls, model_path: str) -> dict[str, str]:
        """Component -> the file `export_lora` writes its LoRA to, for the checkpoint at `model_path` (one
        per expert of a family of several): what an export of a run's LoRA directory must find there."""
        ...

    @classmethod
    def merge_lora(cls, model_path: str, lora_dir: Path, out_dir: str | Path, dtype: torch.dtype) -> None:
        """Write the whole pipeline of `model_path` in `dtype` with the LoRA directory's files (`lora_files`)
        fused into their components: the merged export of a run's LoRA directory."""
        ...

    def offload_modules(self) -> list[nn.Module]:
        """Modules only the rollout needs (text encoders, VAE): they sleep during training."""
        ...


def prepare_once(adapter: OmniAdapter, requests: list[Request]) -> list[dict[str, torch.Tensor]]:
    """`adapter.prepare` of every request, run once per prompt: the samples of a group share their prompt
    text and inputs dict (`batching.make_requests`), so they share its result (host tensors that nothing
    writes to), and the processor's image / audio work runs once per group instead of once per sample."""
    done: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    out = []
    for r in requests:
        key = (r.prompt, id(r.inputs))  # every request is alive here: no two inputs dicts share an id
        if key not in done:
            done[key] = adapter.prepare(r)
        out.append(done[key])
    return out
