"""GenerationEngine: native continuous-batching generation for omni adapters, on the actor's own module.

The engine calls the very module the optimizer updates (`adapter.model`, no weight copy), its weights
gathered once per phase (or one unit per forward with `per_unit`). A call allocates S KV-cache slots once
(`max_num_seqs`, fewer if the KV budget holds fewer rows); waiting requests are prefilled in groups, each
distinct prompt once, and every decode step runs one forward of all S slots on their latest tokens; a
finished slot is freed and a waiting request takes it. A decode step keeps its shapes from first to last,
so on CUDA it is captured as a CUDA graph (`cuda_graph`), per KV window width (`kv_windows`) and slot
count (`row_buckets`, `omnirl.rollout.slots`). Each request draws its uniforms from its own generator and
a token inverts the filtered distribution's CDF, so a sample does not depend on its batch; the recorded
log-prob is the trainer's (`omnirl.models.lm.output_logprobs`).

How each part works, and why not transformers' own continuous batching:
docs/rollout.md#native-generation-for-omni-models.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from omnirl.fsdp import fsdp_hooks_quiet, gathered_weights
from omnirl.memory import GIB, free_bytes
from omnirl.models.base import GenerationParams, OmniAdapter, OmniTrajectory, Request, prepare_once
from omnirl.models.lm import output_logprobs
from omnirl.models.peft_lora import lora_merged
from omnirl.rollout.compiled import compile_forwards, modules_named, swapped
from omnirl.rollout.experts import narrowed_expert_forwards
from omnirl.rollout.slots import SlotLayer, Slots

if TYPE_CHECKING:
    from omnirl.config import Config

# Decode steps between two looks at which rows finished. Each look is a device->host sync that stalls the
# launch queue; a row that finished meanwhile computes a few throw-away tokens, which are never recorded.
SYNC_EVERY = 8
# Tokens per block of the two-level CDF inversion (`invert_cdf`): ~sqrt of a 152k vocabulary, rounded up.
CDF_BLOCK = 1024
# KV windows (`GenerationEngine._windows`) are multiples of this many columns, the attention kernels' tiles.
WINDOW_COLUMNS = 64


def native_engine(adapter: OmniAdapter, cfg: Config) -> GenerationEngine:
    """The run's native engine: its section (`generation`) and the few settings of other sections it needs
    (the requests per batch and the memory budget of `rollout`, the weight gathering of `distributed`)."""
    g, r = cfg.generation, cfg.rollout
    return GenerationEngine(
        adapter,
        r.max_num_seqs,
        g.kv_cache_gib,
        g.cuda_graph,
        kv_fraction=g.kv_cache_fraction,
        memory_budget=r.memory_budget_gib * 2**30,
        per_unit=cfg.distributed.rollout_gather == "unit",
        compile=g.compile,
        max_prefill_tokens=g.max_prefill_tokens,
        kv_windows=g.kv_windows,
        row_buckets=g.row_buckets,
        merge_lora=g.merge_lora,
        compile_modules=tuple(g.compile_modules),
    )


class GenerationEngine:
    """`cuda_graph`: on a CUDA device, capture the decode step (forward, sampling, bookkeeping of all
    slots) once per `generate` call and replay it; the step's eager version runs elsewhere and is what
    the graph records, so the two give the same tokens. `compile`: the decoder layers (`adapter.
    decoder_layers()`) compiled for the decode step, in the first call's warm-up (and again, shapes
    symbolic, in the first call of other shapes); `compile_modules`: only their modules whose class names
    end with one of these. `merge_lora`: each call runs the LoRA linears on merged copies of their weights
    (`omnirl.models.peft_lora.lora_merged`). `row_buckets`: a step computes only as many slots as the
    busy ones need, of that many sizes (`_row_sizes`). `stats` describes the last call (slots, decode steps,
    prefills, their forward rows and the largest prefill group's padded tokens, capture seconds, compile
    included, rows computed per step and slots moved)."""

    def __init__(
        self,
        adapter: OmniAdapter,
        max_num_seqs: int,
        kv_cache_gib: float | None,
        cuda_graph: bool = True,
        kv_fraction: float = 0.5,
        memory_budget: float = 0.0,
        per_unit: bool = False,
        compile: bool = False,
        max_prefill_tokens: int = 16384,
        kv_windows: int = 4,
        merge_lora: bool = False,
        compile_modules: tuple[str, ...] = (),
        narrow_expert_ids: bool = False,
        row_buckets: int = 1,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if kv_windows < 1:
            raise ValueError(f"kv_windows must be >= 1, got {kv_windows}")
        if row_buckets < 1:
            raise ValueError(f"row_buckets must be >= 1, got {row_buckets}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if kv_cache_gib is not None and kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0 or None, got {kv_cache_gib}")
        self.adapter = adapter
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.kv_windows, self.row_buckets = kv_windows, row_buckets
        self.kv_cache_gib, self.kv_fraction, self.memory_budget = kv_cache_gib, kv_fraction, memory_budget
        self.kv_budget = 0.0  # bytes, set by each call
        self.device = adapter.device
        self.per_unit = per_unit
        self.merge_lora = merge_lora and not per_unit  # (per unit, the weights are not on the device)
        self.cuda_graph = cuda_graph and self.device.type == "cuda" and not per_unit
        self.placeholders = torch.tensor(adapter.placeholder_token_ids, device=self.device)  # [K]
        if compile:
            self.compiled = compile_forwards(adapter.decoder_layers(), dynamic=None)
        elif compile_modules:
            self.compiled = compile_forwards(modules_named(adapter.decoder_layers(), compile_modules), None)
        else:
            self.compiled = []
        # (experts module, its forward on uint8 ids) for the decode step, a compiled module's left as it is
        compiled = {id(m) for m, _ in self.compiled}
        self.narrowed = (
            [(m, f) for m, f in narrowed_expert_forwards(adapter.decoder_layers()) if id(m) not in compiled]
            if narrow_expert_ids
            else []
        )

    @torch.no_grad()
    def generate(
        self, requests: list[Request], on_finish: Callable[[OmniTrajectory], None] | None = None
    ) -> list[OmniTrajectory]:
        """Trajectories in the order of `requests`; `on_finish` gets each one as soon as it is done (in
        finishing order), so reward scoring can overlap the rest of the generation."""
        if not requests:
            return []
        for r in requests:
            _check_params(r)
        prepared = prepare_once(self.adapter, requests)  # host tensors
        results: list[OmniTrajectory | None] = [None] * len(requests)
        waiting = deque(range(len(requests)))
        # Whether rows draw through the sorted (top-k / top-p) path: one choice for the whole call, so a
        # request's sample does not depend on which other requests share its steps.
        self._filtered = any(r.params.top_k > 0 or r.params.top_p < 1 for r in requests)
        stats: dict[str, Any] = {
            "decode_steps": 0,
            "prefills": 0,
            "prefill_rows": 0,
            "prefill_tokens_max": 0,
            "capture_s": 0.0,
        }
        self.stats = stats
        merged = lora_merged(self.adapter.model) if self.merge_lora else contextlib.nullcontext(0)
        with gathered_weights(self.adapter.model, per_unit=self.per_unit), merged as merged_bytes:
            stats["lora_merged_gib"] = merged_bytes / GIB
            if self.kv_cache_gib is not None:
                self.kv_budget = self.kv_cache_gib * GIB
            else:
                self.kv_budget = self.kv_fraction * (self.memory_budget or free_bytes(self.device))
            stats["kv_budget_gib"] = self.kv_budget / GIB
            slots = self._allocate(requests, prepared)
            stats["slots"] = len(slots.done)
            owner: list[int | None] = [None] * slots.done.shape[0]  # request index per slot
            # Per slot, a bound on its cached tokens known without a device sync: its prompt plus the
            # decode steps since it was admitted (a finished row stops growing; the bound does not).
            bound = [0] * len(owner)
            first: Any = slots.cache.layers[0]  # a SlotLayer
            windows = self._windows(first.keys.shape[2])
            stats["kv_windows"], columns = windows, 0
            sizes = self._row_sizes(len(owner))
            views = {n: slots.prefix(n) if n < len(owner) else slots for n in sizes}
            stats["row_sizes"], stats["rows_moved"], computed = sizes, 0, 0
            start = time.perf_counter()
            # Warm-up steps while every slot is free, before any prefill, on the CPU too: the same order
            # as a CUDA graph's warm-up and capture (so CPU tests run what the GPU runs, FSDP2 included).
            step = self._capture(views, windows) if self.cuda_graph else self._warm_up(views, windows)
            stats["capture_s"] = time.perf_counter() - start
            while waiting or any(o is not None for o in owner):
                free = [s for s, o in enumerate(owner) if o is None]
                busy = len(owner) - len(free)
                # Prefills come in groups: once rows run, wait for a quarter of the slots (or the queue).
                # Then every free slot is filled, in as many groups as max_prefill_tokens needs.
                if (
                    waiting
                    and free
                    and (not busy or len(free) >= max(1, len(owner) // 4) or len(waiting) <= len(free))
                ):
                    while waiting and free:
                        admitted = self._admit(waiting, len(free), prepared)
                        self._prefill(slots, free[: len(admitted)], admitted, requests, prepared)
                        stats["prefills"] += 1
                        for s, i in zip(free, admitted):
                            owner[s], bound[s] = i, len(prepared[i]["input_ids"])
                        free = free[len(admitted) :]
                # The next SYNC_EVERY steps write columns up to bound + SYNC_EVERY - 1 and attend to
                # those: the narrowest window that holds them for every busy slot.
                need = max(b for b, o in zip(bound, owner) if o is not None) + SYNC_EVERY
                window = next((w for w in windows if w >= need), windows[-1])
                rows = self._pack_rows(slots, owner, bound, sizes)
                for _ in range(SYNC_EVERY):
                    step(window, rows)
                stats["decode_steps"] += SYNC_EVERY
                columns += SYNC_EVERY * window
                computed += SYNC_EVERY * rows
                bound = [b + SYNC_EVERY for b in bound]
                done = slots.done.tolist()
                finished = [s for s, o in enumerate(owner) if o is not None and done[s]]
                for i, traj in self._collect(slots, finished, owner, requests, prepared):
                    results[i] = traj
                    if on_finish is not None:
                        on_finish(traj)
                for s in finished:
                    owner[s] = None
            del step  # the graphs and their memory pool
            stats["kv_columns_mean"] = columns / max(1, stats["decode_steps"])
            stats["rows_mean"] = computed / max(1, stats["decode_steps"])
        done = [t for t in results if t is not None]
        assert len(done) == len(results)
        return done

    def _allocate(self, requests, prepared) -> Slots:
        """Slots for the call: max_num_seqs of them, fewer if the KV cache of that many rows of the
        longest request (prompt + max_new_tokens) would exceed the budget."""
        capacity = max(len(x["input_ids"]) + r.params.max_new_tokens for r, x in zip(requests, prepared))
        per_slot = capacity * self.adapter.kv_bytes_per_token()
        n = min(self.max_num_seqs, len(requests), int(self.kv_budget // per_slot))
        if n < 1:
            longest = max(
                range(len(requests)),
                key=lambda i: len(prepared[i]["input_ids"]) + requests[i].params.max_new_tokens,
            )
            raise ValueError(
                f"request {requests[longest].index}: {len(prepared[longest]['input_ids'])} prompt tokens + "
                f"max_new_tokens {requests[longest].params.max_new_tokens} need {per_slot / 2**30:.3f} GiB "
                f"of KV cache, more than its budget of {self.kv_budget / GIB:.3g} GiB allows "
                "(generation.kv_cache_gib, or generation.kv_cache_fraction of the free memory)"
            )
        width = max(r.params.max_new_tokens for r in requests)
        n_stops = max(len(self.adapter.eos_token_ids) + len(r.params.stop_token_ids) for r in requests)
        layers, column = [], torch.zeros(n, 1, 1, 1, dtype=torch.long, device=self.device)
        num_layers, heads, dim, dtype = self.adapter.kv_layout()
        for _ in range(num_layers):
            # zeros, not empty: a masked column still enters the attention as 0 x value, and NaN x 0 is NaN
            keys = torch.zeros(n, heads, capacity, dim, dtype=dtype, device=self.device)
            layers.append(SlotLayer(keys, torch.zeros_like(keys), column))

        def full(value, dtype, *shape):
            return torch.full((n, *shape), value, dtype=dtype, device=self.device)

        return Slots(
            cache=Cache(layers=layers),
            column=column,
            length=full(0, torch.long),
            last=full(0, torch.long),
            pos=full(0, torch.long),
            n_gen=full(0, torch.long),
            done=full(True, torch.bool),
            max_new=full(1, torch.long),
            temperature=full(1.0, torch.float32),
            top_p=full(1.0, torch.float32),
            top_k=full(0, torch.long),
            stops=full(-1, torch.long, n_stops),
            noise=full(0.0, torch.float32, width),
            tokens=full(0, torch.long, width + 1),
            logprobs=full(0.0, torch.float32, width + 1),
        )

    def _admit(self, waiting: deque, free: int, prepared: list[dict]) -> list[int]:
        """The next prefill group: waiting requests in order, at most `free` of them and as many as keep the
        group's padded tokens (its distinct prompts x the longest, `_prefill` running each prompt once)
        within max_prefill_tokens (one at least). A prefill's memory (its own KV before the copy into the
        slots, the MoE and attention work space) grows with these tokens and is not part of the KV budget,
        so this bounds it."""
        admitted = [waiting.popleft()]
        prompts = {id(prepared[admitted[0]])}
        longest = len(prepared[admitted[0]]["input_ids"])
        while waiting and len(admitted) < free:
            x = prepared[waiting[0]]
            n = max(longest, len(x["input_ids"]))
            if len(prompts | {id(x)}) * n > self.max_prefill_tokens:
                break
            admitted.append(waiting.popleft())
            prompts.add(id(x))
            longest = n
        self.stats["prefill_tokens_max"] = max(self.stats["prefill_tokens_max"], len(prompts) * longest)
        return admitted

    def _prefill(self, slots: Slots, free: list[int], admitted: list[int], requests, prepared) -> None:
        """One forward over the admitted prompts (encoders included), each distinct prompt once (a group's
        samples share their `prepare_once` result): its KV goes to the slots `free` of every request that
        has it (columns from 0, the left padding dropped), and each request's first token is drawn from its
        prompt's last hidden state with the request's own uniform."""
        distinct: dict[int, dict] = {}  # id of a prepared prompt -> the prompt, in forward-row order
        for i in admitted:
            distinct.setdefault(id(prepared[i]), prepared[i])
        forward_row = {key: row for row, key in enumerate(distinct)}
        rows = [forward_row[id(prepared[i])] for i in admitted]  # each request's row in the forward
        self.stats["prefill_rows"] += len(distinct)
        batch = self.adapter.collate(list(distinct.values()))
        batch = {k: v.to(self.device) for k, v in batch.items()}
        positions = self.adapter.rope_positions(batch)  # [3, u, P]
        cache = DynamicCache()
        hidden = self.adapter.model(**batch, position_ids=positions, cache=cache, use_cache=True)  # [u, P, H]
        length = batch["input_ids"].shape[1]
        lengths = [len(prepared[i]["input_ids"]) for i in admitted]
        layers: list[Any] = slots.cache.layers  # a SlotLayer per decoder layer
        sources: list[Any] = cache.layers  # transformers' cache layers (typed as any layer kind)
        for layer, src in zip(layers, sources):
            src_keys, src_values = src.keys, src.values
            assert src_keys is not None and src_values is not None  # the prefill filled every layer
            for s, row, n in zip(free, rows, lengths):
                layer.keys[s, :, :n] = src_keys[row, :, length - n :]
                layer.values[s, :, :n] = src_values[row, :, length - n :]
        del cache
        rows_t = torch.tensor(rows, device=self.device)
        params = [requests[i].params for i in admitted]
        index = torch.tensor(free, device=self.device)
        noise = torch.zeros(len(admitted), slots.noise.shape[1])  # [k, W]
        stops = torch.full((len(admitted), slots.stops.shape[1]), -1, dtype=torch.long)
        for row, i in enumerate(admitted):
            gen = torch.Generator().manual_seed(requests[i].seed)
            noise[row, : params[row].max_new_tokens] = torch.rand(params[row].max_new_tokens, generator=gen)
            ids = self.adapter.eos_token_ids + tuple(params[row].stop_token_ids)
            stops[row, : len(ids)] = torch.tensor(ids)

        def put(name: str, values) -> None:
            target = getattr(slots, name)
            values = torch.as_tensor(values, dtype=target.dtype).to(self.device)
            target.index_copy_(0, index, values)

        put("length", lengths)
        after_prompt = positions.amax(dim=(0, 2)) + 1  # [u] the next position after each prompt
        put("pos", after_prompt.index_select(0, rows_t))
        put("n_gen", [0] * len(admitted))
        put("done", [False] * len(admitted))
        put("max_new", [p.max_new_tokens for p in params])
        put("temperature", [p.temperature for p in params])
        put("top_p", [p.top_p for p in params])
        put("top_k", [p.top_k for p in params])
        put("stops", stops)
        put("noise", noise)
        # The first token, drawn from the prompt's last hidden state, by the same bookkeeping as a step.
        self._record(slots, hidden[:, -1].index_select(0, rows_t), index)

    def _windows(self, capacity: int) -> list[int]:
        """The KV windows a decode step attends to: `kv_windows` widths up to the slots' capacity, each a
        multiple of WINDOW_COLUMNS, the last the whole capacity. A step runs the narrowest that holds
        every busy slot's columns, so short rows do not pay for the longest row's width (on CUDA one
        graph per window)."""
        widths = {capacity}
        for k in range(1, self.kv_windows):
            columns = -(-capacity * k // self.kv_windows)
            widths.add(min(capacity, -(-columns // WINDOW_COLUMNS) * WINDOW_COLUMNS))
        return sorted(widths)

    def _row_sizes(self, slots: int) -> list[int]:
        """The slot counts a decode step runs on: `row_buckets` sizes, all slots and halvings of them. A step
        computes the first of these that holds every busy slot once they are moved to the lowest slots
        (`_pack_rows`), so a call's tail, where most slots are free, does not compute all of them."""
        return sorted({-(-slots // 2**k) for k in range(self.row_buckets)})

    def _pack_rows(self, slots: Slots, owner: list, bound: list[int], sizes: list[int]) -> int:
        """The rows the next steps run on: the smallest of `sizes` that holds the busy slots, after moving
        each busy slot beyond it into a free slot within it (its KV rows and state copied on the device;
        `owner` and `bound` follow)."""
        busy = [s for s, o in enumerate(owner) if o is not None]
        rows = next(n for n in sizes if n >= len(busy))
        sources = [s for s in busy if s >= rows]
        if sources:
            targets = [s for s in range(rows) if owner[s] is None][: len(sources)]
            slots.move(sources, targets, self.device)
            for a, b in zip(sources, targets):
                owner[b], bound[b], owner[a] = owner[a], bound[a], None
            self.stats["rows_moved"] += len(sources)
        return rows

    def _step(self, slots: Slots, window: int) -> None:
        """One decode step of every slot on its latest token, attending to the first `window` columns of
        the cache: fixed shapes, in-place updates, no host sync. Free and finished slots compute too
        (their writes land in columns and scratch entries that no one reads)."""
        layers: list[Any] = slots.cache.layers  # a SlotLayer per decoder layer
        capacity = layers[0].keys.shape[2]
        for layer in layers:
            layer.window = window
        slots.column.view(-1).copy_(slots.length.clamp(max=capacity - 1))
        columns = torch.arange(window, device=self.device)
        mask = (columns[None] <= slots.length[:, None])[:, None, None]  # [S, 1, 1, W]: the cache + this token
        # Quiet FSDP2 hooks for the whole step, the lm_head's call in `_record` included: called outside a
        # root forward, a child unit's hook would make itself the root of a forward (stream waits, which
        # break a graph capture; and, as the first forward of a run, a lazy init FSDP then refuses).
        quiet = contextlib.nullcontext() if self.per_unit else fsdp_hooks_quiet(self.adapter.model)
        with quiet, swapped(self.narrowed), swapped(self.compiled):
            hidden = self.adapter.model(
                input_ids=slots.last[:, None],
                attention_mask=mask,
                position_ids=slots.pos.view(1, -1, 1).expand(3, -1, 1),
                cache=slots.cache,
                use_cache=True,
            )  # [S, 1, H]
            slots.pos.add_(1)
            slots.length.add_((~slots.done).long())
            self._record(slots, hidden[:, -1], None)

    def _record(self, slots: Slots, hidden: torch.Tensor, index: torch.Tensor | None) -> None:
        """Draw the next token of the slots `index` (all when None) after their last hidden states [R, H],
        record it and its log-prob, and update `done` / `last`, in place."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if index is None else t.index_select(0, index)

        n_gen, done = rows(slots.n_gen), rows(slots.done)
        logprobs = output_logprobs(
            self.adapter.lm_head, hidden, rows(slots.temperature)[:, None], self.placeholders
        )  # [R, V]
        step = n_gen[:, None]  # [R, 1]; finished rows write to their scratch column
        noise = rows(slots.noise)
        uniforms = noise.gather(1, step.clamp(max=noise.shape[1] - 1)).squeeze(1)  # [R]
        token = sample(logprobs, rows(slots.top_p), rows(slots.top_k), uniforms, self._filtered)
        logprob = logprobs.gather(1, token[:, None]).squeeze(1)
        active = ~done
        n_next = n_gen + active.long()
        stopped = (token[:, None] == rows(slots.stops)).any(1)
        done_next = done | (active & (stopped | (n_next >= rows(slots.max_new))))
        if index is None:
            slots.tokens.scatter_(1, step, token[:, None])
            slots.logprobs.scatter_(1, step, logprob[:, None])
            slots.n_gen.copy_(n_next)
            slots.done.copy_(done_next)
            slots.last.copy_(token)
        else:
            tokens, lps = rows(slots.tokens), rows(slots.logprobs)
            tokens.scatter_(1, step, token[:, None])
            lps.scatter_(1, step, logprob[:, None])
            for name, value in (
                ("tokens", tokens),
                ("logprobs", lps),
                ("n_gen", n_next),
                ("done", done_next),
                ("last", token),
            ):
                getattr(slots, name).index_copy_(0, index, value)

    def _warm_up(self, views: dict[int, Slots], windows: list[int]) -> Callable[[int, int], None]:
        """Two decode steps per window and row count (`views`: the slots' prefix of each) while every slot is
        free (they change nothing that matters: free slots' state is overwritten when a request takes
        them); returns the eager step of (window, rows)."""
        for rows in sorted(views, reverse=True):
            for window in windows:
                for _ in range(2):  # lazy initialisations, cuBLAS workspaces, autotuning
                    self._step(views[rows], window)
        return lambda window, rows: self._step(views[rows], window)

    def _capture(self, views: dict[int, Slots], windows: list[int]) -> Callable[[int, int], None]:
        """The decode step as one CUDA graph per window and row count: warmed up (on a side stream, as
        capture requires) and captured while every slot is free, replayed on the same buffers. The graphs
        share one memory pool: they never run at once, and a step keeps nothing in the pool past its end."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up(views, windows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        pool, graphs = torch.cuda.graph_pool_handle(), {}
        try:
            for rows in sorted(views, reverse=True):
                for window in windows:
                    graphs[window, rows] = graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._step(views[rows], window)
        except RuntimeError as e:
            raise RuntimeError(
                f"capturing the decode step in a CUDA graph failed ({e}); generation.cuda_graph: false "
                "runs it eagerly"
            ) from e
        return lambda window, rows: graphs[window, rows].replay()

    def _collect(
        self, slots: Slots, finished: list[int], owner, requests, prepared
    ) -> list[tuple[int, OmniTrajectory]]:
        """(request index, trajectory) of the finished slots, on the host."""
        if not finished:
            return []
        index = torch.tensor(finished, device=self.device)
        lengths = slots.n_gen.index_select(0, index).tolist()
        tokens = slots.tokens.index_select(0, index).cpu()
        logprobs = slots.logprobs.index_select(0, index).cpu()
        out = []
        for s, n, toks, lps in zip(finished, lengths, tokens, logprobs):
            i = owner[s]
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
    index = invert_cdf(probs, uniforms)[:, None]  # [R, 1]
    return (order.gather(1, index) if order is not None else index).squeeze(1)


def invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The index where each row's CDF crosses uniform x total mass: probs [R, V] >= 0 (unnormalised),
    uniforms [R] in [0, 1) -> [R] long, the first index whose cumulative mass exceeds the target.

    In two levels, as the CDF over the whole vocabulary is a single scan per row (on CUDA a slow kernel
    for 152k-token rows): the block of `block` tokens the target falls in, from the cumulative block
    sums, then the token within that block from the block's own cumulative sums. Equal to the one-level
    inversion up to float rounding of the sums. The target is kept strictly below each level's total,
    so a token of probability 0 (a banned id, a filtered one) is never returned."""
    rows, vocab = probs.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * block - vocab))
    grouped = probs.view(rows, blocks, block)
    sums = grouped.sum(-1)  # [R, nb]
    coarse = sums.cumsum(-1)  # [R, nb]
    total = coarse[:, -1:]
    below = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms[:, None].to(total.dtype) * total, below)  # [R, 1]
    chosen = torch.searchsorted(coarse, target, right=True).clamp(max=blocks - 1)  # [R, 1]
    before = torch.where(chosen > 0, coarse.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    fine = grouped.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1).cumsum(-1)  # [R, B]
    end = fine[:, -1:]
    rest = torch.minimum((target - before).clamp(min=0), torch.nextafter(end, torch.zeros_like(end)))
    within = torch.searchsorted(fine, rest, right=True).clamp(max=block - 1)
    return (chosen * block + within).squeeze(1)


def _check_params(request: Request) -> None:
    p = request.params
    if not isinstance(p, GenerationParams):
        raise ValueError(f"request {request.index}: params must be GenerationParams, got {type(p).__name__}")
    if p.max_new_tokens < 1 or p.temperature <= 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
        raise ValueError(
            f"request {request.index}: need max_new_tokens >= 1, temperature > 0, top_p in (0, 1] and "
            f"top_k >= 0 (1 = greedy), got {p}"
        )
