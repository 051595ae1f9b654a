"""Omni models: the Qwen3-Omni thinker and Qwen VL adapters and the native generation engine, on tiny real
models (transformers classes, random init, saved and loaded with from_pretrained).

The central invariant: for an unchanged policy, the log-probs the trainer recomputes for generated
responses equal the ones the rollout recorded (fp32 on CPU: max |diff| <= 1e-5, Pearson >= 0.9999).
"""

import dataclasses
import json
import shutil

import numpy as np
import peft
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig, Qwen3OmniMoeThinkerForConditionalGeneration

from omnirl.data.prompts import PromptRow
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import GenerationParams, Request
from omnirl.models.lm import pad_responses
from omnirl.models.peft_lora import lora_disabled
from omnirl.recipe import config_for, config_from_dict
from omnirl.rollout.compiled import ELEMENTWISE_MODULES
from omnirl.rollout.generate import GenerationEngine

DEVICE = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hidden-64 matmuls gain nothing from threads, and on 2 shared cores 2 threads were ~25x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_adapter(path, adapter="qwen3_omni_thinker", **family):
    cfg = config_for(adapter)
    cfg.model.path = str(path)
    for k, v in family.items():
        setattr(cfg.family, k, v)
    cfg.lora.target_modules = ATTENTION
    a = get_adapter(adapter)(cfg, DEVICE)
    # peft starts B at 0 (LoRA off); a non-zero adapter puts the LoRA path into every number below.
    gen = torch.Generator().manual_seed(0)
    for p in a.trainable_parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.05
    return a


@pytest.fixture(scope="module")
def omni(tiny_qwen3_omni_thinker):
    return make_adapter(tiny_qwen3_omni_thinker)


