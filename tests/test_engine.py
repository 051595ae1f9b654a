"""The DiffusionEngine on the tiny SD3: packing, unfused CFG, bucket padding and compile change speed, never
results. fp32 on CPU: final latents and every recorded log-prob agree with the serial run to 1e-5
(docs/architecture.md, invariants; batched kernels alone differ by ~6e-7)."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from omnirl.config import RolloutConfig
from omnirl.distributed import derive_seed
from omnirl.models.base import Request, SamplingParams
from omnirl.models.sd3.adapter import SD3Adapter
from omnirl.recipe import config_for
from omnirl.rollout import compiled as rollout_compiled
from omnirl.rollout import diffusion
from omnirl.rollout.diffusion import DiffusionEngine, bucket_size

STEPS = 4
# Two keys that cannot share a forward: different latent sizes, guidance, SDE type, noise and window.
KEY_A = SamplingParams(32, 32, STEPS, 4.5, 0.7, "sde", 2, (0, 4))
KEY_B = SamplingParams(48, 48, STEPS, 3.0, 0.5, "cps", 1, (1, 3))  # CPS records 0 at the last step
PROMPTS = ["a red cat", "two dogs in the snow", "a lighthouse at night", "OPEN 24 HOURS", "a bowl", "rain"]
NEGATIVES = ["blurry", "", "low quality", "", "dark", "text"]


def make_requests(keys: list[SamplingParams]) -> list[Request]:
    return [
        Request(PROMPTS[i % 6], i, i, derive_seed(3, 0, i), p, negative_prompt=NEGATIVES[i % 6])
        for i, p in enumerate(keys)
    ]


MIXED = make_requests([KEY_A, KEY_B] * 3)  # the keys interleaved: A B A B A B


def unfused(requests: list[Request]) -> list[Request]:
    """`requests` with CFG's conditional and unconditional rows as two forwards."""
    return [dataclasses.replace(r, params=dataclasses.replace(r.params, fused_cfg=False)) for r in requests]


@pytest.fixture(scope="module")
def adapter(tiny_sd3):
    cfg = config_for("sd3")
    cfg.model.path = str(tiny_sd3)
    return SD3Adapter(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def serial(adapter):
    """The reference: one request per forward."""
    return DiffusionEngine(adapter, RolloutConfig(max_num_seqs=1)).generate(MIXED)


def run(engine: DiffusionEngine, requests: list[Request]):
    """Trajectories, the request indices of each batch handed to on_batch, and the row count of every
    transformer forward (seen by a hook on the real module)."""
    seen, rows = [], []
    hook = engine.adapter.policy.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        trajs = engine.generate(requests, on_batch=lambda b: seen.append([t.request.index for t in b]))
    finally:
        hook.remove()
    return trajs, seen, rows


def max_diffs(trajs, reference) -> tuple[float, float]:
    """Max |diff| over all latents (entering / leaving each trained step, final) and all log-probs."""
    d_latents = d_logprobs = 0.0
    for a, b in zip(trajs, reference, strict=True):
        layout = dataclasses.replace(b.request.params, fused_cfg=a.request.params.fused_cfg)
        assert a.request == dataclasses.replace(b.request, params=layout)  # the same, CFG layout aside
        assert a.step_indices.tolist() == b.step_indices.tolist()
        for x, y in [
            (a.latents, b.latents),
            (a.next_latents, b.next_latents),
            (a.final_latents, b.final_latents),
        ]:
            d_latents = max(d_latents, (x - y).abs().max().item())
        d_logprobs = max(d_logprobs, (a.logprobs - b.logprobs).abs().max().item())
    return d_latents, d_logprobs


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter, serial):
    packed, seen, rows = run(DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4)), MIXED)
    assert seen == [[0, 2, 4], [1, 3, 5]]  # grouped by key over the whole queue, not first-in-first-out
    assert rows == [6] * STEPS + [6] * STEPS  # 3 requests x 2 CFG rows per forward
    assert [t.final_latents.shape[-1] for t in packed] == [16, 24] * 3
    starts = [int(t.step_indices[0]) for t in packed[::2]]
    assert len(set(starts)) > 1, f"rows should sit at different window positions, got {starts}"
    assert all(torch.all(t.logprobs != 0) for t in packed)
    d_latents, d_logprobs = max_diffs(packed, serial)
    print(f"packed vs serial: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_unfused_cfg_equals_fused(adapter, serial):
    fused, _, _ = run(DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4)), MIXED)
    split, _, rows = run(DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4)), unfused(MIXED))
    assert rows == [3] * (4 * STEPS)  # two forwards of 3 rows per step
    assert not hasattr(adapter, "fused_cfg")  # the layout travels in the requests, never on the adapter
    d_latents, d_logprobs = max_diffs(split, fused)
    d_serial = max(max_diffs(split, serial))
    print(
        f"unfused vs fused CFG: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}; vs serial {d_serial:.2e}"
    )
    assert d_latents < 1e-5 and d_logprobs < 1e-5 and d_serial < 1e-5


