"""The BAGEL port and adapter on a tiny random-init BAGEL written in the official checkpoint layout. fp32 on
CPU: everything must agree to 1e-5 (docs/architecture.md).

There is no diffusers pipeline to compare with, so the port is held against a reference forward written
here apart, token by token from the architecture (explicit routing by index, attention as a softmax over
explicit scores, RoPE as a rotation, RMS norms by hand); and each silent bug BAGEL's RL users have hit has
a test that fails if it comes back."""

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.bagel import port as bagel_port
from omnirl.models.bagel.adapter import BagelAdapter, BagelSettings, bagel_sigmas, patchify, unpatchify
from omnirl.models.bagel.port import BagelModel, bfl_vae_state, load_official, load_vae, sincos_2d
from omnirl.models.base import SamplingParams
from omnirl.models.flow_sde import flow_step
from omnirl.ops.diffusion import Pair, pair_logprob
from tests.support_compare import (
    compiled_rollout_diffs,
    max_diff,
    packed_serial_diffs,
    perturb_lora,
    prompt_requests,
    tiny_config,
)
from tests.test_train import read_jsonl, torchrun

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["a red cat", "two dogs in the snow", "OPEN 24 HOURS", "a lighthouse"]
TARGETS = ["q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen"]
TARGETS += ["mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"]
SIZE, STEPS = 32, 6  # 16x16 latents (the tiny VAE downsamples 2x), 64 latent tokens


