"""The causal-LM pieces the omni adapters (`qwen3_omni_thinker`, `qwen_vl`) and the generation engine share.

- `HiddenStatesLM`: the trained module of an omni adapter and its FSDP root; its forward returns the
  final hidden states, never logits (callers apply `lm_head` in chunks).
- `output_logprobs`: the one definition of the policy's distribution that rollout and trainer share,
  log_softmax(logits / temperature) with the multimodal placeholder ids masked out.
- `chunked_token_logprobs` / `sequence_logprobs`: the trainer's log-probs of given response tokens.
- `collate_prompts`, `pad_responses`, `checkpoint_decoder_layers`, `TransformersLMAdapter`: batches,
  activation checkpointing and the members every omni adapter implements the same way.

Our own code: transformers offers no log-prob of given tokens; TRL / verl do this inside their trainers.
How it works: docs/rollout.md#native-generation-for-omni-models
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import peft
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from omnirl.data.prompts import PromptRow
from omnirl.fsdp import DTYPES, load_pretrained, place_policy
from omnirl.models.peft_lora import lora_disabled, sorted_sets

if TYPE_CHECKING:
    from omnirl.config import Config

# Tokens per lm_head chunk: 1024 x 152k vocab x 4 bytes = 0.6 GB of float32 logits at a time.
LOGPROB_CHUNK = 1024


class HiddenStatesLM(nn.Module):
    """`body` (the transformers base model: encoders + decoder, no head) and `lm_head` as one module.

    It is the FSDP root, so every forward enters through the root (FSDP2 requires that), and `lm_head` is a
    child (its own FSDP unit), so the chunked projection outside `forward` still finds its weights.
    """

    def __init__(self, body: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.body = body
        self.lm_head = lm_head

    def forward(self, **inputs) -> torch.Tensor:
        """`inputs` are the body's keyword arguments (input_ids, attention_mask, position_ids, cache,
        use_cache, pixel_values, ...); returns the final (normed) hidden states [B, L, H]."""
        return self.body(**inputs).last_hidden_state


def kv_layout(layers: list[nn.Module]) -> tuple[int, int, int, torch.dtype]:
    """(decoder layers, KV heads, head dim, dtype) of a transformers decoder's KV cache, read off its live
    layers: under FSDP2 mixed precision the dtype is that of the gathered (compute) weights, so call it
    inside `fsdp.gathered_weights` when the cache is allocated."""
    attn: Any = layers[0].self_attn  # the transformers attention module, read by name
    k_proj = attn.k_proj  # a peft LoRA layer or a plain Linear: out_features = kv heads x head_dim
    return len(layers), k_proj.out_features // attn.head_dim, attn.head_dim, k_proj.weight.dtype


def collate_prompts(inputs: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Batch per-request prompts (`OmniAdapter.prepare` outputs).

    input_ids / attention_mask become [B, P], left-padded so that every row's last prompt token is in the
    last column (where generation continues). Every other tensor is concatenated on dim 0 in row order, the
    way the models match features to placeholder tokens (pixel_values [N, D] patches, image_grid_thw [I, 3],
    input_features [A, M, F]); tensors whose last dim differs between rows (audio frames) are zero-padded on
    it first, which their masks (feature_attention_mask [A, F]) then exclude.
    """
    length = max(len(x["input_ids"]) for x in inputs)
    input_ids = torch.full((len(inputs), length), pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(inputs), length), dtype=torch.long)  # [B, P]
    for b, x in enumerate(inputs):
        n = len(x["input_ids"])
        input_ids[b, length - n :] = x["input_ids"]
        attention_mask[b, length - n :] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    for key in sorted({k for x in inputs for k in x} - {"input_ids"}):
        parts = [x[key] for x in inputs if key in x]
        width = max(p.shape[-1] for p in parts)
        batch[key] = torch.cat([F.pad(p, (0, width - p.shape[-1])) for p in parts])
    return batch