def image(seed: int, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def audio(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(16000) * 0.1).astype(np.float32)  # 1 s, 16 kHz


INPUTS = {
    "text": lambda i: {},
    "image": lambda i: {"image": image(i)},
    "audio": lambda i: {"audio": audio(i)},
    "image+audio": lambda i: {"image": image(i), "audio": audio(i)},
}


def requests(n: int, modality, params=None, **kw) -> list[Request]:
    """n requests of various prompt and response lengths; `modality` a name of INPUTS or one per request."""
    out = []
    for i in range(n):
        mod = modality if isinstance(modality, str) else modality[i % len(modality)]
        p = params or GenerationParams(max_new_tokens=6 + 3 * (i % 4), **kw)
        prompt = f"Question {i}: what is {i} + {2 * i}? " * (1 + i % 3)
        out.append(Request(prompt, i // 2, i, 1000 + 7 * i, p, inputs=INPUTS[mod](i)))
    return out


def recompute(adapter, trajs, temperature):
    """(trainer log-probs, rollout log-probs) of all response tokens, flattened."""
    batch = adapter.collate([t.prompt_inputs() for t in trajs])
    seqs, mask = pad_responses([t.response_ids for t in trajs], adapter.pad_token_id)
    with torch.no_grad():
        trainer = adapter.token_logprobs(batch, seqs, mask, temperature)
    return trainer[mask], torch.cat([t.logprobs for t in trajs])


def assert_aligned(trainer, rollout, what):
    diff = (trainer - rollout).abs()
    pearson = float(np.corrcoef(trainer.numpy(), rollout.numpy())[0, 1])
    print(f"{what}: {len(diff)} tokens, max |diff| {diff.max():.2e}, mean {diff.mean():.2e}, ", end="")
    print(f"Pearson {pearson:.10f}")
    assert diff.max() <= 1e-5 and pearson >= 0.9999, (what, diff.max(), pearson)


@pytest.mark.parametrize("modality", ["text", "image", "audio"])
def test_trainer_logprobs_equal_rollout_omni(omni, modality):
    # 6 requests through 4 rows: rows finish at different lengths, leave, and the waiting ones join.
    reqs = requests(6, modality, temperature=0.8, top_p=0.95)
    trajs = GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1).generate(reqs)
    for r, t in zip(reqs, trajs):  # a random policy may draw an EOS token early
        assert len(t.response_ids) == r.params.max_new_tokens or t.finish_reason == "stop"
    key = {"image": "pixel_values", "audio": "input_features"}.get(modality)
    assert all((key in t.mm_inputs) for t in trajs) if key else all(not t.mm_inputs for t in trajs)
    assert_aligned(
        *recompute(omni, trajs, 0.8), f"qwen3-omni {modality}" + ("" if modality == "text" else "+text")
    )


# The tiny checkpoint of each model the omni adapters train.
TINY = {"qwen3_omni": "qwen3_omni_thinker", "qwen2_5_vl": "qwen_vl_2_5", "qwen3_vl": "qwen_vl_3"}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_trainer_logprobs_equal_rollout_vl(family, request):
    adapter = make_adapter(request.getfixturevalue(f"tiny_{TINY[family]}"), "qwen_vl")
    size = 56 if family == "qwen2_5_vl" else 64  # 4x4 patches of 14 / 16 px
    reqs = [
        Request(
            f"Describe picture {i}.", i, i, 50 + i, GenerationParams(8 + i), inputs={"image": image(i, size)}
        )
        for i in range(5)
    ]
    trajs = GenerationEngine(adapter, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    assert all(t.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]] for t in trajs)
    assert_aligned(*recompute(adapter, trajs, 1.0), f"{family} image+text")


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen2_5_vl", "qwen3_vl"])
def test_prompt_tokens_counts_what_prepare_makes(family, request):
    """`prompt_tokens`, which the data check runs on every row without the image processor, counts the
    tokens `prepare` makes: the chat template and the image's vision tokens, for images of several sizes
    and for text alone."""
    adapter = make_adapter(
        request.getfixturevalue(f"tiny_{TINY[family]}"), *(() if family == "qwen3_omni" else ("qwen_vl",))
    )
    for inputs in (
        {},
        {"image": image(0, 64)},
        {"image": image(1, 100)},
        {"image": image(2, 300).resize((300, 90))},
    ):
        row = PromptRow(prompt="What is 12 x 12? " * 3, inputs=inputs)
        prompt_ids = adapter.prepare(Request(row.prompt, 0, 0, 0, GenerationParams(4), inputs=inputs))[
            "input_ids"
        ]
        assert adapter.prompt_tokens(row) == len(prompt_ids), inputs


@pytest.mark.slow
def test_compiled_decode_step_draws_the_eager_samples(omni, monkeypatch):
    """generation.compile: the decoder layers run compiled in the decode steps, traced whole (fullgraph:
    the MoE layer with the slot cache has no graph break), the prefill and the trainer eager; samples and
    log-probs are the eager engine's. A call of other shapes (slots, KV columns) compiles once more, with
    those sizes symbolic, and then calls of any shapes compile nothing. Compiled with the "eager"
    backend: what is tested is dynamo's tracing and guards (inductor's CPU code generation takes minutes
    here)."""
    from torch._dynamo.utils import counters

    from omnirl.rollout import compiled

    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    reqs = requests(6, ["text", "image"], temperature=0.8)
    eager = GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1).generate(reqs)
    start = counters["stats"]["unique_graphs"]
    engine = GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1, compile=True)
    out = engine.generate(reqs)
    assert counters["stats"]["unique_graphs"] > start  # the decode step ran compiled
    for a, b in zip(eager, out):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6
    assert all("forward" not in vars(layer) for layer in omni.decoder_layers())  # restored after each step
    engine.generate(requests(3, "audio"))  # 3 slots, other KV columns: compiled again, dynamic
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = engine.generate(requests(5, ["image", "text"], temperature=0.8))  # other shapes again
    assert [t.response_ids.tolist() for t in again] == [
        t.response_ids.tolist()
        for t in GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1).generate(
            requests(5, ["image", "text"], temperature=0.8)
        )
    ]