def make_adapter(path, finetune="lora", settings=None, **lora) -> BagelAdapter:
    cfg = tiny_config("bagel", path, **({"rank": 4, "alpha": 8.0, "target_modules": TARGETS} | lora))
    cfg.model.finetune = finetune
    cfg.family = settings or BagelSettings()
    return BagelAdapter(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def adapter(tiny_bagel):
    a = make_adapter(tiny_bagel)
    perturb_lora(a, 0.05)  # a LoRA that changes the velocity, so a test sees if it is skipped
    return a


def sde(**kw) -> SamplingParams:
    base = dict(height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=4.0, noise_level=0.7,
                sde_type="sde", sde_window_size=2, sde_window_range=(0, 5))  # fmt: skip
    return SamplingParams(**(base | kw))


def requests(params, prompts=PROMPTS, first=0):
    return prompt_requests(params, prompts, [""] * len(prompts), first)


# ------------------------------------------------------------------------------ the reference forward


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rotate(x, pos, theta=1e6):
    """RoPE of x [T, heads, hd] at positions pos [T] (rotate-half layout, as Qwen2)."""
    hd = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    angle = pos.float()[:, None] * freqs[None]  # [T, hd/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_layer(sd, i, x, gen, pos, past_k, past_v, causal, heads=4, kv_heads=2):
    """One MoT layer for one sequence x [T, D]: token t uses the `_moe_gen` weights where gen[t]."""

    def w(name, t):
        return sd[f"layers.{i}.{name.replace('#', '_moe_gen' if gen[t] else '')}"]

    def per_token(fn):
        return torch.stack([fn(t) for t in range(len(x))])

    def linear(name, inp, t, bias=True):
        out = inp @ w(f"{name}.weight", t).T
        return out + w(f"{name}.bias", t) if bias else out

    h = per_token(lambda t: rms(x[t], w("input_layernorm#.weight", t)))
    hd = h.shape[-1] // heads
    q = per_token(
        lambda t: rms(linear("self_attn.q_proj#", h[t], t).view(heads, hd), w("self_attn.q_norm#.weight", t))
    )
    k = per_token(
        lambda t: rms(
            linear("self_attn.k_proj#", h[t], t).view(kv_heads, hd), w("self_attn.k_norm#.weight", t)
        )
    )
    v = per_token(lambda t: linear("self_attn.v_proj#", h[t], t).view(kv_heads, hd))
    q, k = rotate(q, pos), rotate(k, pos)
    keys, values = torch.cat([past_k, k]), torch.cat([past_v, v])  # [L + T, kv, hd]
    group = heads // kv_heads
    out = torch.zeros(len(x), heads, hd)
    for t in range(len(x)):
        for head in range(heads):
            scores = keys[:, head // group] @ q[t, head] / math.sqrt(hd)
            if causal:
                scores[len(past_k) + t + 1 :] = -float("inf")
            out[t, head] = torch.softmax(scores, 0) @ values[:, head // group]
    out = out.reshape(len(x), -1)
    x = x + per_token(lambda t: linear("self_attn.o_proj#", out[t], t, bias=False))

    def mlp(t):
        y = rms(x[t], w("post_attention_layernorm#.weight", t))
        gate, up = linear("mlp#.gate_proj", y, t, bias=False), linear("mlp#.up_proj", y, t, bias=False)
        return linear("mlp#.down_proj", torch.nn.functional.silu(gate) * up, t, bias=False)

    return x + per_token(mlp), k, v


def reference_context(sd, ids, layers=2):
    """The keys and values [layers, 2, kv, L, hd] of one prompt's ids [L], understanding copy, causal."""
    x, pos, kvs = sd["embed_tokens.weight"][ids], torch.arange(len(ids)), []
    empty = torch.zeros(0, 2, 8)
    for i in range(layers):
        x, k, v = reference_layer(sd, i, x, [False] * len(ids), pos, empty, empty, causal=True)
        kvs.append(torch.stack([k.transpose(0, 1), v.transpose(0, 1)]))
    return torch.stack(kvs)


def reference_velocity(sd, tokens, sigma, pos_ids, marks, context, layers=2):
    """One sample's velocity [S, 64]: marks and latents at the RoPE position after its context."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half).float() / half)
    t_emb = torch.cat([torch.cos(sigma * freqs), torch.sin(sigma * freqs)])
    t_emb = (
        sd["time_embedder.mlp.2.weight"]
        @ torch.nn.functional.silu(sd["time_embedder.mlp.0.weight"] @ t_emb + sd["time_embedder.mlp.0.bias"])
        + sd["time_embedder.mlp.2.bias"]
    )
    lat = tokens @ sd["vae2llm.weight"].T + sd["vae2llm.bias"] + t_emb + sd["latent_pos_embed"][pos_ids]
    x = torch.cat([sd["embed_tokens.weight"][marks[:1]], lat, sd["embed_tokens.weight"][marks[1:]]])
    gen = [False] + [True] * len(tokens) + [False]
    pos = torch.full((len(x),), context.shape[3])
    for i in range(layers):
        past_k, past_v = context[i, 0].transpose(0, 1), context[i, 1].transpose(0, 1)  # [L, kv, hd]
        x, _, _ = reference_layer(sd, i, x, gen, pos, past_k, past_v, causal=False)
    return rms(x[1:-1], sd["norm_moe_gen.weight"]) @ sd["llm2vae.weight"].T + sd["llm2vae.bias"]


def test_port_forward_equals_reference(tiny_bagel):
    """Two prompts of different lengths in one padded batch: each row's context and velocity equal the
    reference computed for that prompt alone; and a row with an empty context (the text-unconditional
    branch) equals the reference with none."""
    model = BagelModel.from_pretrained(tiny_bagel)
    sd = model.state_dict()
    ids = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    input_ids = torch.tensor([i + [0] * (7 - len(i)) for i in ids])
    mask = torch.tensor([[j < len(i) for j in range(7)] for i in ids])
    torch.manual_seed(0)
    tokens, sigma = torch.randn(2, 6, 64), torch.tensor([0.9, 0.3])
    pos_ids, marks = torch.tensor([0, 1, 2, 16, 17, 18]), torch.tensor([11, 12])
    with torch.no_grad():
        context = model(mode="context", input_ids=input_ids, attention_mask=mask)
        v = model(mode="velocity", tokens=tokens, sigma=sigma, position_ids=pos_ids, marks=marks,
                  context=context, context_mask=mask)  # fmt: skip
        empty = model(mode="velocity", tokens=tokens, sigma=sigma, position_ids=pos_ids, marks=marks,
                      context=context[..., :0, :], context_mask=mask[:, :0])  # fmt: skip
    for b, row in enumerate(ids):
        ref_ctx = reference_context(sd, torch.tensor(row))
        assert max_diff(context[b, ..., : len(row), :], ref_ctx) < 1e-5
        ref_v = reference_velocity(sd, tokens[b], sigma[b], pos_ids, marks, ref_ctx)
        assert max_diff(v[b], ref_v) < 1e-5
        ref_empty = reference_velocity(sd, tokens[b], sigma[b], pos_ids, marks, ref_ctx[..., :0, :])
        assert max_diff(empty[b], ref_empty) < 1e-5
    # The position table is the 2-D sin-cos one of the official code: column half, then row half.
    table = sincos_2d(8, 4)
    # (dim 8: each half is [sin, sin, cos, cos] over frequencies 1 and 1e-2; patch row 1, column 2)
    assert torch.allclose(table[1 * 4 + 2, [0, 2]], torch.tensor([math.sin(2), math.cos(2)]))
    assert torch.allclose(table[1 * 4 + 2, [4, 6]], torch.tensor([math.sin(1), math.cos(1)]))


def test_official_layout_maps_every_key(tiny_bagel, tmp_path):
    """Every key of ema.safetensors is ours or skipped on purpose, the loaded weights are the file's, and
    the autoencoder's BFL layout converts back to the same file; an extra or a missing key is an error
    naming it."""
    model = BagelModel.from_pretrained(tiny_bagel)
    ours = {bagel_port.official_name(k): v for k, v in model.state_dict().items()}
    with safe_open(tiny_bagel / "ema.safetensors", "pt") as f:
        keys = list(f.keys())
        skipped = [k for k in keys if k.startswith(bagel_port.SKIPPED_PREFIXES)]
        assert len(skipped) == 4 and set(keys) - set(skipped) == set(ours)
        assert all(torch.equal(f.get_tensor(k), ours[k]) for k in ours)
    vae_file = load_file(tiny_bagel / "ae.safetensors")
    round_trip = bfl_vae_state(load_vae(tiny_bagel / "ae.safetensors", torch.float32))
    assert round_trip.keys() == vae_file.keys()
    assert all(torch.equal(round_trip[k], vae_file[k]) for k in vae_file)

    weights = load_file(tiny_bagel / "ema.safetensors")
    extra = tmp_path / "extra.safetensors"
    save_file({**weights, "language_model.model.layers.0.mlp_moe_gen.extra.weight": torch.zeros(1)}, extra)
    with pytest.raises(ConfigError, match=re.escape("layers.0.mlp_moe_gen.extra.weight maps to no part")):
        load_official(extra, model, torch.float32)
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in weights.items() if k != "llm2vae.bias"}, missing)
    with pytest.raises(ConfigError, match="lacks llm2vae.bias"):
        load_official(missing, model, torch.float32)
    bad_vae = tmp_path / "ae.safetensors"
    save_file({**vae_file, "decoder.up.0.extra.weight": torch.zeros(1)}, bad_vae)
    with pytest.raises(ConfigError, match=re.escape("decoder.up.0.extra.weight maps to no part")):
        load_vae(bad_vae, torch.float32)


def test_random_weights_build_from_the_config(tiny_bagel):
    """model.weights random: the port is built from llm_config.json with random weights, the shapes the
    checkpoint's."""
    from omnirl.models import build_adapter

    cfg = tiny_config("bagel", tiny_bagel, rank=4, alpha=8.0, target_modules=TARGETS)
    cfg.family, cfg.model.weights = BagelSettings(), "random"
    built = build_adapter(cfg, torch.device("cpu")).policy.state_dict()
    loaded = BagelModel.from_pretrained(tiny_bagel).state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in built.items() if "lora_" not in k}
    assert base.keys() == loaded.keys() and all(base[k].shape == v.shape for k, v in loaded.items())
    assert not torch.equal(
        base["layers.0.self_attn.q_proj_moe_gen.weight"], loaded["layers.0.self_attn.q_proj_moe_gen.weight"]
    )


def test_bad_paths(tmp_path):
    assert get_adapter("bagel") is BagelAdapter
    with pytest.raises(ConfigError, match="is not a directory"):
        make_adapter(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="has no llm_config.json"):
        make_adapter(tmp_path)


def test_lora_binds_generation_modules_only(tiny_bagel, adapter):
    """7 targets x 2 layers; a target list that binds nothing, or an understanding module, is refused."""
    assert adapter.lora_count == 14
    assert len(adapter.trainable_parameters()) == 28  # A and B of each
    with pytest.raises(ConfigError, match="bind no module"):
        make_adapter(tiny_bagel, target_modules=["to_q", "to_k"])  # another family's names
    with pytest.raises(ConfigError, match="understanding pathway"):
        make_adapter(tiny_bagel, target_modules=["q_proj"])  # the understanding copy's q_proj too


def test_full_finetune_trains_the_generation_pathway_only(tiny_bagel):
    a = make_adapter(tiny_bagel, finetune="full")
    trained = {n for n, p in a.policy.named_parameters() if p.requires_grad}
    assert trained and all(
        "_moe_gen" in n or n.startswith(("time_embedder", "vae2llm", "llm2vae")) for n in trained
    )
    assert "layers.0.self_attn.q_proj_moe_gen.weight" in trained and "embed_tokens.weight" not in trained
    assert not a.policy.layers[0].self_attn.q_proj.weight.requires_grad


# -------------------------------------------------------------------------------------- the sampler


def test_schedule_rollout_and_trainer_same_length_and_values(adapter):
    """BAGEL's linspace(1, 0, N) holds N points, N - 1 steps: num_steps steps take num_steps + 1 points. The
    rollout's trajectories carry that schedule, which the trainer reads back (a schedule one step shorter in
    the rollout than in the trainer biased every log-prob)."""
    n = STEPS
    official = torch.linspace(1, 0, n + 1)
    official = 3 * official / (1 + 2 * official)
    sigmas = bagel_sigmas(n, 3.0)
    assert len(sigmas) == n + 1 and max_diff(sigmas, official) < 1e-7 and sigmas[-1] == 0
    trajs = adapter.rollout(requests(sde())[:2])
    for t in trajs:
        assert torch.equal(t.sigmas, sigmas)
    with torch.no_grad():
        pairs = [Pair(t, k, 1.0) for t in trajs for k in range(2)]
        recomputed = pair_logprob(adapter, pairs, sde()).logprob
    assert max_diff(recomputed, torch.stack([p.traj.logprobs[p.k] for p in pairs])) < 1e-5
    # The same transitions scored on a schedule one step shorter are off by far more than 1e-5.
    short = bagel_sigmas(n - 1, 3.0)
    steps = torch.stack([p.traj.step_indices[p.k] for p in pairs])
    x, nxt = (
        torch.stack([p.traj.latents[p.k] for p in pairs]),
        torch.stack([p.traj.next_latents[p.k] for p in pairs]),
    )
    with torch.no_grad():
        emb = adapter.batch_embeds([p.traj.embeds for p in pairs])
        v = adapter.velocity(x, short[steps], emb, 4.0)
    out = flow_step(v, x, short[steps], short[steps + 1], float(short[1]), 0.7, "sde", prev_sample=nxt)
    assert max_diff(out.logprob, recomputed) > 1e-3


def test_cfg_is_three_branch_with_renormalisation(tiny_bagel):
    """The guided velocity equals the formula computed here from separate conditional and empty-context
    forwards, per sample, with the interval and the image scale."""
    a = make_adapter(tiny_bagel, settings=BagelSettings(cfg_image_scale=1.5, cfg_interval=[0.4, 1.0]))
    torch.manual_seed(1)
    latents, sigmas = torch.randn(3, 16, 8, 8), torch.tensor([0.95, 0.6, 0.3])  # the last outside
    ctx, mask = a.batch_embeds([{"context": c} for c in a.encode(PROMPTS[:3])]).values()
    with torch.no_grad():
        v = a.velocity(latents, sigmas, {"context": ctx, "context_mask": mask}, 4.0)
        v_cond = a.velocity(latents, sigmas, {"context": ctx, "context_mask": mask}, 1.0)
        v_unc = a.velocity(latents, sigmas, {"context": ctx[..., :0, :], "context_mask": mask[:, :0]}, 1.0)
    for b in range(3):
        if b == 2:
            assert max_diff(v[b], v_cond[b]) < 1e-6  # 6 rows in the forward vs 3: rounding only
            continue
        v_text = v_unc[b] + 4.0 * (v_cond[b] - v_unc[b])
        expected = v_cond[b] + 1.5 * (v_text - v_cond[b])
        expected = expected * (v_cond[b].norm() / (expected.norm() + 1e-8)).clamp(0, 1)
        assert max_diff(v[b], expected) < 1e-5
        assert v[b].norm() <= v_cond[b].norm() * (1 + 1e-5)


def test_quadratic_logprob_gives_the_same_ratios(adapter):
    """flow_grpo's BAGEL keeps only -(x' - mean)^2 / (2 std^2); flow_step's log-density differs from it by a
    term of the sigmas and noise level alone, so two policies' ratio is the same under both."""
    torch.manual_seed(2)
    x, nxt = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)
    s, s_next = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.4])
    gaps = []
    for v in (torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)):
        out = flow_step(v, x, s, s_next, 0.95, 0.7, "sde", prev_sample=nxt)
        quadratic = (-((nxt - out.mean) ** 2) / (2 * out.std.view(-1, 1, 1, 1) ** 2)).mean(dim=(1, 2, 3))
        gaps.append(out.logprob - quadratic)
    assert max_diff(gaps[0], gaps[1]) < 1e-5


