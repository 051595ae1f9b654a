"""The omni half of an RL step: text-output models (`OmniAdapter` adapters) with token-level losses.

`OmniOps` runs the rollout (the native `GenerationEngine` on the actor's own module, or the `VLLMEngine`
with rollout.backend vllm; one request per (prompt, sample), each response scored as it finishes) and the
update: a training row is one response (`TokenRow`), re-scored token by token on the exact prompt
tensors the rollout prepared, with a token loss of `omnirl.algos.losses` and, with a recomputed old
log-prob, the rollout correction of `omnirl.algos.correction`. Every update logs the actor-vs-rollout
consistency. Micro-batches hold at most optim.micro_batch_size responses and optim.micro_batch_tokens
padded tokens.

How it works: docs/mmk12.md#the-update-and-export
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import AutoConfig

from omnirl import distributed as D
from omnirl.algos.correction import consistency_metrics, correction_weights, position_gaps
from omnirl.algos.losses import TokenInputs, get_loss
from omnirl.batching import equalise, make_requests, shuffled_rows
from omnirl.config import Config
from omnirl.data.prompts import PromptRow
from omnirl.errors import ConfigError
from omnirl.metrics import MetricsLogger
from omnirl.models.base import GenerationParams, OmniAdapter, OmniTrajectory, Request
from omnirl.models.lm import pad_responses
from omnirl.rollout.generate import WINDOW_COLUMNS, native_engine


def generation_params(cfg: Config, tokenizer) -> GenerationParams:
    """The training rollout's sampling settings (cfg.generation), the stop strings as token ids."""
    g = cfg.generation
    stop = []
    for text in g.stop:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"generation.stop {text!r} is {len(ids)} tokens of the model's tokenizer; a stop string must "
                "be exactly one token (e.g. '<|im_end|>')"
            )
        stop.append(ids[0])
    return GenerationParams(
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        stop_token_ids=tuple(stop),
    )


@dataclass
class TokenRow:
    """One response of the update."""

    traj: OmniTrajectory
    weight: float  # 1 for real rows, 0 for the padding rows of short ranks
    old: torch.Tensor | None = None  # [T] behaviour log-probs recomputed by the trainer (recompute)
    is_weight: torch.Tensor | None = None  # [T] rollout-correction weights (recompute with tis / mis)
    position: float = 0.0  # its place in the step's shuffle of all ranks' rows (batching.global_positions)