def test_prefill_groups_stay_within_max_prefill_tokens_and_draw_the_same_samples(omni):
    """generation.max_prefill_tokens cuts the prefill groups (prompts x the longest of them), so more,
    smaller prefills run, back to back until the free slots are filled; every request still draws the
    sample and log-probs it draws in one group."""
    reqs = requests(6, ["text", "image", "audio"], temperature=0.8)
    whole = GenerationEngine(omni, max_num_seqs=6, kv_cache_gib=0.1)
    one_group = whole.generate(reqs)
    assert whole.stats["prefills"] == 1
    longest = whole.stats["prefill_tokens_max"] // 6
    cut = GenerationEngine(omni, max_num_seqs=6, kv_cache_gib=0.1, max_prefill_tokens=2 * longest)
    out = cut.generate(reqs)
    assert cut.stats["prefills"] >= 3 and cut.stats["prefill_tokens_max"] <= 2 * longest
    assert cut.stats["decode_steps"] == whole.stats["decode_steps"]  # all slots filled before decoding
    for a, b in zip(one_group, out):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-5
    one = GenerationEngine(omni, max_num_seqs=6, kv_cache_gib=0.1, max_prefill_tokens=1)
    assert [t.response_ids.tolist() for t in one.generate(reqs)] == [t.response_ids.tolist() for t in out]
    assert one.stats["prefills"] == 6  # a prompt longer than the budget is prefilled alone


def test_kv_windows_attend_to_every_cached_column(omni, monkeypatch):
    """A decode step attends to the narrowest KV window that holds every busy slot's columns: with a window
    of every width (so a bound one column short drops a token from the attention), the samples and
    log-probs are those of one window spanning the whole cache, and the steps attend to fewer columns."""
    from omnirl.rollout import generate

    monkeypatch.setattr(generate, "WINDOW_COLUMNS", 1)
    reqs = requests(7, ["text", "image", "audio"], GenerationParams(max_new_tokens=40, temperature=0.9))
    whole = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, kv_windows=1)
    reference = whole.generate(reqs)
    narrow = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, kv_windows=10_000)
    out = narrow.generate(reqs)
    capacity = whole.stats["kv_windows"][-1]
    assert whole.stats["kv_windows"] == [capacity] and narrow.stats["kv_windows"] == list(
        range(1, capacity + 1)
    )
    assert narrow.stats["kv_columns_mean"] < 0.95 * capacity == 0.95 * whole.stats["kv_columns_mean"]
    for a, b in zip(reference, out):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="kv_windows"):
        GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, kv_windows=0)


def test_compiled_norms_draw_the_eager_samples(omni, monkeypatch):
    """compile_modules RMSNorm, TopKRouter: only the decode step's norms and MoE routers run compiled (each
    of them, in every layer), the samples and log-probs are the eager engine's, and the modules are restored
    after."""
    from torch._dynamo.utils import counters

    from omnirl.rollout import compiled

    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    reqs = requests(5, ["text", "image"], temperature=0.8)
    eager = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    engine = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, compile_modules=ELEMENTWISE_MODULES)
    modules = [m for m, _ in engine.compiled]
    layers = omni.decoder_layers()
    assert {type(m).__name__ for m in modules} == {
        "Qwen3OmniMoeThinkerTextRMSNorm",
        "Qwen3OmniMoeThinkerTextTopKRouter",
    } and len(modules) == 5 * len(layers)  # 4 norms and the router per layer (every layer is MoE here)
    start = counters["stats"]["unique_graphs"]
    out = engine.generate(reqs)
    assert counters["stats"]["unique_graphs"] > start
    for a, b in zip(eager, out):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6
    assert all("forward" not in vars(m) for m in modules)


