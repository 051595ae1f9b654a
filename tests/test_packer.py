"""RequestPacker invariants on many randomized queues: nothing lost or duplicated, budgets held, keys never
mixed, every RL knob of SamplingParams part of the key, deterministic, not first-in-first-out, balanced."""

import dataclasses
import math
import random

import pytest

from omnirl.models.base import Request, SamplingParams
from omnirl.rollout.packer import RequestPacker

BASE = SamplingParams(32, 32, 6, 4.5, 0.7, "sde", 2, (0, 3))
# One value per field that differs from BASE's; a field added to SamplingParams without an entry here
# fails test_every_sampling_field_separates_requests, so the key and this list stay complete.
CHANGED = {
    "height": 48,
    "width": 48,
    "num_steps": 10,
    "guidance_scale": 1.0,
    "noise_level": 1.2,
    "sde_type": "cps",
    "sde_window_size": 3,
    "sde_window_range": (1, 4),
    "record_logprobs": False,
    "record_mean": True,
    "ode_solver": "dpm2",
    "lora": "reference",
    "shared_initial_noise": True,
    "sde_window_schedule": "dance",
    "ode_compress_ratio": 0.5,
    "fused_cfg": False,
    "decode": False,
}
VARIANTS = [BASE] + [dataclasses.replace(BASE, **{k: v}) for k, v in CHANGED.items()]


def request(i: int, params: SamplingParams = BASE, tokens: int = 100) -> Request:
    return Request(f"prompt {i}", i, i, i, params, metadata={"tokens": tokens})


def packer(max_num_seqs: int, max_num_batched_tokens: int = 0) -> RequestPacker:
    return RequestPacker(
        max_num_seqs, max_num_batched_tokens, lambda r: r.params.key, lambda r: r.metadata["tokens"]
    )


def sizes(batches: list[list[int]]) -> list[int]:
    return [len(b) for b in batches]


@pytest.mark.parametrize("fill", [False, True])
def test_randomized_queues_hold_every_invariant(fill):
    rng = random.Random(0)
    for trial in range(400):
        n = rng.randint(0, 90)
        variants = rng.sample(VARIANTS, rng.randint(1, 4))
        uniform = rng.random() < 0.5  # uniform tokens per key (as SD3) or mixed lengths
        token_choices = [rng.randint(10, 400) for _ in range(3)]
        queue = []
        for i in range(n):
            v = rng.randrange(len(variants))
            tokens = 50 * (v + 1) if uniform else rng.choice(token_choices)
            queue.append(request(i, variants[v], tokens))
        max_seqs = rng.randint(1, 12)
        longest = max((r.metadata["tokens"] for r in queue), default=1)
        budget = 0 if rng.random() < 0.3 else rng.randint(longest, 8 * longest)
        p = packer(max_seqs, budget)
        batches = p.pack(queue, fill=fill)
        where = f"trial {trial}: n={n} max_num_seqs={max_seqs} budget={budget} batches={batches}"

        assert sorted(i for b in batches for i in b) == list(range(n)), where  # none lost or duplicated
        for b in batches:
            assert b and len({queue[i].params.key for i in b}) == 1, where  # one key per batch
            assert len(b) <= max_seqs, where
            assert not budget or len(b) * max(queue[i].metadata["tokens"] for i in b) <= budget, where
        assert p.pack(queue, fill=fill) == batches, where  # deterministic
        assert p.pack([dataclasses.replace(r) for r in queue], fill=fill) == batches, where

        if uniform:  # the fewest batches per key, and balanced ones differ by at most one request
            for v, params in enumerate(variants):
                mine = [b for b in batches if queue[b[0]].params == params]
                count = sum(r.params == params for r in queue)
                if not count:
                    continue
                cap = min(max_seqs, budget // (50 * (v + 1))) if budget else max_seqs
                assert len(mine) == math.ceil(count / cap), where
                if fill:
                    assert sizes(mine)[:-1] == [cap] * (len(mine) - 1), where
                else:
                    assert max(sizes(mine)) - min(sizes(mine)) <= 1, where


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_sampling_field_separates_requests(field):
    changed = dataclasses.replace(BASE, **{field: CHANGED[field]})
    assert changed.key != BASE.key, f"SamplingParams.key ignores {field}"
    queue = [request(0), request(1, changed), request(2), request(3, changed)]
    assert packer(8).pack(queue) == [[0, 2], [1, 3]]


def test_incompatible_head_request_does_not_block_the_rest():
    other = dataclasses.replace(BASE, noise_level=0.0)
    queue = [request(0), request(1, other)] + [request(i) for i in range(2, 5)]
    # First-in-first-out would run [0], [1], [2, 3, 4]: three forwards where two suffice.
    assert packer(4).pack(queue) == [[0, 2, 3, 4], [1]]


def test_batches_of_a_key_are_balanced_unless_filling():
    queue = [request(i) for i in range(33)]
    assert sizes(packer(32).pack(queue)) == [17, 16]
    assert sizes(packer(32).pack(queue, fill=True)) == [32, 1]
    assert sizes(packer(32).pack([request(i) for i in range(65)])) == [22, 22, 21]
    assert packer(32).pack([]) == []


def test_token_budget_counts_rows_times_the_longest_request():
    # Sorted by tokens, the short ones share a batch; the long one alone fills the budget.
    queue = [request(0, tokens=300), request(1, tokens=100), request(2, tokens=100), request(3, tokens=100)]
    for fill in (False, True):
        assert packer(8, 300).pack(queue, fill=fill) == [[1, 2, 3], [0]]
    # 4 rows of 100 fit 400 tokens: 5 requests are 3 + 2 balanced, 4 + 1 filled.
    queue = [request(i, tokens=100) for i in range(5)]
    assert sizes(packer(8, 400).pack(queue)) == [3, 2]
    assert sizes(packer(8, 400).pack(queue, fill=True)) == [4, 1]
    assert packer(2, 0).capacity(10**9) == 2 and packer(8, 1000).capacity(300) == 3


def test_bad_budgets_are_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"request 1 needs 300 tokens .* rollout.max_num_batched_tokens=200"):
        packer(8, 200).pack([request(0), request(1, tokens=300)])
    with pytest.raises(ValueError, match="rollout.max_num_seqs must be >= 1, got 0"):
        packer(0)
    with pytest.raises(ValueError, match="rollout.max_num_batched_tokens must be >= 0"):
        packer(4, -1)