@pytest.mark.slow
def test_packed_rollout_equals_serial(adapter):
    """Packed: 4 prompts of different context lengths, padded and masked, CFG fused. Serial: one request at
    a time, its two branches as two forwards."""
    packed = adapter.rollout(requests(sde()))
    serial = [adapter.rollout([r])[0] for r in requests(sde(fused_cfg=False))]
    assert len({t.embeds["context"].shape[3] for t in packed}) == 4  # stored unpadded
    assert len({int(t.step_indices[0]) for t in packed}) > 1
    d_latents, d_logprobs = packed_serial_diffs(packed, serial, shape=(16, 16, 16))
    print(f"packed vs serial: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_compiled_rollout_equals_eager_without_recompiling(adapter, monkeypatch):
    """`generation.compile`: the MoT layers trace whole (fullgraph), once per shape, and the compiled
    rollout is the eager one."""
    graphs, d_latents, d_logprobs = compiled_rollout_diffs(adapter, lambda: requests(sde()), 4, monkeypatch)
    print(f"compiled ({graphs} graphs) vs eager: latents {d_latents:.2e}, logprobs {d_logprobs:.2e}")
    assert graphs > 0 and d_latents < 1e-5 and d_logprobs < 1e-5


@pytest.mark.slow
def test_recomputed_logprob_equals_rollout(adapter):
    """A trainer micro-batch mixes two rollouts' rows, contexts re-padded to the micro-batch's longest; the
    same with the padding unmasked is off by far more than 1e-5 (a padded prompt must attend as alone)."""
    trajs = adapter.rollout(requests(sde())[:2]) + adapter.rollout(requests(sde(), PROMPTS[2:], first=2))
    pairs = [Pair(t, k, 1.0) for t in trajs for k in range(2)]
    recorded = torch.stack([p.traj.logprobs[p.k] for p in pairs])
    with torch.no_grad():
        lp = pair_logprob(adapter, pairs, sde()).logprob
    print(f"trainer vs rollout log-prob: max {max_diff(lp, recorded):.2e}")
    assert max_diff(lp, recorded) < 1e-5
    emb = adapter.batch_embeds([p.traj.embeds for p in pairs])
    unmasked = {"context": emb["context"], "context_mask": torch.ones_like(emb["context_mask"])}
    steps = torch.stack([p.traj.step_indices[p.k] for p in pairs])
    sig = trajs[0].sigmas
    x = torch.stack([p.traj.latents[p.k] for p in pairs])
    with torch.no_grad():
        v = adapter.velocity(x, sig[steps], unmasked, 4.0)
    nxt = torch.stack([p.traj.next_latents[p.k] for p in pairs])
    out = flow_step(v, x, sig[steps], sig[steps + 1], float(sig[1]), 0.7, "sde", prev_sample=nxt)
    assert max_diff(out.logprob, recorded) > 1e-4


# ------------------------------------------------------------------------- the silent bugs, one each


def test_no_trajectory_dropped(adapter):
    """One trajectory per request, in the requests' order, each of its own request."""
    reqs = requests(sde(num_steps=3, sde_window_range=(0, 2)))
    trajs = adapter.rollout(reqs)
    assert len(trajs) == len(reqs) and all(t.request is r for t, r in zip(trajs, reqs))


def test_noise_is_drawn_on_the_host_from_the_seed(adapter):
    """The initial latents are the host's standard normal draw of the request's seed (as an official run
    with that seed), whatever device the model runs on: a window from step 0 records them."""
    reqs = requests(sde(num_steps=3, sde_window_size=0))[:2]
    trajs = adapter.rollout(reqs)
    for t, r in zip(trajs, reqs):
        expected = torch.randn((16, 16, 16), generator=torch.Generator("cpu").manual_seed(r.seed))
        assert torch.equal(t.latents[0], expected)


def test_train_mode_and_checkpointing_follow_the_grad_state(tiny_bagel, monkeypatch):
    """The forward is the same in train and eval mode (no mode-dependent path), gradient checkpointing runs
    only where gradients are computed, and gives the gradients of the plain forward."""
    a = make_adapter(tiny_bagel, finetune="full")
    torch.manual_seed(3)
    latents, sigmas = torch.randn(2, 16, 8, 8), torch.tensor([0.9, 0.7])
    emb = a.batch_embeds([{"context": c} for c in a.encode(PROMPTS[:2])])
    calls = []
    real = bagel_port.checkpoint
    monkeypatch.setattr(bagel_port, "checkpoint", lambda *x, **k: calls.append(1) or real(*x, **k))

    def grads(train: bool, ckpt: bool):
        a.policy.train(train)
        a.policy.gradient_checkpointing = ckpt
        a.policy.zero_grad()
        v = a.velocity(latents, sigmas, emb, 4.0)
        v.square().mean().backward()
        return v.detach(), torch.cat([p.grad.flatten() for p in a.trainable_parameters()])

    v_eval, g_eval = grads(False, False)
    v_train, g_train = grads(True, False)
    assert not calls and max_diff(v_eval, v_train) == 0 and max_diff(g_eval, g_train) == 0
    v_ckpt, g_ckpt = grads(True, True)
    assert calls and max_diff(v_ckpt, v_eval) < 1e-6 and max_diff(g_ckpt, g_eval) < 1e-6
    calls.clear()
    with torch.no_grad():
        a.velocity(latents, sigmas, emb, 4.0)
    assert not calls


def test_prompt_has_one_im_start_im_end_pair(adapter):
    """The context is <|im_start|> prompt <|im_end|>, each once: the tokenizer adds none of its own."""
    ids = adapter.prompt_ids("a red cat")
    start, end = adapter.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == start and ids[-1] == end and ids.count(start) == 1 and ids.count(end) == 1
    assert ids[1:-1] == adapter.tokenizer("a red cat").input_ids


def test_vae_decode_in_its_own_dtype(adapter):
    """Float32 latents decode through a bfloat16 VAE (cast to its dtype, de-normalised z / scale + shift)
    to the float32 decode within bfloat16 rounding."""
    torch.manual_seed(4)
    latents = torch.randn(2, 16, 16, 16)
    images = torch.stack(adapter.decode(latents))
    config = adapter.vae.config
    with torch.no_grad():
        ref = adapter.vae.decode(latents / config.scaling_factor + config.shift_factor).sample
    assert max_diff(images, (ref * 0.5 + 0.5).clamp(0, 1)) < 1e-6
    adapter.vae.to(torch.bfloat16)
    try:
        half = torch.stack(adapter.decode(latents))
    finally:
        adapter.vae.to(torch.float32)
    assert half.dtype == torch.float32 and max_diff(half, images) < 0.05


@pytest.mark.slow
def test_exported_lora_merges_into_the_official_layout(adapter, tmp_path):
    """The exported peft LoRA (official module names) fused into the checkpoint gives the LoRA model's
    velocity; the merged directory loads as a BAGEL checkpoint."""
    adapter.export_lora(tmp_path / "lora")
    lora = load_file(tmp_path / "lora/adapter_model.safetensors")
    assert len(lora) == 28 and all(
        k.startswith("base_model.model.language_model.model.layers.") for k in lora
    )
    BagelAdapter.merge_lora(adapter.model_path, tmp_path / "lora", tmp_path / "merged", torch.float32)
    merged = make_adapter(tmp_path / "merged")
    torch.manual_seed(5)
    latents, sigmas = torch.randn(2, 16, 8, 8), torch.tensor([0.9, 0.5])
    emb = adapter.batch_embeds([{"context": c} for c in adapter.encode(PROMPTS[:2])])
    with torch.no_grad():
        with merged.lora_disabled():
            v_merged = merged.velocity(latents, sigmas, emb, 4.0)
        v_lora = adapter.velocity(latents, sigmas, emb, 4.0)
        with adapter.lora_disabled():
            v_base = adapter.velocity(latents, sigmas, emb, 4.0)
    assert max_diff(v_merged, v_lora) < 1e-5 and max_diff(v_base, v_lora) > 1e-3


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_fsdp(tiny_bagel, tmp_path):
    out = tmp_path / "run"
    r = torchrun(2, ROOT / "yaml/bagel_tiny_flowgrpo.yaml", "--model.path", str(tiny_bagel),
                 "--run.output_dir", str(out), "--run.steps", "2")  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["train/updates"] == 1 and m["train/grad_norm"] > 0 for m in metrics), metrics
    lora = load_file(out / "lora/adapter_model.safetensors")
    assert len(lora) == 7 * 2 * 2  # 7 targets x 2 layers, A and B
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)
    assert "Traceback" not in r.stderr
    # The full fine-tune of the generation pathway, its frozen understanding copy in the same FSDP2 units.
    full = tmp_path / "full"
    torchrun(2, ROOT / "yaml/bagel_tiny_flowgrpo.yaml", "--model.path", str(tiny_bagel), "--model.finetune",
             "full", "--optim.lr", "1e-4", "--run.output_dir", str(full), "--run.steps", "1")  # fmt: skip
    (row,) = read_jsonl(full / "metrics.jsonl")
    assert row["train/updates"] == 1 and row["train/grad_norm"] > 0


def test_patchify_round_trip():
    x = torch.randn(2, 16, 8, 6)
    tokens = patchify(x)
    assert tokens.shape == (2, 12, 64) and torch.equal(unpatchify(tokens, 8, 6), x)
    # token 0 holds latent pixels (0,0), (0,1), (1,0), (1,1), each its 16 channels
    assert torch.equal(tokens[0, 0, :16], x[0, :, 0, 0]) and torch.equal(tokens[0, 0, 16:32], x[0, :, 0, 1])
    assert torch.equal(tokens[0, 0, 32:48], x[0, :, 1, 0])