def test_uint8_expert_ids_draw_the_same_samples(omni, monkeypatch):
    """narrow_expert_ids: the decode step's grouped-GEMM experts get their top-k ids as uint8 (the dispatch
    sorts them: fewer radix passes), every MoE layer's, and the samples and log-probs stay the same."""
    reqs = requests(5, ["text", "image"], temperature=0.8)
    reference = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    engine = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, narrow_expert_ids=True)
    experts = [m for m, _ in engine.narrowed]
    assert len(experts) == len(omni.decoder_layers())  # every layer is MoE in the tiny thinker
    seen, sort = [], torch.sort

    def recorded(keys, *args, **kwargs):
        seen.append(keys.dtype)
        return sort(keys, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", recorded)  # what the dispatch sorts
    out = engine.generate(reqs)
    monkeypatch.undo()
    assert torch.uint8 in seen and torch.int64 in seen  # the decode step's, and the prefill's ids
    for a, b in zip(reference, out):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-6
    assert all("forward" not in vars(m) for m in experts)


def test_row_buckets_draw_the_same_samples(omni):
    """generation.row_buckets: each step computes the smallest slot count (8, 4, 2) that holds the busy slots,
    moved to the lowest slots first: the samples and log-probs of every slot computed in every step, with
    fewer rows computed and slots moved mid-response."""
    reqs = requests(12, ["text", "image", "audio"], temperature=0.9)
    reqs = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, max_new_tokens=4 + 7 * (i % 5)))
        for i, r in enumerate(reqs)
    ]
    every = GenerationEngine(omni, max_num_seqs=8, kv_cache_gib=0.1)
    full = every.generate(reqs)
    engine = GenerationEngine(omni, max_num_seqs=8, kv_cache_gib=0.1, row_buckets=3)
    packed = engine.generate(reqs)
    stats = engine.stats
    assert stats["row_sizes"] == [2, 4, 8] and every.stats["rows_mean"] == 8
    assert stats["rows_moved"] > 0 and stats["rows_mean"] < 8
    for a, b in zip(full, packed):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="row_buckets must be >= 1"):
        GenerationEngine(omni, max_num_seqs=8, kv_cache_gib=0.1, row_buckets=0)


def test_merged_lora_rollout_is_the_unmerged_one(omni, monkeypatch):
    """generation.merge_lora: each LoRA linear runs as one GEMM on W + scale B A (peft's LoRA GEMMs never run)
    and draws the unmerged engine's samples with its log-probs (fp32, within rounding), which are the
    trainer's; the trainer's parameters are untouched and peft's forward is back after the call."""
    from peft.tuners.lora import Linear as LoraLinear

    from omnirl.rollout import compiled

    reqs = requests(6, ["text", "image", "audio"], temperature=0.9)
    reference = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    layers = [m for m in omni.model.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == 4 * omni.thinker.config.text_config.num_hidden_layers
    before = [p.detach().clone() for p in omni.model.parameters()]
    calls = []
    hooks = [layer.lora_A["default"].register_forward_hook(lambda *a: calls.append(1)) for layer in layers]
    try:
        engine = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, merge_lora=True)
        merged = engine.generate(reqs)
        assert not calls  # no LoRA GEMM ran: every layer took its merged weight
        assert engine.stats["lora_merged_gib"] > 0
        assert all("forward" not in vars(layer) for layer in layers)
        GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs[:1])
        assert calls  # and the unmerged engine runs peft's LoRA again
    finally:
        for h in hooks:
            h.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, omni.model.parameters()))
    for a, b in zip(reference, merged):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() <= 1e-5
    assert_aligned(*recompute(omni, merged, 0.9), "merged LoRA")
    with lora_disabled(omni.model):  # the LoRA matters in these numbers
        base = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    assert any(not torch.equal(a.response_ids, b.response_ids) for a, b in zip(base, merged))
    # With generation.compile: each rollout's new merged weights recompile nothing (dynamo's guards hold
    # each layer's forward object, which lives as long as the layer).
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    both = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1, merge_lora=True, compile=True)
    both.generate(reqs[:3])
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = both.generate(reqs[:3])
    assert [t.response_ids.tolist() for t in again] == [t.response_ids.tolist() for t in merged[:3]]