def _padded(values: list[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    """Per-row [T_i] tensors -> [B, length] float32, right-padded with 0."""
    out = torch.zeros(len(values), length)
    for b, v in enumerate(values):
        out[b, : len(v)] = v
    return out.to(device)


def _old_logprobs(row: TokenRow) -> torch.Tensor:
    """A row's old log-probs: recomputed (old_logprob recompute) or the rollout's. Padding rows (weight 0)
    are not recomputed: the rollout's stand in, or zeros where it recorded none."""
    if row.old is not None:
        return row.old
    if row.traj.logprobs is not None:
        return row.traj.logprobs
    assert row.weight == 0, "a trained row without old log-probs: the recompute did not run"
    return torch.zeros(len(row.traj.response_ids))


def _context_from_config(path: str) -> int | None:
    """The language model's context (its text config's max_position_embeddings) from model.path's
    config.json alone, before any weights load; None where no config is at hand (a Hub name not in the
    local cache, a folder without one): the check then runs once the model is loaded."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a probe: the config's warnings are the model load's to print
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)
    config = getattr(config, "thinker_config", None) or config  # a whole Qwen3-Omni: its thinker's
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def _check_kv_windows(cfg: Config, context: int) -> None:
    """A slot's cache is at most the model's context and its windows are multiples of WINDOW_COLUMNS:
    more windows than that are refused (a billion of them looped in step 0)."""
    windows = -(-context // WINDOW_COLUMNS)
    if cfg.generation.kv_windows > windows:
        raise ConfigError(
            f"generation.kv_windows must be at most {windows} for model.path {cfg.model.path!r} (its "
            f"context of {context} tokens in windows of {WINDOW_COLUMNS} columns), got "
            f"{cfg.generation.kv_windows}"
        )


class OmniOps:
    """The omni half of an RL step (see the module docstring); `omnirl.trainer.train` runs it."""

    def __init__(self, cfg: Config, adapter: OmniAdapter):
        self.cfg, self.adapter = cfg, adapter
        self.policy: nn.Module = adapter.policy
        self.ref_model = None  # a LoRA's reference policy is the same model with the LoRA off
        self.loss_fn = get_loss(cfg.algo.loss, "omni")
        self.params = generation_params(cfg, adapter.tokenizer)
        if cfg.rollout.backend == "vllm":
            from omnirl.rollout.vllm_engine import vllm_engine

            self.engine = self.sleepable = vllm_engine(adapter, cfg)
        else:
            _check_kv_windows(cfg, adapter.context_tokens)  # check_config's, where it read no config
            self.engine = native_engine(adapter, cfg)
            self.sleepable = None  # the native engine runs on the actor's own module: nothing of its own
        self.correct = cfg.algo.old_logprob == "recompute" and cfg.algo.correction != "none"
        self._measured: dict[str, float] | None = None  # consistency of this update, once measured
        self._actor: list[torch.Tensor] = []  # bypass mode: the first mini-batch's token log-probs
        self._rollout: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []  # and each token's position in its response

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Settings this kind cannot run, found before the model loads (the loss's kind is checked with the
        loss: `omnirl.ops.check_before_loading`)."""
        a = cfg.algo
        if a.kl_beta > 0 and cfg.model.finetune == "full":
            raise ConfigError(
                "algo.kl_beta > 0 with model.finetune full: omni models take the KL to the same model with "
                "the LoRA off; a frozen reference copy for full fine-tuning is not implemented"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if cfg.distributed.rollout_gather == "unit" and world > 1:
            # Ranks decode different numbers of steps and prefill at different times (the vision and
            # audio towers only in a prefill): per-unit all-gathers would not match across ranks.
            raise ConfigError(
                f"distributed.rollout_gather unit with an omni model needs one rank, got {world}: use "
                "phase (the whole base on the device for the rollout, also with frozen_base offload)"
            )
        context = _context_from_config(cfg.model.path) if cfg.rollout.backend != "vllm" else None
        if context is not None:
            _check_kv_windows(cfg, context)
        sizes = (cfg.rollout.max_num_seqs - 1).bit_length() + 1  # all slots, halved down to one
        if cfg.generation.row_buckets > sizes:
            raise ConfigError(
                f"generation.row_buckets must be at most {sizes} (rollout.max_num_seqs "
                f"{cfg.rollout.max_num_seqs} slots, halved down to one), got {cfg.generation.row_buckets}"
            )
        if cfg.optim.micro_batch_tokens < 0:
            raise ConfigError(f"optim.micro_batch_tokens must be >= 0, got {cfg.optim.micro_batch_tokens}")
        if a.correction != "none" and a.old_logprob == "rollout":
            D.print0(
                f"warning: algo.correction {a.correction!r} is ignored with algo.old_logprob rollout (the "
                "bypass mode has no recomputed log-probs to correct)"
            )

    def offload_modules(self) -> list[nn.Module]:
        return []  # the encoders run in training too: the trainer re-scores responses on the images

    def prompt_problem(self, row: PromptRow) -> str | None:
        """Why the row's prompt cannot run: with generation.max_new_tokens it is longer than the model's
        context (vLLM refuses such a request as well), or None."""
        tokens, context = self.adapter.prompt_tokens(row), self.adapter.context_tokens
        new = self.cfg.generation.max_new_tokens
        if tokens + new <= context:
            return None
        return (
            f"the prompt ({len(row.prompt)} characters) is {tokens} tokens, which with generation."
            f"max_new_tokens {new} is more than the model's context of {context} tokens: shorten it or "
            "lower generation.max_new_tokens"
        )

    def requests(self, rows: list[PromptRow], step: int, dist: D.DistInfo) -> list[Request]:
        return make_requests(self.cfg, rows, step, dist, self.params)[0]

    def validation_params(self) -> GenerationParams:
        """generation.* at validation.temperature and validation.top_p."""
        v = self.cfg.validation
        return dataclasses.replace(self.params, temperature=v.temperature, top_p=v.top_p)

    def generate(self, requests: list[Request], on_done: Callable[[list], None]) -> list[OmniTrajectory]:
        return self.engine.generate(requests, on_finish=lambda t: on_done([t]))

    def update_rows(self, trajs: list[OmniTrajectory], keep: torch.Tensor, gen: torch.Generator):
        samples = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        return shuffled_rows(trajs, keep, gen, samples, 1, lambda t, _, at: TokenRow(t, 1.0, position=at))

    def count(self, rows: list[TokenRow]) -> float:
        """Real response tokens (token_mean) or responses (seq_mean, dr_grpo): losses.grpo_loss."""
        if self.cfg.algo.aggregation == "token_mean":
            return float(sum(len(r.traj.response_ids) for r in rows))
        return float(len(rows))

    def micro_batches(self, rows: list[TokenRow], pad_traj: OmniTrajectory) -> list[list[TokenRow]]:
        """Consecutive rows while they fit optim.micro_batch_size rows and optim.micro_batch_tokens padded
        tokens (rows x (longest prompt + longest response); a longer row runs alone), as many on every
        rank."""
        size, budget = self.cfg.optim.micro_batch_size, self.cfg.optim.micro_batch_tokens
        out: list[list[TokenRow]] = []
        current: list[TokenRow] = []
        for row in rows:
            grown = [*current, row]
            padded = len(grown) * (
                max(len(r.traj.prompt_ids) for r in grown) + max(len(r.traj.response_ids) for r in grown)
            )
            if current and (len(grown) > size or 0 < budget < padded):
                out.append(current)
                grown = [row]
            current = grown
        if current:
            out.append(current)
        return equalise(out, TokenRow(pad_traj, 0.0))

    def _inputs(self, mb: list[TokenRow]):
        """(collated prompts, sequences [B, T], response mask [B, T] bool, rollout log-probs [B, T]) on the
        device; responses right-padded to the longest."""
        device = self.engine.device
        trajs = [r.traj for r in mb]
        batch = {k: v.to(device) for k, v in self.adapter.collate([t.prompt_inputs() for t in trajs]).items()}
        seqs, mask = pad_responses([t.response_ids for t in trajs], self.adapter.pad_token_id)  # [B, T]
        recorded = [t.logprobs for t in trajs if t.logprobs is not None]
        rollout = None  # a rollout that recorded no log-probs (rollout.vllm.logprobs false)
        if len(recorded) == len(trajs):
            rollout = _padded(recorded, seqs.shape[1], device)  # [B, T]
        return batch, seqs.to(device), mask.to(device), rollout

    def recompute_old(self, rows: list[TokenRow], pad_traj: OmniTrajectory) -> dict[str, float]:
        """The behaviour policy's log-probs of every response, in the micro-batches of the update; the
        consistency with the rollout's, and (tis / mis) the correction weights, from the same numbers."""
        a = self.cfg.algo
        sums = dict.fromkeys(["correction/weight_sum", "correction/clip_count", "correction/count"], 0.0)
        actor, rollout_all, positions = [], [], []
        for mb in self.micro_batches(rows, pad_traj):
            batch, seqs, mask, rollout = self._inputs(mb)
            lp = self.adapter.token_logprobs(batch, seqs, mask, self.params.temperature)  # [B, T]
            real = [b for b, r in enumerate(mb) if r.weight > 0]
            for b in real:
                mb[b].old = lp[b, : len(mb[b].traj.response_ids)].cpu()
            if rollout is None:  # no rollout log-probs: nothing to compare or correct (config_checks)
                continue
            lp, rollout, mask = lp[real], rollout[real], mask[real]
            actor.append(lp[mask])
            rollout_all.append(rollout[mask])
            positions.append(_positions(mask))
            if self.correct:
                assert a.correction != "none"  # self.correct: there is a correction
                weights, m = correction_weights(
                    lp, rollout, mask, a.correction, a.correction_level, a.correction_threshold
                )
                for b, w in zip(real, weights):
                    mb[b].is_weight = w[: len(mb[b].traj.response_ids)].cpu()
                for k, v in m.items():
                    sums[k] += v
        self._measured = self._consistency(actor, rollout_all, positions) if actor else {}
        return sums if self.correct else {}

    def loss(self, mb: list[TokenRow], normaliser: float, measure: bool) -> tuple[torch.Tensor, dict]:
        a = self.cfg.algo
        batch, seqs, mask, rollout = self._inputs(mb)
        device, length = seqs.device, seqs.shape[1]
        logprob = self.adapter.token_logprobs(batch, seqs, mask, self.params.temperature)  # [B, T]
        old = _padded([_old_logprobs(r) for r in mb], length, device)
        adv = torch.tensor([r.traj.advantage for r in mb], device=device)
        w = torch.tensor([r.weight for r in mb], device=device)
        ref = None
        if a.kl_beta > 0:
            with torch.no_grad(), self.adapter.lora_disabled():
                ref = self.adapter.token_logprobs(batch, seqs, mask, self.params.temperature)
        is_weight = None
        if self.correct:
            empty = torch.zeros(length)
            is_weight = _padded([empty if r.is_weight is None else r.is_weight for r in mb], length, device)
        if measure and a.old_logprob == "rollout" and rollout is not None:
            real = w > 0
            self._actor.append(logprob.detach()[real][mask[real]])
            self._rollout.append(rollout[real][mask[real]])
            self._positions.append(_positions(mask[real]))
        max_length = self.cfg.generation.max_new_tokens
        inputs = TokenInputs(logprob, old, adv, mask, w, max_length, ref_logprob=ref, is_weight=is_weight)
        return self.loss_fn(inputs, a, normaliser)

    def _consistency(
        self, actor: list[torch.Tensor], rollout: list[torch.Tensor], positions: list[torch.Tensor]
    ) -> dict[str, float]:
        """Over all tokens (`consistency_metrics`) and per span of response positions (`position_gaps`)."""
        empty = torch.zeros(0, device=self.engine.device)
        actor_t, rollout_t = torch.cat([empty, *actor]), torch.cat([empty, *rollout])
        where = torch.cat([empty.long(), *positions])
        out = consistency_metrics(actor_t, rollout_t, torch.ones_like(actor_t, dtype=torch.bool))
        return {**out, **position_gaps(actor_t, rollout_t, where, self.cfg.generation.max_new_tokens)}

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def measured(self, optimizer_steps: int) -> dict[str, float]:
        if self._measured is None:  # bypass mode: what the first mini-batch collected (maybe nothing)
            self._measured = self._consistency(self._actor, self._rollout, self._positions)
        out = self._measured
        if self.sleepable is not None:  # vLLM: its start, push (time and what it bound) and generation
            out = {**out, **self.sleepable.stats}
        self._measured, self._actor, self._rollout, self._positions = None, [], [], []
        return out

    def log_samples(self, logger: MetricsLogger, step: int, trajs: list[OmniTrajectory]) -> None:
        texts = [f"request {t.request.index}, reward {t.reward:.4f}: {t.text}" for t in trajs[:8]]
        logger.log_texts(step, "samples", texts)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """[N] each real token's position in its response, in the order `x[mask]` lists them (mask [B, T])."""
    return torch.arange(mask.shape[1], device=mask.device).expand_as(mask)[mask]