@pytest.mark.slow
def test_padded_bucket_batch_equals_unpadded(adapter, serial):
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4))
    engine.pad = True  # what compile turns on, here without compiling
    padded, seen, rows = run(engine, MIXED)
    assert rows == [8] * (2 * STEPS)  # 3 requests padded to a bucket of 4, x 2 CFG rows
    assert seen == [[0, 2, 4], [1, 3, 5]]  # dummy rows are dropped before on_batch
    d_latents, d_logprobs = max_diffs(padded, serial)
    print(f"padded to bucket 4 vs unpadded serial: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5
    assert [bucket_size(n, 32) for n in (1, 2, 3, 5, 9, 17, 25, 32)] == [1, 2, 4, 8, 16, 24, 32, 32]
    assert [bucket_size(n, 256) for n in (33, 65, 129, 200)] == [40, 72, 144, 208]  # padding <= ~1/8
    assert bucket_size(5, 6) == 6  # never past the batch's capacity (max_num_seqs or the token budget)


def test_token_budget_counts_fused_cfg_rows(adapter):
    budget = 4 * adapter.num_tokens(MIXED[0])  # 4 rows of a KEY_A request
    four = make_requests([KEY_A] * 4)
    assert DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, max_num_batched_tokens=budget)).packer.pack(
        four
    ) == [[0, 1], [2, 3]]  # 2 requests x 2 rows
    assert DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, max_num_batched_tokens=budget)).packer.pack(
        unfused(four)
    ) == [[0, 1, 2, 3]]
    unguided = make_requests([SamplingParams(32, 32, STEPS, 1.0, 0.7, "sde", 2, (0, 3))] * 4)
    assert DiffusionEngine(adapter, RolloutConfig(max_num_seqs=8, max_num_batched_tokens=budget)).packer.pack(
        unguided
    ) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match=f"rollout.max_num_batched_tokens={budget // 4}"):
        DiffusionEngine(
            adapter, RolloutConfig(max_num_seqs=8, max_num_batched_tokens=budget // 4)
        ).packer.pack(four)


@pytest.mark.slow
def test_compiled_rollout_does_not_recompile(adapter, monkeypatch):
    """Dynamo decides every (re)compile from its guards before a backend runs, so the test compiles with
    the 'eager' backend (inductor's CPU code generation takes ~80 s per batch size on this machine)."""
    monkeypatch.setattr(rollout_compiled, "COMPILE_BACKEND", "eager")
    blocks = adapter.fsdp_units()

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    start = graphs()
    engine = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4, compile=True))
    seven = make_requests([KEY_A] * 7)
    compiled, seen, rows = run(engine, seven)
    assert seen == [[0, 1, 2, 3], [4, 5, 6]] and rows == [8] * (2 * STEPS)  # filled 4 + 3, 3 padded to 4
    # One graph per block variant (the tiny SD3's last block has no context output) for the one bucket.
    assert graphs() - start == 2
    assert all("forward" not in vars(b) for b in blocks), "training must run the eager forward"
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, _, _ = run(engine, make_requests([KEY_A] * 3))  # a new rollout: 3 padded to 4 again
    assert graphs() - start == 2
    eager, _, _ = run(DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4)), seven)
    d_latents, d_logprobs = max_diffs(compiled, eager)
    print(f"compiled (eager backend) vs eager: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5
    assert max(max_diffs(again, eager[:3])) < 1e-5
    # The counter does see a new batch size: without padding, 3 requests (6 rows) compile again.
    unpadded = DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4, compile=True))
    unpadded.pad = False
    run(unpadded, make_requests([KEY_A] * 3))
    assert graphs() - start == 4


@pytest.mark.slow
def test_a_probe_that_runs_out_of_memory_names_what_does_not_fit(adapter, monkeypatch):
    """A probe rollout that runs out of device memory stops the rollout before any batch runs with the
    ValueError of a batch that does not fit, raised after the allocator's error is dropped and the cached
    memory handed back (so nothing of the failed probe stays allocated)."""
    rollout = adapter.rollout

    def out_of_memory_past_one_row(batch):
        if len(batch) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return rollout(batch)

    monkeypatch.setattr(adapter, "rollout", out_of_memory_past_one_row)
    emptied = []
    monkeypatch.setattr(diffusion, "empty_cache", lambda: emptied.append(True))
    done = []
    with pytest.raises(ValueError) as e:
        DiffusionEngine(adapter, RolloutConfig(max_num_seqs=4, memory_budget_gib=1.0)).generate(
            make_requests([KEY_A] * 4), done.append
        )
    message = str(e.value)
    assert message.startswith("rollout.max_num_seqs 4 does not fit: measuring what a batch needs, a rollout")
    assert "of 2 requests ran out of device memory" in message
    assert message.endswith("the largest rollout.max_num_seqs that fits is below 2")
    assert e.value.__context__ is None  # not chained to the allocator's error and its traceback
    assert emptied == [True] and done == []