def test_sample_does_not_depend_on_batch(omni):
    """Each request alone vs all of them through 3 rows (rows leave and join): same tokens."""
    reqs = requests(7, ["text", "image", "audio", "image+audio"], top_k=40)
    batched = GenerationEngine(omni, max_num_seqs=3, kv_cache_gib=0.1).generate(reqs)
    alone = [GenerationEngine(omni, max_num_seqs=1, kv_cache_gib=0.1).generate([r])[0] for r in reqs]
    for b, a in zip(batched, alone):
        assert torch.equal(b.response_ids, a.response_ids)
        assert (b.logprobs - a.logprobs).abs().max() <= 1e-5
    # and a different seed draws a different sample
    other = GenerationEngine(omni, 3, 0.1).generate([Request(**{**vars(reqs[0]), "seed": 1})])[0]
    assert not torch.equal(other.response_ids, batched[0].response_ids)


def test_a_groups_samples_share_one_prepare_and_prefill(omni, monkeypatch):
    """The samples of a group (one prompt and inputs dict, as batching.make_requests makes them) run the
    processor once and share its tensors, and their prompt is prefilled once; the same prompt with another
    inputs dict is prepared and prefilled apart; each sample is the one its request draws alone, and the
    group's samples differ (each its own seed)."""
    params = GenerationParams(max_new_tokens=5, temperature=0.9)
    shared = {"image": image(0)}
    reqs = [Request("Describe it.", 0, j, 50 + j, params, inputs=shared) for j in range(3)]
    reqs.append(Request("Describe it.", 1, 3, 53, params, inputs={"image": image(1)}))
    calls = []
    prepare = omni.prepare
    monkeypatch.setattr(omni, "prepare", lambda r: calls.append(r.index) or prepare(r))
    engine = GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1)
    trajs = engine.generate(reqs)
    assert calls == [0, 3]
    assert engine.stats["prefills"] == 1 and engine.stats["prefill_rows"] == 2  # 4 requests, 2 prompts
    assert len({tuple(t.response_ids.tolist()) for t in trajs[:3]}) > 1
    assert trajs[0].prompt_ids is trajs[2].prompt_ids and trajs[3].prompt_ids is not trajs[0].prompt_ids
    assert not torch.equal(trajs[0].mm_inputs["pixel_values"], trajs[3].mm_inputs["pixel_values"])
    alone = [GenerationEngine(omni, max_num_seqs=1, kv_cache_gib=0.1).generate([r])[0] for r in reqs]
    assert len(calls) == 2 + len(reqs)
    assert all(torch.equal(a.response_ids, t.response_ids) for a, t in zip(alone, trajs))


def test_greedy_equals_transformers_generate(omni):
    reqs = requests(4, ["text", "image", "audio", "image+audio"], top_k=1)
    trajs = GenerationEngine(omni, max_num_seqs=4, kv_cache_gib=0.1).generate(reqs)
    for r, t in zip(reqs, trajs):
        inputs = omni.collate([omni.prepare(r)])
        ref = omni.thinker.generate(
            **inputs,
            max_new_tokens=r.params.max_new_tokens,
            do_sample=False,
            suppress_tokens=list(omni.placeholder_token_ids),  # the policy never emits them (models/lm.py)
        )
        assert ref[0, inputs["input_ids"].shape[1] :].tolist() == t.response_ids.tolist()


