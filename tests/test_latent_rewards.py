"""Rewards on latents and PickScore: DiNa-LRM in process on the tiny SD3 against a separate merged copy of
its blocks, the policy left untouched by scoring, the rollout that skips the decode, the checkpoint's key
checks, and PickScore against CLIPModel's own computation."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from safetensors.torch import load_file, save_file

from omnirl import distributed as D
from omnirl.data.prompts import load_prompts
from omnirl.distributed import derive_seed
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import Latent, Output
from omnirl.ops.diffusion import DiffusionOps
from omnirl.recipe import load_config
from omnirl.rewards import reward_inputs, reward_modules
from omnirl.rewards.dina_lrm import (
    ADAPTER,
    HEAD,
    LORA_DIR,
    LORA_FILE,
    NOISE_STREAM,
    NOISE_U,
    Backbone,
    DinaLRM,
    RewardHead,
)
from omnirl.rewards.pool import RewardPool
from omnirl.scoring import rollout_and_score
from omnirl.testing.rewards import make_tiny_dina_lrm, make_tiny_pickscore


@pytest.fixture(scope="module")
def tiny_dina(tmp_path_factory):
    return make_tiny_dina_lrm(tmp_path_factory.mktemp("dina") / "dina_lrm")


def cfg_for(tiny_sd3, tmp_path, dina, *overrides):
    return load_config(
        "sd3_tiny_flowgrpo_dinalrm",
        ["--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "out"),
         "--reward.paths.dina_lrm", str(dina), *overrides],
    )  # fmt: skip


def samples(adapter, n: int = 3) -> list[Latent]:
    embeds = adapter.encode([f"prompt {i}" for i in range(n)], None)
    g = torch.Generator().manual_seed(1)
    return [
        Latent(torch.randn(4, 16, 16, generator=g), {k: v[i].cpu() for k, v in embeds.items()}, 100 + i)
        for i in range(n)
    ]


def reference_scores(tiny_sd3, dina, latents: list[Latent]) -> torch.Tensor:
    """The published model's computation written out on a separate copy: the transformer's embedders and
    first block with the reward's LoRA merged (peft's own loading of the saved adapter), the head loaded
    from rm_head.pt, the latent re-noised with the request-seeded noise at the sigma nearest u = 0.4."""
    model = json.loads((dina / "config.json").read_text())["model"]
    transformer = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer")
    backbone = peft.PeftModel.from_pretrained(
        Backbone(transformer, 1), str(dina / LORA_DIR)
    ).merge_and_unload()
    head = RewardHead(64, len(model["visual_head_idx"]), len(model["text_head_idx"]), model["reward_head"])
    head.load_state_dict(torch.load(dina / HEAD, weights_only=True))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_sd3, subfolder="scheduler")
    at = int((scheduler.sigmas - NOISE_U).abs().argmin())
    sigma, timestep = scheduler.sigmas[at], scheduler.timesteps[at]
    seeds = [derive_seed(s.seed, NOISE_STREAM, 0) for s in latents]
    noise = torch.stack([torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(s)) for s in seeds])
    x = (1 - sigma) * torch.stack([s.latents for s in latents]) + sigma * noise
    with torch.no_grad():
        temb = backbone.time_text_embed(
            timestep.expand(len(latents)), torch.stack([s.embeds["pooled_prompt_embeds"] for s in latents])
        )
        context = backbone.context_embedder(torch.stack([s.embeds["prompt_embeds"] for s in latents]))
        hidden = backbone.pos_embed(x)
        visual = [hidden]  # visual_head_idx [0, 1], text_head_idx [1]
        context, hidden = backbone.transformer_blocks[0](hidden, context, temb)
        raw = head(visual + [hidden], [context], temb)[:, 0]
    return (raw + 10) / 10


def flags(policy, ours: set[str]) -> dict[str, bool]:
    """requires_grad of the policy's own parameters, by their names before the reward's injection."""
    return {
        n.replace(".base_layer", ""): p.requires_grad for n, p in policy.named_parameters() if n not in ours
    }


@pytest.mark.slow
def test_dina_lrm_in_process_equals_a_merged_copy_and_leaves_the_policy_alone(tiny_sd3, tiny_dina, tmp_path):
    cfg = cfg_for(tiny_sd3, tmp_path, tiny_dina)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    policy = adapter.policy
    with torch.no_grad():  # a policy LoRA that changes the blocks, so that leaving it on would show
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    embeds = adapter.encode(["a", "b"], None)
    sigmas = torch.tensor([0.7, 0.4])
    before = adapter.velocity(x, sigmas, embeds, 1.0).detach()
    trainable = flags(policy, set())

    reward = DinaLRM(str(tiny_dina), adapter, cfg)
    # The reward's LoRA is a second adapter in the policy: frozen, off in the policy's own forward.
    ours = {n for n, _ in policy.named_parameters() if ADAPTER in n}
    assert ours and not any(p.requires_grad for n, p in policy.named_parameters() if n in ours)
    assert not ours & {n for n, p in policy.named_parameters() if p in set(adapter.trainable_parameters())}
    assert flags(policy, ours) == trainable
    assert torch.equal(adapter.velocity(x, sigmas, embeds, 1.0).detach(), before)
    assert reward_modules(reward) == [reward.head]  # the head sleeps in training; the policy's blocks do not

    # A gradient in flight on the policy's LoRA (as during an update) is not touched by scoring.
    adapter.velocity(x, sigmas, embeds, 1.0).square().mean().backward()
    params = {n: p.detach().clone() for n, p in policy.named_parameters()}
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all(ADAPTER not in n for n in grads)  # the reward's LoRA never gets a gradient

    latents = samples(adapter)
    scores = torch.tensor(reward(latents, ["a"] * 3, [{}] * 3))
    expected = reference_scores(tiny_sd3, tiny_dina, latents)
    print(f"in-process vs merged reference: max |diff| {(scores - expected).abs().max():.2e}")
    assert (scores - expected).abs().max() < 1e-5
    assert len(set(scores.tolist())) == 3
    assert reward(latents, ["a"] * 3, [{}] * 3) == scores.tolist()  # the same samples score the same
    # alone or in a batch: the same noise (batched kernels round differently, docs/architecture.md)
    assert reward(latents[1:2], ["a"], [{}]) == pytest.approx(scores.tolist()[1:2], abs=1e-6)

    assert all(torch.equal(p, params[n]) for n, p in policy.named_parameters())
    assert all(torch.equal(p.grad, grads[n]) for n, p in policy.named_parameters() if n in grads)
    assert {n for n, p in policy.named_parameters() if p.grad is not None} == set(grads)
    assert flags(policy, ours) == trainable
    assert torch.equal(adapter.velocity(x, sigmas, embeds, 1.0).detach(), before)


def test_dina_lrm_with_full_finetuning_scores_a_frozen_copy(tiny_sd3, tiny_dina, tmp_path):
    cfg = cfg_for(tiny_sd3, tmp_path, tiny_dina, "--model.finetune", "full")
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    names = {n for n, _ in adapter.policy.named_parameters()}
    reward = DinaLRM(str(tiny_dina), adapter, cfg)
    assert {n for n, _ in adapter.policy.named_parameters()} == names  # nothing injected into the policy
    assert reward_modules(reward) == [reward.head, reward.copy]
    assert not any(p.requires_grad for p in reward.copy.parameters())
    latents = samples(adapter)
    expected = reference_scores(tiny_sd3, tiny_dina, latents)
    with torch.no_grad():  # training the policy does not move the copy's score
        for p in adapter.policy.transformer_blocks[0].parameters():
            p.add_(0.1)
    scores = torch.tensor(reward(latents, ["a"] * 3, [{}] * 3))
    assert (scores - expected).abs().max() < 1e-5


@pytest.mark.parametrize("change", ["head_missing", "head_extra", "lora_missing", "lora_extra"])
def test_dina_lrm_checkpoint_with_a_missing_or_extra_key_fails_naming_it(tiny_sd3, tmp_path, change):
    dina = make_tiny_dina_lrm(tmp_path / "dina")
    if change.startswith("head"):
        state = torch.load(dina / HEAD, weights_only=True)
        key = "attn1.to_q.bias" if change == "head_missing" else "attn2.to_k_text.weight"
        if change == "head_missing":
            del state[key]
        else:
            state[key] = torch.zeros(1)
        torch.save(state, dina / HEAD)
    else:
        file = dina / LORA_DIR / LORA_FILE
        state = load_file(file)
        key = "base_model.model.transformer_blocks.0.attn.to_k.lora_B.weight"
        if change == "lora_missing":
            del state[key]
        else:
            key = "base_model.model.transformer_blocks.1.attn.to_k.lora_A.weight"  # beyond the first block
            state[key] = torch.zeros(8, 64)
        save_file(state, file)
    cfg = cfg_for(tiny_sd3, tmp_path, dina)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        DinaLRM(str(dina), adapter, cfg)
    what = "missing key" if change.endswith("missing") else "unexpected key"
    assert str(e.value).count("\n") == 0 and what in str(e.value) and repr(key) in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="reward.paths.dina_lrm.*lacks config.json"):
        DinaLRM(str(tmp_path / "nowhere"), adapter, cfg)


@pytest.mark.slow
def test_latent_only_rollout_runs_no_decode_and_logging_decodes_what_it_shows(tiny_sd3, tiny_dina, tmp_path):
    cfg = cfg_for(tiny_sd3, tmp_path, tiny_dina, "--rollout.prompts_per_step", "2", "--rollout.group_size",
                  "3", "--log.image_every", "2")  # fmt: skip
    dist = D.init_distributed()
    adapter = get_adapter("sd3")(cfg, dist.device)
    decodes = []
    vae_decode = adapter.vae.decode
    adapter.vae.decode = lambda z, **kw: decodes.append(len(z)) or vae_decode(z, **kw)
    pool = RewardPool(cfg.reward.weights, 1, 60, cfg.reward.paths, adapter=adapter, cfg=cfg)
    ops = DiffusionOps(cfg, adapter)
    assert not ops.params.decode and not ops.validation_params().decode
    rows = load_prompts(cfg.data.train_path)
    trajs, per_reward = rollout_and_score(ops, pool, ops.requests(rows, 1, dist))  # not a logging step
    assert decodes == []
    assert all(t.output.image is None and t.output.latent is not None for t in trajs)
    assert all(t.output.latent.latents.data_ptr() == t.final_latents.data_ptr() for t in trajs)  # no copy
    # The scores are the reward's own on the trajectories' latents and conditioning.
    direct = DinaLRM.__call__(pool.rewards["dina_lrm"], reward_inputs([t.output for t in trajs], "latent"),
                              [t.request.prompt for t in trajs], [{}] * len(trajs))  # fmt: skip
    assert per_reward["dina_lrm"].tolist() == direct == [t.reward for t in trajs]

    trajs, _ = rollout_and_score(ops, pool, ops.requests(rows, 2, dist))  # a logging step shows 6 samples
    assert decodes == [6]
    assert all(t.output.image is not None for t in trajs)
    with pytest.raises(ValueError, match="sample 0 has no image output"):
        reward_inputs([Output(latent=trajs[0].output.latent)], "image")

    cfg = load_config(
        "sd3_tiny_flowgrpo", ["--model.path", str(tiny_sd3), "--run.output_dir", str(tmp_path / "j")]
    )
    assert DiffusionOps(cfg, adapter).params.decode  # a pixel reward: the rollout decodes
    pool.close()


def test_pickscore_equals_clip_models_own_score(tmp_path):
    """PickScore = logit_scale x cosine / 26: CLIPModel's own logits_per_image (its logit scale times the
    cosine of its projected embeddings), divided by 26, on a tiny random model of the real classes."""
    from transformers import CLIPModel, CLIPProcessor

    from omnirl.rewards.pickscore import PickScore

    path = make_tiny_pickscore(tmp_path / "pickscore")
    with pytest.raises(ConfigError, match="reward.paths.pickscore"):
        PickScore(str(tmp_path))
    reward = PickScore(str(path))
    reward.batch_size = 2  # two chunks and a remainder
    g = torch.Generator().manual_seed(0)
    outputs = [Output(image=torch.rand(3, 40, 48, generator=g)) for _ in range(5)]
    prompts = ["a red cat", "waves at night", "a red cat", "x" * 200, "an old tree"]
    scores = reward(reward_inputs(outputs, "image"), prompts, [{}] * 5)

    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = processor(text=prompts, images=reward_inputs(outputs, "image"), padding=True, truncation=True,
                       max_length=77, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        expected = model(**inputs).logits_per_image.diagonal() / 26
    assert torch.allclose(torch.tensor(scores), expected, atol=1e-5), (scores, expected)
    assert len(set(scores)) == 5
    assert reward_modules(reward) == [reward.model]  # asleep during training


def test_pool_scores_latent_rewards_in_the_callers_thread_after_generation(tiny_sd3, tiny_dina, tmp_path):
    cfg = cfg_for(tiny_sd3, tmp_path, tiny_dina)
    adapter = get_adapter("sd3")(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="'dina_lrm' reads latents"):
        RewardPool({"dina_lrm": 1.0}, 1, 60, cfg.reward.paths)
    pool = RewardPool(
        {"dina_lrm": 2.0, "uniform_noise": 1.0}, 2, 60, cfg.reward.paths, adapter=adapter, cfg=cfg
    )
    latents = samples(adapter)
    outputs = [Output(latent=s) for s in latents]
    first = pool.submit(outputs[:2], ["a", "b"], [{}, {}])
    second = pool.submit(outputs[2:], ["c"], [{}])
    assert not any(j.future.done() for j in first.jobs + second.jobs if j.name == "dina_lrm")  # held
    pool.score_held()  # both batches in one call, here
    a, b = pool.result(first), pool.result(second)
    alone = pool.rewards["dina_lrm"](latents, ["a", "b", "c"], [{}] * 3)
    assert a.per_reward["dina_lrm"].tolist() + b.per_reward["dina_lrm"].tolist() == alone
    assert a.total.tolist() == pytest.approx(
        (2 * a.per_reward["dina_lrm"] + a.per_reward["uniform_noise"]).tolist()
    )
    pool.score_held()  # nothing held: an empty call, as a rank with no samples makes
    pool.close()


@pytest.fixture(scope="module")
def dinalrm_run(tiny_sd3, tiny_dina, tmp_path_factory):
    """12 steps of sd3_tiny_flowgrpo_dinalrm on 2 ranks, the frozen base replicated: its output directory
    and torchrun's stderr. The learning test reads all of it, the placement test its first 2 steps."""
    from tests.test_train import ROOT, torchrun

    out = tmp_path_factory.mktemp("dinalrm") / "run"
    r = torchrun(2, ROOT / "yaml/sd3_tiny_flowgrpo_dinalrm.yaml", "--model.path", str(tiny_sd3),
                 "--reward.paths.dina_lrm", str(tiny_dina), "--run.output_dir", str(out), "--run.steps", "12",
                 "--log.image_every", "11", timeout=1200)  # fmt: skip
    return out, r.stderr


