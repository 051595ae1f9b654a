"""GenerationEngine: native continuous-batching generation for omni adapters, on the actor's own module.

The engine calls the very module the optimizer updates (`adapter.model`, no weight copy); under FSDP2 its
weights are gathered once for the whole phase (`distributed.gathered_weights`). Requests are admitted in
order while there is a free row (`max_num_seqs`) and the KV cache stays within its memory budget. An
admitted group is prefilled as one batch (images and audio through the model's own encoders) and merged
into the running batch; every decode step then runs one forward for all running rows; rows that finish
leave, and waiting requests take their place.

Layout of the running batch: rows share the KV cache's columns and are left-padded (right-aligned): every
row's latest token sits in the same column, and an attention mask marks each row's real columns. Each row
keeps its own M-RoPE position (the model's get_rope_index on the prompt, then +1 per token), so a row's
computation does not depend on its neighbours apart from floating-point rounding of batched kernels.

Sampling: one torch.Generator per request, seeded from the request's seed, draws all of the request's
uniforms at admission; a token is drawn by inverting the CDF of the (top-k / top-p filtered) distribution
at the row's next uniform, so a request's sample does not depend on which batch it runs in. The recorded
log-prob is the trainer's, log_softmax(logits / temperature) over the output vocabulary
(`omnirl.models.lm.output_logprobs`); top-k / top-p only shape the draw.

Why not transformers' continuous batching (`generate_batch`, `ContinuousBatchingManager`, paged cache):
it takes token ids only (no pixel_values / input_features, so no image or audio prompt), gives every token
1-D positions (no M-RoPE), samples with one global RNG (a request's sample depends on its batch) and
records log-probs of the temperature/top-p-processed distribution; `benchmarks/generate_throughput.py`
measures it as a baseline on text prompts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from omnirl.distributed import gathered_weights
from omnirl.models.base import GenerationParams, OmniModelBase, OmniTrajectory, Request
from omnirl.models.lm import output_logprobs

# Decode steps between two looks at which rows finished. Each look is a device->host sync that stalls the
# launch queue; a row that finished meanwhile computes a few throw-away tokens, which are never recorded.
SYNC_EVERY = 8


class _KVLayer(DynamicLayer):
    """One decoder layer's KV cache for the running rows: `keys` / `values` are preallocated [R, H, C, D]
    buffers whose columns [lo, hi) hold the tokens so far; a step writes its column in place (no torch.cat
    of the whole cache per token, as DynamicLayer does)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lo: int, hi: int):
        super().__init__()
        self.keys, self.values, self.lo, self.hi = keys, values, lo, hi
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        self.keys[:, :, self.hi : self.hi + n] = key_states
        self.values[:, :, self.hi : self.hi + n] = value_states
        self.hi += n
        return self.keys[:, :, self.lo : self.hi], self.values[:, :, self.lo : self.hi]

    def get_seq_length(self) -> int:
        return self.hi - self.lo

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.hi - self.lo + query_length, 0


@dataclass
class _Running:
    """The running rows (R of them) on the device; column c of `attn` is column c of every cache layer."""

    ids: list[int]  # request index of each row
    cache: Cache  # of _KVLayer
    attn: torch.Tensor  # [R, C] long, 1 where a row has a real token
    last: torch.Tensor  # [R] long, the token to feed next
    pos: torch.Tensor  # [R], the M-RoPE position of that token (the model's dtype for positions)
    n_gen: torch.Tensor  # [R] long, tokens recorded so far
    done: torch.Tensor  # [R] bool
    max_new: torch.Tensor  # [R] long
    temperature: torch.Tensor  # [R] float32
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] long
    stops: torch.Tensor  # [R, S] long, stop / EOS ids, padded with -1
    noise: torch.Tensor  # [R, W] float32, the request's uniforms, one per token
    tokens: torch.Tensor  # [R, W + 1] long; column n_gen is scratch for finished rows
    logprobs: torch.Tensor  # [R, W + 1] float32
    filtered: bool  # some row uses top-k / top-p (known on the host: no device sync per step)

    @property
    def lo(self) -> int:
        return self.cache.layers[0].lo

    @property
    def hi(self) -> int:
        return self.cache.layers[0].hi

    def select(self, keep: torch.Tensor) -> _Running:
        """The rows `keep` [R'] only, with the leading columns no kept row uses dropped."""
        attn = self.attn[keep]
        lead = int(attn[:, self.lo : self.hi].any(0).long().argmax())  # first column some row uses
        layers = [
            _KVLayer(layer.keys[keep], layer.values[keep], layer.lo + lead, layer.hi)
            for layer in self.cache.layers
        ]
        rows = {
            name: getattr(self, name)[keep]
            for name in self.__dataclass_fields__
            if name not in ("ids", "cache", "attn", "filtered")
        }
        ids = [self.ids[i] for i in keep.tolist()]
        return _Running(ids=ids, cache=Cache(layers=layers), attn=attn, filtered=self.filtered, **rows)