def pad_responses(
    responses: Sequence[torch.Tensor | list[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response token ids of varying lengths as `token_logprobs` takes them: (sequences [B, T] long,
    right-padded with `pad_token_id`; response mask [B, T] bool), T the longest."""
    length = max(len(r) for r in responses)
    sequences = torch.full((len(responses), length), pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(responses), length, dtype=torch.bool)  # [B, T]
    for b, r in enumerate(responses):
        sequences[b, : len(r)] = torch.as_tensor(r)
        mask[b, : len(r)] = True
    return sequences, mask


def output_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    temperature: torch.Tensor | float,
    placeholder_ids: torch.Tensor,
) -> torch.Tensor:
    """The policy's log-probs [N, V] float32 for hidden states [N, H]: log_softmax(lm_head(hidden) /
    temperature) with the multimodal placeholder ids ([K] long, on the device: indexing with a host list
    would copy it over every step) at -inf. `temperature` is a float or [N, 1]."""
    logits = lm_head(hidden).float() / temperature  # [N, V]
    return logits.index_fill(1, placeholder_ids, float("-inf")).log_softmax(-1)


def _chunk_logprobs(lm_head, hidden, tokens, temperature, placeholder_ids):
    logprobs = output_logprobs(lm_head, hidden, temperature, placeholder_ids)  # [C, V]
    return logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [C]


def chunked_token_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    placeholder_ids: torch.Tensor,
    chunk_size: int = LOGPROB_CHUNK,
) -> torch.Tensor:
    """`output_logprobs` at `tokens`: hidden [N, H], tokens [N] -> [N] float32.

    The projection runs `chunk_size` tokens at a time. With gradients each chunk is checkpointed, so the
    backward pass keeps only the hidden states and recomputes one chunk's logits at a time.
    """
    out = []
    for i in range(0, len(tokens), chunk_size):
        args = (lm_head, hidden[i : i + chunk_size], tokens[i : i + chunk_size], temperature, placeholder_ids)
        if torch.is_grad_enabled():
            out.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(*args))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def sequence_logprobs(
    adapter,
    model_inputs: dict[str, torch.Tensor],
    sequences: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The trainer side of `OmniAdapter.token_logprobs`: one forward over prompt + response.

    model_inputs: collated prompts (input_ids / attention_mask [B, P] left-padded, multimodal tensors);
    sequences: response tokens [B, T], right-padded; response_mask [B, T]. Returns [B, T] float32, 0 where
    the mask is 0. Positions are the rollout's: the model's M-RoPE positions of the prompt, then one more
    per response token (the response is text: get_rope_index must not read its tokens).
    """
    prompt_len, length = model_inputs["input_ids"].shape[1], sequences.shape[1]
    response_mask = response_mask.to(model_inputs["attention_mask"].dtype)
    prompt_positions = adapter.rope_positions(model_inputs)  # [3, B, P]
    steps = torch.arange(length, device=sequences.device).to(prompt_positions.dtype)
    response_positions = prompt_positions.amax(dim=(0, 2))[:, None] + 1 + steps  # [B, T]
    batch = {
        **model_inputs,
        "input_ids": torch.cat([model_inputs["input_ids"], sequences], dim=1),  # [B, P + T]
        "attention_mask": torch.cat([model_inputs["attention_mask"], response_mask], dim=1),  # [B, P + T]
        "position_ids": torch.cat([prompt_positions, response_positions.expand(3, -1, -1)], dim=2),
    }
    hidden = adapter.model(**batch, use_cache=False)  # [B, P + T, H]
    # The hidden state at position i predicts token i + 1: response token j is scored at P - 1 + j.
    hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + length]  # [B, T, H]
    keep = response_mask.bool()
    out = torch.zeros(sequences.shape, dtype=torch.float32, device=hidden.device)  # [B, T]
    placeholders = torch.tensor(adapter.placeholder_token_ids, device=hidden.device)
    out[keep] = chunked_token_logprobs(
        adapter.lm_head, hidden[keep], sequences[keep], temperature, placeholders
    )
    return out


def checkpoint_decoder_layers(hf_model: Any, layers: nn.ModuleList) -> None:
    """Recompute each decoder layer's activations in the backward pass (model.gradient_checkpointing).

    transformers checkpoints a layer only while `layer.training` is set, so the layers' own flag is set
    and nothing else: the model stays in eval mode (no dropout anywhere), so the rollout and the trainer
    compute the same function. Without gradients (rollout, recompute) a layer runs as usual."""
    with warnings.catch_warnings():
        # Later transformers 5 releases rename it activation_checkpointing_enable and warn at every load;
        # setup.py's range starts before the rename, so the old name, which still works, stays.
        warnings.filterwarnings("ignore", "`gradient_checkpointing_enable` is deprecated", FutureWarning)
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.training = True


def make_trainable_lm(model: nn.Module, cfg, path: str) -> peft.LoraConfig | None:
    """A transformers multimodal LM made trainable per `cfg` (shared by the omni adapters): a LoRA on the
    language model's decoder layers (base frozen, adapter in float32 even over a bf16 base, since the
    optimizer updates it) or every weight; then gradient checkpointing of the decoder layers. Returns the
    LoRA config (what the peft export writes), or None for a full fine-tune."""
    lora_config = None
    if cfg.model.finetune == "lora":
        model.requires_grad_(False)
        # peft's in-place injection: the model keeps its class (transformers' own add_adapter would do the
        # same but demands a newer peft than the one pinned here).
        lora_config = peft.LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,
            target_modules=decoder_lora_targets(model, cfg.lora.target_modules),
            init_lora_weights=True if cfg.lora.init == "default" else "gaussian",
            lora_dropout=cfg.lora.dropout,
            base_model_name_or_path=path,
        )
        # A copy: peft rewrites target_modules in place (it condenses long lists into suffixes); the
        # exported adapter_config.json keeps the exact module names.
        peft.inject_adapter_in_model(copy.deepcopy(lora_config), model)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        model.requires_grad_(True)
    if cfg.model.gradient_checkpointing is True:  # auto decides at the first update (omnirl.autotune)
        body: Any = model.model  # the transformers base model, read by name
        checkpoint_decoder_layers(model, body.language_model.layers)
    return lora_config