def test_stop_tokens_and_max_new_tokens(omni):
    reqs = requests(3, "text", params=GenerationParams(max_new_tokens=12))
    free = GenerationEngine(omni, 3, 0.1).generate(reqs)
    assert [len(t.response_ids) for t in free] == [12, 12, 12]
    # Stop on the 5th token of the first response: the same draw then ends there, stop token included.
    stop = int(free[0].response_ids[4])
    first = free[0].response_ids.tolist().index(stop)
    params = GenerationParams(max_new_tokens=12, stop_token_ids=(stop,))
    stopped = GenerationEngine(omni, 3, 0.1).generate(
        [Request(**{**vars(r), "params": params}) for r in reqs]
    )
    assert stopped[0].response_ids.tolist() == free[0].response_ids[: first + 1].tolist()
    assert stopped[0].finish_reason == "stop"
    for f, s in zip(free, stopped):  # every row ends at its first stop token, or runs to max_new_tokens
        ids = f.response_ids.tolist()
        end = ids.index(stop) + 1 if stop in ids else 12
        assert s.response_ids.tolist() == ids[:end]
        assert s.finish_reason == ("stop" if stop in ids else "length")
        assert torch.allclose(s.logprobs, f.logprobs[:end], atol=1e-6)


def test_placeholder_ids_are_never_sampled(omni):
    """The multimodal placeholder ids are banned from sampling and from the log-probs' normalisation: with
    the lm_head's output pushed to favour them above every other id, no response holds one and the
    log-probs still equal the trainer's; unbanned, they would have been drawn at nearly every step."""
    ids = torch.tensor(omni.placeholder_token_ids)
    favoured = []

    def boost(module, args, out):
        out = out.clone()
        out[..., ids] += 30.0
        favoured.append(torch.isin(out.argmax(-1).flatten(), ids))
        return out

    handle = omni.lm_head.register_forward_hook(boost)
    try:
        trajs = GenerationEngine(omni, 4, 0.1).generate(
            requests(4, "text", GenerationParams(max_new_tokens=8))
        )
        trainer, rollout = recompute(omni, trajs, 1.0)
    finally:
        handle.remove()
    assert not torch.isin(torch.cat([t.response_ids for t in trajs]), ids).any()
    assert torch.cat(favoured).float().mean() > 0.9  # the boost makes a placeholder the argmax
    assert_aligned(trainer, rollout, "placeholders favoured and banned")


def test_kv_cache_budget(omni):
    reqs = requests(5, "text", params=GenerationParams(max_new_tokens=8))
    roomy = GenerationEngine(omni, max_num_seqs=5, kv_cache_gib=0.1).generate(reqs)
    # Room for about 2 rows of (~100 prompt + 8 + 8) tokens: fewer rows at a time, the same samples.
    per_row = (max(len(omni.prepare(r)["input_ids"]) for r in reqs) + 16) * omni.kv_bytes_per_token()
    tight = GenerationEngine(omni, max_num_seqs=5, kv_cache_gib=2.5 * per_row / 2**30).generate(reqs)
    assert [t.response_ids.tolist() for t in tight] == [t.response_ids.tolist() for t in roomy]
    with pytest.raises(ValueError, match="KV cache"):
        GenerationEngine(omni, max_num_seqs=5, kv_cache_gib=0.2 * per_row / 2**30).generate(reqs[:1])
    # No explicit size: a fraction of the memory free when the call starts (here the injected budget).
    engine = GenerationEngine(
        omni, max_num_seqs=5, kv_cache_gib=None, kv_fraction=0.5, memory_budget=5 * per_row
    )
    sized = engine.generate(reqs)
    assert engine.stats["slots"] == 2 and engine.stats["kv_budget_gib"] * 2**30 == pytest.approx(
        2.5 * per_row
    )
    assert [t.response_ids.tolist() for t in sized] == [t.response_ids.tolist() for t in roomy]
    # Without a budget the free memory is measured (on CPU: the host's available memory).
    engine = GenerationEngine(omni, max_num_seqs=5, kv_cache_gib=None)
    engine.generate(reqs[:1])
    assert engine.stats["kv_budget_gib"] > 0