class GenerationEngine:
    def __init__(self, adapter: OmniModelBase, max_num_seqs: int, kv_cache_gib: float):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        self.adapter = adapter
        self.max_num_seqs = max_num_seqs
        self.kv_budget = kv_cache_gib * 2**30  # bytes
        self.device = adapter.lm_head.weight.device
        self.placeholders = torch.tensor(adapter.placeholder_token_ids, device=self.device)  # [K]

    @torch.no_grad()
    def generate(
        self, requests: list[Request], on_finish: Callable[[OmniTrajectory], None] | None = None
    ) -> list[OmniTrajectory]:
        """Trajectories in the order of `requests`; `on_finish` gets each one as soon as it is done (in
        finishing order), so reward scoring can overlap the rest of the generation."""
        for r in requests:
            _check_params(r)
        prepared = [self.adapter.prepare(r) for r in requests]  # host tensors
        results: list[OmniTrajectory | None] = [None] * len(requests)
        waiting = deque(range(len(requests)))
        run: _Running | None = None
        with gathered_weights(self.adapter.model):
            while waiting or run is not None:
                admitted = self._admit(waiting, run, requests, prepared)
                if admitted:
                    run = self._merge(run, self._prefill(admitted, requests, prepared))
                for _ in range(SYNC_EVERY):
                    self._decode(run)
                finished = run.done.nonzero().flatten()
                if len(finished):
                    for i, traj in self._collect(run, finished, requests, prepared):
                        results[i] = traj
                        if on_finish is not None:
                            on_finish(traj)
                    keep = (~run.done).nonzero().flatten()
                    run = run.select(keep) if len(keep) else None
        assert all(t is not None for t in results)
        return results

    def _admit(self, waiting: deque, run: _Running | None, requests, prepared) -> list[int]:
        """Take waiting requests (in order) while rows are free and the KV cache fits the budget.

        The budget counts what the left-padded layout allocates: rows x (longest cached sequence + most
        tokens any row may still add), at `kv_bytes_per_token` each. Once rows are running, admission
        waits until a quarter of the rows are free (or the queue fits), so prefills come in batches and the
        cache is re-laid out less often.
        """
        running = len(run.ids) if run is not None else 0
        free = self.max_num_seqs - running
        if not waiting or free == 0:
            return []
        if running and free < max(1, self.max_num_seqs // 4) and len(waiting) > free:
            return []
        length = run.hi - run.lo if run is not None else 0
        remaining = int((run.max_new - run.n_gen).max()) if run is not None else 0
        per_token = self.adapter.kv_bytes_per_token()
        admitted = []
        while waiting and len(admitted) < free:
            i = waiting[0]
            new_length = max(length, len(prepared[i]["input_ids"]))
            new_remaining = max(remaining, requests[i].params.max_new_tokens)
            rows = running + len(admitted) + 1
            if rows * (new_length + new_remaining + SYNC_EVERY) * per_token > self.kv_budget:
                if rows == 1:
                    raise ValueError(
                        f"request {requests[i].index}: {new_length} prompt tokens + max_new_tokens "
                        f"{new_remaining} need more KV cache than kv_cache_gib allows"
                    )
                break
            admitted.append(waiting.popleft())
            length, remaining = new_length, new_remaining
        return admitted

    def _prefill(self, admitted: list[int], requests, prepared) -> _Running:
        """One forward over the admitted prompts (encoders included), and each row's first token."""
        batch = self.adapter.collate([prepared[i] for i in admitted])
        batch = {k: v.to(self.device) for k, v in batch.items()}
        positions = self.adapter.rope_positions(batch)  # [3, k, P]
        cache = DynamicCache()
        hidden = self.adapter.model(**batch, position_ids=positions, cache=cache, use_cache=True)  # [k, P, H]
        length = batch["input_ids"].shape[1]
        layers = [_KVLayer(layer.keys, layer.values, 0, length) for layer in cache.layers]
        params = [requests[i].params for i in admitted]
        width = max(p.max_new_tokens for p in params)
        stops = [self.adapter.eos_token_ids + tuple(p.stop_token_ids) for p in params]
        noise = torch.zeros(len(admitted), width)  # [k, W]
        for row, i in enumerate(admitted):
            gen = torch.Generator().manual_seed(requests[i].seed)
            noise[row, : params[row].max_new_tokens] = torch.rand(params[row].max_new_tokens, generator=gen)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        new = _Running(
            ids=list(admitted),
            cache=Cache(layers=layers),
            attn=batch["attention_mask"],
            last=torch.zeros(len(admitted), dtype=torch.long, device=self.device),
            pos=positions.amax(dim=(0, 2)) + 1,  # [k]: the next position after each prompt
            n_gen=torch.zeros(len(admitted), dtype=torch.long, device=self.device),
            done=torch.zeros(len(admitted), dtype=torch.bool, device=self.device),
            max_new=tensor([p.max_new_tokens for p in params], torch.long),
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_p=tensor([p.top_p for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.long),
            stops=tensor([s + (-1,) * (max(map(len, stops)) - len(s)) for s in stops], torch.long),
            noise=noise.to(self.device),
            tokens=torch.zeros(len(admitted), width + 1, dtype=torch.long, device=self.device),
            logprobs=torch.zeros(len(admitted), width + 1, device=self.device),
            filtered=any(p.top_k > 0 or p.top_p < 1 for p in params),
        )
        self._record(new, hidden[:, -1])
        return new

    def _merge(self, run: _Running | None, new: _Running) -> _Running:
        """Lay the running rows and the newly prefilled ones out in fresh buffers, right-aligned on the
        latest column, with room for every row's remaining tokens (so no step ever reallocates)."""
        parts = [p for p in (run, new) if p is not None]
        length = max(p.hi - p.lo for p in parts)
        remaining = max(int((p.max_new - p.n_gen).max()) for p in parts)
        capacity = length + remaining + SYNC_EVERY
        rows = sum(len(p.ids) for p in parts)
        layers = []
        for j, layer in enumerate(new.cache.layers):
            _, heads, _, dim = layer.keys.shape
            keys = layer.keys.new_zeros(rows, heads, capacity, dim)  # [R, H, C, D]
            values = layer.values.new_zeros(rows, heads, capacity, dim)
            row = 0
            for p in parts:
                src = p.cache.layers[j]
                n, span = len(p.ids), src.hi - src.lo
                keys[row : row + n, :, length - span : length] = src.keys[:, :, src.lo : src.hi]
                values[row : row + n, :, length - span : length] = src.values[:, :, src.lo : src.hi]
                row += n
            layers.append(_KVLayer(keys, values, 0, length))
        attn = new.attn.new_zeros(rows, capacity)  # [R, C]
        row = 0
        for p in parts:
            span = p.hi - p.lo
            attn[row : row + len(p.ids), length - span : length] = p.attn[:, p.lo : p.hi]
            row += len(p.ids)

        def cat(name: str, pad: int = 0) -> torch.Tensor:
            tensors = [getattr(p, name) for p in parts]
            width = max(t.shape[-1] for t in tensors)  # per-row tables ([R, W] etc.) are padded on the right
            tensors = [F.pad(t, (0, width - t.shape[-1]), value=pad) if t.dim() == 2 else t for t in tensors]
            return torch.cat(tensors)

        return _Running(
            ids=[i for p in parts for i in p.ids],
            cache=Cache(layers=layers),
            attn=attn,
            stops=cat("stops", pad=-1),
            filtered=any(p.filtered for p in parts),
            **{
                name: cat(name)
                for name in _Running.__dataclass_fields__
                if name not in ("ids", "cache", "attn", "stops", "filtered")
            },
        )

    def _decode(self, run: _Running) -> None:
        """One forward of every running row on its latest token, then sample and record."""
        run.attn[:, run.hi] = 1
        positions = run.pos.view(1, -1, 1).expand(3, -1, 1)  # [3, R, 1]
        hidden = self.adapter.model(
            input_ids=run.last[:, None],
            attention_mask=run.attn[:, run.lo : run.hi + 1],
            position_ids=positions,
            cache=run.cache,
            use_cache=True,
        )  # [R, 1, H]
        run.pos += 1
        self._record(run, hidden[:, -1])

    def _record(self, run: _Running, hidden: torch.Tensor) -> None:
        """Sample each row's next token after its last hidden state [R, H], record the token and its
        log-prob, update `done`."""
        logprobs = output_logprobs(
            self.adapter.lm_head, hidden, run.temperature[:, None], self.placeholders
        )  # [R, V]
        step = run.n_gen[:, None]  # [R, 1]; finished rows write to their scratch column
        uniforms = run.noise.gather(1, step.clamp(max=run.noise.shape[1] - 1)).squeeze(1)  # [R]
        token = sample(logprobs, run.top_p, run.top_k, uniforms, run.filtered)
        logprob = logprobs.gather(1, token[:, None]).squeeze(1)
        run.tokens.scatter_(1, step, token[:, None])
        run.logprobs.scatter_(1, step, logprob[:, None])
        active = ~run.done
        run.n_gen += active.long()
        stopped = (token[:, None] == run.stops).any(1)
        run.done |= active & (stopped | (run.n_gen >= run.max_new))
        run.last = token

    def _collect(
        self, run: _Running, finished: torch.Tensor, requests, prepared
    ) -> list[tuple[int, OmniTrajectory]]:
        """(request index, trajectory) of the finished rows `finished`, on the host."""
        lengths = run.n_gen[finished].tolist()
        tokens, logprobs = run.tokens[finished].cpu(), run.logprobs[finished].cpu()
        out = []
        for row, n, toks, lps in zip(finished.tolist(), lengths, tokens, logprobs):
            i = run.ids[row]
            request, response = requests[i], toks[:n].clone()
            stops = set(self.adapter.eos_token_ids) | set(request.params.stop_token_ids)
            traj = OmniTrajectory(
                request=request,
                prompt_ids=prepared[i]["input_ids"],
                response_ids=response,
                logprobs=lps[:n].clone(),
                mm_inputs={k: v for k, v in prepared[i].items() if k != "input_ids"},
                finish_reason="stop" if int(response[-1]) in stops else "length",
                text=self.adapter.tokenizer.decode(response, skip_special_tokens=True),
            )
            out.append((i, traj))
        return out


def sample(
    logp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """Draw one token per row by inverting the CDF at the row's uniform: logp [R, V] the policy's
    log-probs (temperature applied), per-row settings [R], uniforms [R] in [0, 1) -> tokens [R].
    top-k (0 = off) keeps the k most probable tokens, then top-p keeps the most probable ones whose
    renormalised mass reaches top_p; top_k 1 is the argmax (the lowest index on ties, as torch.argmax).
    `filtered` False says no row filters, which skips the sort over the vocabulary."""
    if filtered:
        sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)  # [R, V]
        probs = sorted_logp.exp()
        rank = torch.arange(probs.shape[1], device=probs.device)
        probs = probs.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
        # Drop a token once the mass before it reaches top_p: the first token always stays.
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], 0.0)
    else:
        probs, order = logp.exp(), None
    cdf = probs.cumsum(-1)  # [R, V]
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    index = index.clamp(max=probs.shape[1] - 1)  # [R, 1]
    return (order.gather(1, index) if order is not None else index).squeeze(1)


def _check_params(request: Request) -> None:
    p = request.params
    if not isinstance(p, GenerationParams):
        raise ValueError(f"request {request.index}: params must be GenerationParams, got {type(p).__name__}")
    if p.max_new_tokens < 1 or p.temperature <= 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
        raise ValueError(
            f"request {request.index}: need max_new_tokens >= 1, temperature > 0, top_p in (0, 1] and "
            f"top_k >= 0 (1 = greedy), got {p}"
        )