@pytest.mark.slow
def test_tiny_dinalrm_recipe_learns_under_torchrun(dinalrm_run):
    """sd3_tiny_flowgrpo_dinalrm on 2 ranks (FSDP, the reward's LoRA in the replicated frozen base): the
    reward scored in process rises. Measured on 2 CPU cores over 60 steps: 0.76 (mean of steps 0-9) ->
    3.32 (steps 50-59); the mean of steps 9-11 is held above that of steps 0-2 by 0.3 (measured: +0.75)."""
    from tests.test_train import read_jsonl

    out, stderr = dinalrm_run
    metrics = read_jsonl(out / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    print("reward/mean by step:", [round(x, 3) for x in rewards])
    assert all(m["train/updates"] == 1 for m in metrics)
    assert sum(rewards[9:12]) / 3 > sum(rewards[:3]) / 3 + 0.3
    assert (out / "samples/step_000011.png").is_file()  # the logging step decoded what it shows
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_tiny_pickscore_recipe_runs_under_torchrun(tiny_sd3, tmp_path):
    """sd3_tiny_flowgrpo_pickscore on 2 ranks: decoded images scored by the tiny PickScore, which sleeps
    during the update, and the LoRA updated each step."""
    from tests.test_train import ROOT, read_jsonl, torchrun

    out = tmp_path / "run"
    pickscore = make_tiny_pickscore(tmp_path / "pickscore")
    torchrun(2, ROOT / "yaml/sd3_tiny_flowgrpo_pickscore.yaml", "--model.path", str(tiny_sd3),
             "--reward.paths.pickscore", str(pickscore), "--run.output_dir", str(out), "--run.steps", "3",
             timeout=900)  # fmt: skip
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["train/updates"] == 1 for m in metrics)
    assert all(-1 < m["reward/mean"] < 1 and m["reward/std"] > 0 for m in metrics)
    assert metrics[-1]["mem/train_sleep_gib"] > 0  # the text encoders, the VAE and PickScore's CLIP