def test_lora_export_loads_with_peft(omni, tiny_qwen3_omni_thinker, tmp_path):
    omni.export_lora(tmp_path / "lora")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["r"] == 8 and all(
        t.startswith("model.language_model.layers.") for t in config["target_modules"]
    )
    with safe_open(tmp_path / "lora" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert len(keys) == 2 * 4 * 2  # A and B of q/k/v/o in 2 layers
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys

    thinker_config = AutoConfig.from_pretrained(tiny_qwen3_omni_thinker).thinker_config
    thinker_config.vision_start_token_id = omni.thinker.config.vision_start_token_id
    base = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni_thinker, config=thinker_config, key_mapping={r"^thinker\.": ""}
    )
    inputs = omni.collate([omni.prepare(r) for r in requests(2, ["image", "audio"])])
    with torch.no_grad():
        without = base(**inputs).logits[:, -1]
        loaded = peft.PeftModel.from_pretrained(base, tmp_path / "lora")(**inputs).logits[:, -1]
        ours = omni.lm_head(omni.model(**inputs, position_ids=omni.rope_positions(inputs))[:, -1])
    assert (loaded - ours).abs().max() < 1e-5
    assert (without - ours).abs().max() > 1e-3  # the adapter really changes the output


def test_thinker_only_and_full_checkpoints(omni, tiny_qwen3_omni_thinker, tmp_path):
    with safe_open(tiny_qwen3_omni_thinker / "model.safetensors", "pt") as f:
        prefixes = {k.split(".")[0] for k in f.keys()}
    assert prefixes == {"thinker", "talker", "code2wav"}  # the full Qwen3-Omni layout
    names = [n for n, _ in omni.thinker.named_modules()] + [n for n, _ in omni.model.named_modules()]
    assert not [n for n in names if "talker" in n or "code2wav" in n]
    assert omni.thinker.config.vision_start_token_id is not None  # the quirk: get_rope_index reads it

    # A thinker-only checkpoint (thinker config, unprefixed keys) loads the same thinker.
    thinker_config = AutoConfig.from_pretrained(tiny_qwen3_omni_thinker).thinker_config
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni_thinker, config=thinker_config, key_mapping={r"^thinker\.": ""}
    )
    thinker.save_pretrained(tmp_path)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    ):
        shutil.copy(tiny_qwen3_omni_thinker / name, tmp_path / name)
    alone = make_adapter(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "Qwen3OmniMoeThinkerConfig"
    reqs = requests(2, ["image+audio", "text"], params=GenerationParams(max_new_tokens=5))
    a = GenerationEngine(alone, 2, 0.1).generate(reqs)
    b = GenerationEngine(omni, 2, 0.1).generate(reqs)
    assert [t.response_ids.tolist() for t in a] == [t.response_ids.tolist() for t in b]


@pytest.mark.parametrize("stage", ["talker", "all"])
def test_only_the_thinker_stage(stage):
    # Qwen3-Omni's other stages are refused when the recipe loads (tests/test_bad_settings.py); a VL model
    # has one stage: no such setting of its family.
    with pytest.raises(ConfigError, match="unknown key 'family.stage'"):
        config_from_dict({"model": {"adapter": "qwen_vl"}, "family": {"stage": stage}})


def test_bad_inputs_are_named(omni, tiny_qwen3_omni_thinker):
    with pytest.raises(ValueError, match="video"):
        omni.prepare(Request("x", 0, 3, 0, GenerationParams(4), inputs={"video": []}))
    with pytest.raises(ValueError, match="temperature > 0"):
        GenerationEngine(omni, 2, 0.1).generate([Request("x", 0, 0, 0, GenerationParams(4, temperature=0.0))])
    with pytest.raises(ValueError, match="match no module"):
        cfg = config_for("qwen3_omni_thinker")
        cfg.model.path = str(tiny_qwen3_omni_thinker)  # lora.target_modules left at the diffusion default
        get_adapter("qwen3_omni_thinker")(cfg, DEVICE)
