"""The vLLM methods of benchmarks.generate_throughput: omnirl's vLLM rollout backend as a rollout runs it, and
the same vLLM engine driven as a plain vLLM user drives it, alone or with one of the backend's settings."""

from __future__ import annotations

import torch

from omnirl.models.base import Request


def run_vllm(
    adapter, cfg, requests, keep: list, stats: dict, engines: list, seeds: bool = True, logprobs: bool = True
) -> int:
    """The vLLM backend, created on first use (the warm-up's call, which then also holds its start) with the
    same KV budget and max_num_seqs as ours; each generate pushes the trainer's weights first (their time is
    `vllm/push_s` in the stats, inside the call's time). `seeds` False: the same engine with
    rollout.vllm.request_seeds off (vLLM's batched sampler, no per-request seed); `logprobs` False: with
    rollout.vllm.logprobs off (no log-prob asked for)."""
    cfg.rollout.vllm.request_seeds = seeds
    cfg.rollout.vllm.logprobs = logprobs
    from omnirl.rollout.vllm_engine import vllm_engine

    if not engines:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # our engine's KV cache, freed: vLLM starts from what is free
        engines.append(vllm_engine(adapter, cfg))
    trajs = engines[0].generate(requests)
    keep[:] = trajs
    stats.clear()
    stats.update(engines[0].stats)
    return sum(len(t.response_ids) for t in trajs)


# Plain vLLM, and plain vLLM with one of the backend's settings added (what each costs, in the same run).
PLAIN = {
    "vllm_plain": (),
    "vllm_plain_bias": ("bias",),  # the placeholder ids banned by a -inf logit bias
    "vllm_plain_logprobs": ("logprobs",),  # the sampled token's processed log-prob, one dict per token
    "vllm_plain_flat": ("logprobs", "flat"),  # the same log-probs as vLLM's flat lists
    "vllm_plain_seeds": ("seeds",),  # a seed per request
}


def plain_params(request: Request, eos: tuple[int, ...], banned: tuple[int, ...], extras: tuple[str, ...]):
    """vLLM SamplingParams for a request as a plain vLLM user writes them (temperature, length, stop ids, no
    detokenizing), plus the backend's settings named in `extras`."""
    from vllm import SamplingParams

    p = request.params
    kwargs: dict = {}
    if "bias" in extras:
        kwargs["logit_bias"] = {int(i): float("-inf") for i in banned}
    if "logprobs" in extras:
        kwargs["logprobs"] = 0
    if "flat" in extras:
        kwargs["flat_logprobs"] = True
    if "seeds" in extras:
        kwargs["seed"] = request.seed
    return SamplingParams(
        n=1,
        temperature=p.temperature,
        max_tokens=p.max_new_tokens,
        stop_token_ids=[*eos, *p.stop_token_ids],
        detokenize=False,
        **kwargs,
    )


def run_vllm_plain(adapter, cfg, requests, prompts: dict, engines: list, extras: tuple[str, ...]) -> int:
    """The backend's vLLM engine (created as run_vllm does where none is yet) driven directly: token prompts
    made before the clock, no push, no cache reset, nothing read back but the token counts."""
    if not engines:
        run_vllm(adapter, cfg, requests[:1], [], {}, engines)
    eos, banned = tuple(adapter.eos_token_ids), tuple(adapter.placeholder_token_ids)
    params = [plain_params(r, eos, banned, extras) for r in requests]
    outputs = engines[0].llm.generate([prompts[r.index] for r in requests], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def cap_vllm(engines: list, max_num_seqs: int) -> None:
    """At most `max_num_seqs` requests running in the vLLM engine built for the largest load: its scheduler's
    own limit (in-process engine core), so every load runs on the same engine, kernels and CUDA graphs."""
    if not engines:
        return
    scheduler = engines[0].llm.llm_engine.engine_core.engine_core.scheduler
    # 0.26 admits up to max_num_running_reqs; 0.32 up to max_num_active_reqs (and checks the other).
    for limit in ("max_num_running_reqs", "max_num_active_reqs"):
        if limit in vars(scheduler):
            setattr(scheduler, limit, max_num_seqs)