@pytest.mark.slow
def test_tiny_dinalrm_scores_the_same_with_the_frozen_base_sharded_or_offloaded(
    tiny_sd3, tiny_dina, dinalrm_run, tmp_path
):
    """The in-process reward on 2 ranks with the frozen base replicated, sharded with one unit gathered per
    forward (the reward's chunks padded to the same count on both ranks, the root's embedders gathered for
    it) and offloaded: the same samples, the same rewards (2 steps, to 1e-6). The replicated run is the
    first 2 steps of the learning test's (the learning rate is constant: no schedule over run.steps)."""
    from tests.test_train import ROOT, read_jsonl, torchrun

    rewards = {"replicate": [m["reward/mean"] for m in read_jsonl(dinalrm_run[0] / "metrics.jsonl")][:2]}
    placements = {
        "shard_unit": ["--distributed.frozen_base", "shard", "--distributed.rollout_gather", "unit"],
        "offload": ["--distributed.frozen_base", "offload"],
    }
    for name, placement in placements.items():
        out = tmp_path / name
        torchrun(2, ROOT / "yaml/sd3_tiny_flowgrpo_dinalrm.yaml", "--model.path", str(tiny_sd3),
                 "--reward.paths.dina_lrm", str(tiny_dina), "--run.output_dir", str(out), "--run.steps", "2",
                 *placement, timeout=900)  # fmt: skip
        rewards[name] = [m["reward/mean"] for m in read_jsonl(out / "metrics.jsonl")]
    assert len(rewards["shard_unit"]) == len(rewards["offload"]) == 2
    for name in ("shard_unit", "offload"):
        assert rewards[name] == pytest.approx(rewards["replicate"], abs=1e-6), (name, rewards)