def decoder_lora_targets(model: nn.Module, names: list[str]) -> list[str]:
    """The full names of the modules in the language model's decoder layers whose names end with one of
    `names`. Full names, not a regex: peft (0.21) turns a regex target of a transformers-v5 MoE model into
    bare suffixes (q_proj, ...) and would then also adapt the audio / vision encoders' projections."""
    suffixes = "|".join(re.escape(n) for n in names)
    regex = rf"model\.language_model\.layers\.\d+\.(?:.*\.)?(?:{suffixes})"
    targets = [n for n, _ in model.named_modules() if re.fullmatch(regex, n)]
    if not targets:
        raise ValueError(
            f"lora.target_modules {names} match no module of the language model's decoder layers "
            "(Qwen attention: q_proj, k_proj, v_proj, o_proj)"
        )
    return targets


def save_merged_lm(hf_model: Any, processor, out_dir, dtype: torch.dtype) -> None:
    """A transformers directory (config, safetensors weights, processor) of `hf_model` with its LoRA merged
    into the base weights and the LoRA layers removed (a full fine-tune has none: saved as it is). Changes
    `hf_model` in place: export is the last thing done with it."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(hf_model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(hf_model.get_submodule(parent), child, module.get_base_layer())
    hf_model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)


class TransformersLMAdapter:
    """The `OmniAdapter` methods that the transformers-based adapters (Qwen3-Omni thinker, Qwen VL) share.
    A subclass's `__init__` checks the checkpoint (`checkpoint_config`), reads its processor
    (`read_processor`), sets `placeholder_token_ids` and loads the model (`load_model`: `hf_model`, the
    transformers model whose `model` is the body and `lm_head` the head; `model`, their `HiddenStatesLM`;
    `lora`, `lora_config`)."""

    # What a subclass's __init__ sets (the `OmniAdapter` members and the LoRA switch).
    device: torch.device
    hf_model: Any  # a transformers model: its parts and config are read by name
    model: nn.Module
    lm_head: nn.Module
    processor: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    placeholder_token_ids: tuple[int, ...]
    pad_token_id: int
    lora: bool
    lora_config: peft.LoraConfig | None
    modalities = frozenset({"text"})

    @staticmethod
    def checkpoint_config(path: str) -> Any:
        """The transformers config of the checkpoint at `path`; a ValueError naming it when there is none."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path {path!r} is not a loadable transformers checkpoint: {e}") from None

    def read_processor(self, path: str, processor_cls: Any) -> None:
        """`processor` (`processor_cls` from the checkpoint's files, as AutoProcessor reads them), its
        `tokenizer`, the EOS ids (generation_config.json's, else the tokenizer's end-of-turn token) and the
        pad id."""
        from transformers import GenerationConfig

        self.processor = processor_cls.from_pretrained(path)
        self.tokenizer = tokenizer = self.processor.tokenizer
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's end-of-turn token
            eos = tokenizer.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        self.pad_token_id = tokenizer.pad_token_id

    def load_model(self, cfg: Config, device: torch.device, model_cls: type, **kwargs) -> Any:
        """The transformers model `model_cls` from model.path (`load_pretrained` with `kwargs`), made
        trainable (`make_trainable_lm`), as `hf_model`; its body and head as `model`, placed for the frozen
        base. A fully fine-tuned model is trained, hence kept, in float32; a LoRA base stays in
        model.dtype."""
        path = cfg.model.path
        self.lora = cfg.model.finetune == "lora"
        dtype = DTYPES[cfg.model.dtype] if self.lora else torch.float32
        hf_model = load_pretrained(model_cls, path, dtype=dtype, **kwargs)
        self.lora_config = make_trainable_lm(hf_model, cfg, path)
        self.hf_model = hf_model  # the transformers model: config, generation, peft state
        # Onto the device, or left on the host for FSDP2 to place when it shards the frozen base.
        lm = HiddenStatesLM(hf_model.model, hf_model.lm_head)
        self.model = place_policy(lm, cfg.distributed.frozen_base, device)
        self.lm_head = lm.lm_head  # (`self.model` is `lm`)
        self.device = device
        return hf_model

    @property
    def policy(self) -> nn.Module:
        """The trained module: `model` (the body and `lm_head`), the FSDP root."""
        return self.model

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def collate(self, inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_prompts(inputs, self.pad_token_id)

    def token_logprobs(
        self,
        model_inputs: dict[str, torch.Tensor],
        sequences: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        return sequence_logprobs(self, model_inputs, sequences, response_mask, temperature)

    def prompt_tokens(self, row: PromptRow) -> int:
        """The tokens of the row's prompt as `prepare` makes them (the chat template, the image's vision
        tokens), counted without processing the image: its placeholder token is expanded into as many
        tokens as the image processor makes of an image of its size."""
        image = row.inputs.get("image")
        content = [{"type": "image"}] if image is not None else []
        content.append({"type": "text", "text": row.prompt})
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        tokens = len(self.tokenizer(text).input_ids)
        if image is None:
            return tokens
        processor = self.processor.image_processor
        patches = processor.get_number_of_image_patches(image.height, image.width, {})
        return tokens - 1 + patches // processor.merge_size**2

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt and response) the language model is made for."""
        return self.hf_model.config.get_text_config().max_position_embeddings

    def kv_layout(self) -> tuple[int, int, int, torch.dtype]:
        return kv_layout(self.decoder_layers())

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.hf_model.model.language_model.layers)

    def kv_bytes_per_token(self) -> int:
        layers, heads, dim, dtype = self.kv_layout()
        return 2 * layers * heads * dim * dtype.itemsize

    def lora_disabled(self):
        if not self.lora:
            raise ValueError("the reference policy with the LoRA off needs model.finetune 'lora'")
        return lora_disabled(self.model)

    def export_merged(self, out_dir: str | Path, dtype: torch.dtype) -> None:
        """The trained model as a transformers directory (LoRA merged in), loadable as `model.path`."""
        save_merged_lm(self.hf_model, self.processor, out_dir, dtype)

    def export_lora(self, out_dir: str | Path, state_dict: dict | None = None) -> None:
        """Write the LoRA as a peft adapter: `PeftModel.from_pretrained(hf_model, out_dir)` loads it onto the
        model's transformers class. An FSDP run passes the gathered full state dict of `self.model`."""
        if not self.lora:
            raise ValueError("export_lora needs model.finetune 'lora'")
        if state_dict is not None:  # names under HiddenStatesLM -> the model's own names
            state_dict = {re.sub(r"^body\.", "model.", k): v for k, v in state_dict.items()}
        layers = peft.get_peft_model_state_dict(self.hf_model, state_dict=state_dict)
        assert self.lora_config is not None  # made with the LoRA (model.finetune 'lora')
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        sorted_sets(self.lora_config).save_pretrained(str(out_dir))
        tensors = {f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in layers.items()}
        save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
