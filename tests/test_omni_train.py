"""The omni half of the training loop on the tiny Qwen3-Omni thinker taught the MMK12 answer format
(omnirl.testing.k12): GSPO + LoRA on the tiny MMK12 data, rewarded by the real mmk12 reward.

In process (one rank): an update moves the LoRA only; for the unchanged policy the trainer's token
log-probs equal the rollout's (fp32 on CPU: max |diff| <= 1e-5, Pearson >= 0.9999), in recompute and in
bypass mode; the non-finite guard; the KL reference; gradient checkpointing. Under torchrun (two ranks,
FSDP2): the recipe runs, resumes exactly, exports a LoRA that peft loads, and a rank whose groups all have
zero spread neither hangs nor biases the update.
"""

import json

import peft
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

from omnirl import distributed as D
from omnirl.algos.advantages import group_advantages
from omnirl.algos.losses import get_loss
from omnirl.data.mmk12 import load_mmk12
from omnirl.data.prompts import step_prompt_indices
from omnirl.errors import ConfigError
from omnirl.models import get_adapter
from omnirl.models.base import GenerationParams, Request
from omnirl.ops import check_before_loading
from omnirl.ops.omni import OmniOps, generation_params
from omnirl.recipe import load_config
from omnirl.rewards.pool import RewardPool
from omnirl.scoring import rollout_and_score
from omnirl.step import update
from tests.test_train import ROOT, read_jsonl, torchrun

RECIPE = ROOT / "yaml/mmk12_tiny.yaml"
DEVICE = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hidden-64 matmuls gain nothing from threads, and on 2 shared cores 2 threads were far slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def omni_cfg(model, tmp_path, *overrides):
    return load_config(
        "mmk12_tiny", ["--model.path", str(model), "--run.output_dir", str(tmp_path / "out"), *overrides]
    )


def random_lora(adapter):
    """peft starts B at 0 (LoRA off); a non-zero adapter puts the LoRA path into every number compared."""
    gen = torch.Generator().manual_seed(0)
    for p in adapter.trainable_parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.05


def rollout(cfg):
    """(adapter, ops, trajectories, per-reward scores, the pool's mmk12 reward) of step 0 on one rank."""
    adapter = get_adapter(cfg.model.adapter)(cfg, DEVICE)
    random_lora(adapter)
    ops = OmniOps(cfg, adapter)
    pool = RewardPool(cfg.reward.weights, 1, 120)
    try:
        requests = ops.requests(load_mmk12(cfg.data.train_path), 0, D.init_distributed())
        trajs, per = rollout_and_score(ops, pool, requests)
    finally:
        pool.close()
    return adapter, ops, trajs, per, pool.rewards["mmk12"]


def signed_rollout(cfg):
    """Step 0's rollout for an update of every sample, advantages alternating -1 / +1: (adapter, ops,
    trajectories, keep mask, the parameters before any update)."""
    adapter, ops, trajs, _, _ = rollout(cfg)
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 else -1.0
    keep = torch.ones(len(trajs), dtype=torch.bool)
    before = {n: p.detach().clone() for n, p in adapter.model.named_parameters()}
    return adapter, ops, trajs, keep, before


def steady(rows: list[dict]) -> list[dict]:
    """Metrics rows without the wall-clock and memory readings, which no two runs share."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


def lora_and_base(model):
    names = {n for n, _ in model.named_parameters()}
    return {n for n in names if "lora_" in n}, {n for n in names if "lora_" not in n}


@pytest.mark.slow
def test_update_moves_lora_only_and_recomputed_logprobs_match(tiny_qwen3_omni_thinker_k12, tmp_path):
    cfg = omni_cfg(
        tiny_qwen3_omni_thinker_k12, tmp_path,
        "--algo.correction", "tis", "--algo.kl_beta", "0.05", "--optim.micro_batch_tokens", "1200",
    )  # fmt: skip
    adapter, ops, trajs, per, mmk12 = rollout(cfg)
    assert len(trajs) == len(per["mmk12"]) == 16
    # The real reward graded these, math-verify included (its child process starts at the first free-form
    # answer it compares): the taught format makes well-formed answers the rule.
    assert mmk12._proc is not None
    assert sum("<answer>" in t.text for t in trajs) >= 8
    rewards = torch.tensor([t.reward for t in trajs])
    adv, keep, _ = group_advantages(rewards, torch.tensor([t.request.group_id for t in trajs]), 5.0, False)
    assert keep.any(), "no group with reward spread: the update would have nothing to learn from"
    for t, a in zip(trajs, adv.tolist()):
        t.advantage = a

    model = adapter.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)
    logs = update(cfg, ops, opt, trajs, keep, 0)

    # old_logprob recompute: the recompute pass (micro-batches of <= 1200 padded tokens, the same forward
    # as training) re-scores the unchanged policy; it must match what the rollout recorded.
    tokens = sum(len(t.response_ids) for t, k in zip(trajs, keep.tolist()) if k)
    print({k: v for k, v in logs.items() if k.startswith(("consistency/", "correction/", "loss/"))})
    assert logs["consistency/tokens"] == tokens
    assert logs["consistency/logprob_abs_diff_max"] <= 1e-5
    assert logs["consistency/prob_pearson"] >= 0.9999
    assert logs["correction/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert logs["correction/clip_frac"] == 0
    assert logs["loss/kl"] > 0  # the random LoRA moves the policy away from the base (LoRA off)
    assert logs["train/updates"] == cfg.optim.mini_batches and logs["train/skipped_nonfinite"] == 0

    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    lora, base = lora_and_base(model)
    assert moved <= lora, f"moved non-LoRA parameters: {moved - lora}"
    assert len(moved) >= len(lora) // 2
    assert all(torch.equal(model.get_parameter(n), before[n]) for n in base)


@pytest.mark.slow
def test_bypass_consistency_and_nonfinite_guard(tiny_qwen3_omni_thinker_k12, tmp_path):
    cfg = omni_cfg(
        tiny_qwen3_omni_thinker_k12, tmp_path, "--algo.old_logprob", "rollout", "--optim.mini_batches", "1"
    )
    adapter, ops, trajs, keep, before = signed_rollout(cfg)
    model = adapter.model
    opt = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2)

    good = float(trajs[3].logprobs[0])
    trajs[3].logprobs[0] = float("nan")  # a NaN behaviour log-prob: NaN ratio, loss and gradients
    logs = update(cfg, ops, opt, trajs, keep, 5)
    assert logs["train/skipped_nonfinite"] == 1 and "train/updates" not in logs
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    trajs[3].logprobs[0] = good
    logs = update(cfg, ops, opt, trajs, keep, 5)
    assert logs["train/updates"] == 1
    # Bypass mode measures the first mini-batch's forward, before its optimizer step.
    assert logs["consistency/tokens"] == sum(len(t.response_ids) for t in trajs)
    assert logs["consistency/logprob_abs_diff_max"] <= 1e-5
    assert logs["consistency/prob_pearson"] >= 0.9999
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.slow
def test_update_without_rollout_logprobs_is_the_same_update(tiny_qwen3_omni_thinker_k12, tmp_path):
    """A rollout that recorded no log-probs (rollout.vllm.logprobs false: the trajectories hold None) makes,
    in recompute mode without a correction, the update the recorded log-probs make: the same parameters
    after it; it logs no consistency metrics. A padding row without them stands in with zeros."""
    from omnirl.ops.omni import TokenRow, _old_logprobs

    cfg = omni_cfg(
        tiny_qwen3_omni_thinker_k12, tmp_path, "--algo.old_logprob", "recompute", "--optim.mini_batches", "2"
    )
    assert cfg.algo.correction == "none"
    adapter, ops, trajs, keep, start = signed_rollout(cfg)
    model = adapter.model

    logs = update(cfg, ops, torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2), trajs, keep, 0)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert logs["consistency/tokens"] > 0 and logs["train/updates"] == 2
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    for t in trajs:
        t.logprobs = None
    silent = update(cfg, ops, torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-2), trajs, keep, 0)
    assert silent["train/updates"] == 2 and not any(k.startswith("consistency/") for k in silent)
    assert any(not torch.equal(after[n], start[n]) for n in after)
    assert all(torch.equal(p, after[n]) for n, p in model.named_parameters())

    assert torch.equal(_old_logprobs(TokenRow(trajs[0], 0.0)), torch.zeros(len(trajs[0].response_ids)))
    with pytest.raises(AssertionError, match="without old log-probs"):
        _old_logprobs(TokenRow(trajs[0], 1.0))


def score(adapter, rows, length=12):
    """Token log-probs [2, length] of fixed random responses to two MMK12 prompts, with gradients."""
    requests = [Request(r.prompt, 0, i, 0, GenerationParams(1), inputs=r.inputs) for i, r in enumerate(rows)]
    batch = adapter.collate([adapter.prepare(r) for r in requests])
    seqs = torch.randint(0, 256, (len(rows), length), generator=torch.Generator().manual_seed(1))
    return adapter.token_logprobs(batch, seqs, torch.ones_like(seqs, dtype=torch.bool), 1.0)


@pytest.mark.slow
def test_kl_reference_is_the_model_without_lora(tiny_qwen3_omni_thinker_k12, tmp_path):
    adapter = get_adapter("qwen3_omni_thinker")(omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path), DEVICE)
    random_lora(adapter)
    rows = load_mmk12(ROOT / "data/mmk12_tiny/val.jsonl")[:2]
    with torch.no_grad():
        with adapter.lora_disabled():
            off = score(adapter, rows)
        on = score(adapter, rows)
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
        zero = score(adapter, rows)
    assert torch.equal(off, zero) and (on - off).abs().max() > 1e-3


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_decoder_layers(tiny_qwen3_omni_thinker_k12, tmp_path):
    rows = load_mmk12(ROOT / "data/mmk12_tiny/val.jsonl")[:2]
    grads, calls = {}, {}
    for checkpointing in (False, True):
        flag = "--model.gradient-checkpointing" if checkpointing else "--model.no-gradient-checkpointing"
        cfg = omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path, flag)
        adapter = get_adapter("qwen3_omni_thinker")(cfg, DEVICE)
        random_lora(adapter)
        layer = adapter.thinker.model.language_model.layers[0]
        calls[checkpointing] = 0

        def counted(*_, key=checkpointing):
            calls[key] += 1

        layer.self_attn.register_forward_hook(counted)
        score(adapter, rows).sum().backward()
        grads[checkpointing] = [p.grad for p in adapter.trainable_parameters()]
    assert calls == {False: 1, True: 2}  # the backward pass ran the layer again
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))


@pytest.mark.slow
def test_bad_settings_are_named(tiny_qwen3_omni_thinker_k12, tmp_path):
    with pytest.raises(ConfigError, match="omni models train with grpo, gspo"):
        check_before_loading(omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path, "--algo.loss", "flow_grpo"))
    with pytest.raises(
        ConfigError, match="diffusion models train with dgpo, diffusion_nft, flow_dppo, flow_grpo"
    ):
        get_loss(omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path).algo.loss, "diffusion")
    with pytest.raises(ConfigError, match="kl_beta > 0 with model.finetune full"):
        OmniOps.check_config(
            omni_cfg(
                tiny_qwen3_omni_thinker_k12, tmp_path, "--algo.kl_beta", "0.1", "--model.finetune", "full"
            )
        )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_omni_thinker_k12)
    cfg = omni_cfg(tiny_qwen3_omni_thinker_k12, tmp_path, "--generation.stop", "<|im_end|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation_params(cfg, tokenizer).stop_token_ids == (end,)
    cfg.generation.stop = ["</answer>"]  # 9 byte tokens of the tiny tokenizer
    with pytest.raises(ConfigError, match="generation.stop '</answer>' is 9 tokens"):
        generation_params(cfg, tokenizer)


@pytest.mark.slow
def test_tiny_recipe_under_torchrun_resumes_and_exports(tiny_qwen3_omni_thinker_k12, tmp_path):
    """The recipe on 2 ranks with FSDP2 for 2 steps (a checkpoint after each), resumed for a third; a
    3-step run that never stopped must end identical. The exported LoRA loads with peft."""
    args = [
        "--model.path",
        str(tiny_qwen3_omni_thinker_k12),
        "--checkpoint.every",
        "1",
        "--log.no-tensorboard",
    ]
    out, ref = tmp_path / "run", tmp_path / "reference"
    r = torchrun(2, RECIPE, *args, "--run.output_dir", str(out), "--run.steps", "2")
    assert "Traceback" not in r.stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in rows] == [0, 1]
    for m in rows:
        assert m["reward/mmk12"] == pytest.approx(m["reward/mean"])  # the real reward is the whole reward
        assert m["consistency/logprob_abs_diff_max"] <= 1e-5 and m["consistency/prob_pearson"] >= 0.9999
        assert {"loss/policy", "loss/clip_frac", "loss/ratio", "train/grad_norm"} <= m.keys()
        assert m["train/updates"] == 2 and m["adv/kept_frac"] > 0
        # Rank-local timings (and, on an accelerator, peak memory) from every rank; the key is the maximum.
        ranks = [m["time/generate_s/rank0"], m["time/generate_s/rank1"]]
        assert m["time/generate_s"] == max(ranks) and min(ranks) > 0 and "time/score_wait_s/rank1" in m
    assert "val/reward" in rows[1]  # validation.every 2
    assert "<answer>" in (out / "samples/step_000000.txt").read_text()

    torchrun(2, RECIPE, *args, "--run.output_dir", str(out), "--run.steps", "3")
    torchrun(2, RECIPE, *args, "--run.output_dir", str(ref), "--run.steps", "3")
    assert steady(read_jsonl(out / "metrics.jsonl")) == steady(read_jsonl(ref / "metrics.jsonl"))

    lora = load_file(out / "lora/adapter_model.safetensors")
    lora_ref = load_file(ref / "lora/adapter_model.safetensors")
    assert lora.keys() == lora_ref.keys() and len(lora) == 2 * 4 * 2  # A and B of q/k/v/o in 2 layers
    assert all(torch.equal(lora[k], lora_ref[k]) for k in lora), "the resumed run differs"

    thinker_config = AutoConfig.from_pretrained(tiny_qwen3_omni_thinker_k12).thinker_config
    # The config quirk the adapter handles: get_rope_index reads a field the thinker config lacks.
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_omni_thinker_k12)
    thinker_config.vision_start_token_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    base = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni_thinker_k12, config=thinker_config, key_mapping={r"^thinker\.": ""}
    )
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        tuned = peft.PeftModel.from_pretrained(base, out / "lora")(input_ids=ids).logits
    assert (plain - tuned).abs().max() > 0  # three updates moved the adapter off B = 0


@pytest.mark.slow
def test_zero_spread_rank_matches_single_rank(tiny_qwen3_omni_thinker_k12, tmp_path):
    """Every group of rank 1 has zero spread (dropped): the 2-rank FSDP run pads rank 1 with zero-weight
    micro-batches and divides by the global token count, so its update equals the 1-rank run's."""
    data = ROOT / "data/mmk12_tiny"
    rows = [json.loads(line) for line in open(data / "train.jsonl")]
    per_step = 4
    order = step_prompt_indices(len(rows), 0, per_step, 0)
    for i in order[per_step // 2 : per_step]:  # rank 1's share of step 0
        rows[i]["constant"] = True
    for row in rows:
        row["image"] = str(data / row["image"])
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"]["path"] = str(tiny_qwen3_omni_thinker_k12)
    recipe["data"]["train_path"] = str(train)
    recipe["reward"]["weights"] = {"mmk12_zero_on_flagged_rows": 1.0}
    recipe["run"]["steps"] = 1
    recipe["rollout"].update(prompts_per_step=per_step, group_size=8)
    # The global normaliser is a token count (GRPO: GSPO is sequence-level and refuses token_mean).
    recipe["algo"].update(loss="grpo", aggregation="token_mean")
    recipe["optim"].update(micro_batch_size=3, micro_batch_tokens=0)  # several micro-batches to pad
    recipe["validation"]["every"] = 0
    recipe["checkpoint"] = {"every": 0}
    results = {}
    for nproc in (1, 2):
        recipe["run"]["output_dir"] = str(tmp_path / f"out{nproc}")
        path = tmp_path / f"recipe{nproc}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        torchrun(nproc, path)
        results[nproc] = read_jsonl(tmp_path / f"out{nproc}/metrics.jsonl")[0]
    m1, m2 = results[1], results[2]
    assert m1["adv/zero_std_groups"] == m2["adv/zero_std_groups"] >= per_step // 2
    assert m2["adv/kept_frac"] > 0
    for key in ("loss/policy", "loss/clip_frac", "train/grad_norm", "reward/mean", "consistency/tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-7), key
    w1 = load_file(tmp_path / "out1/lora/adapter_model.safetensors")
    w2 = load_file(tmp_path / "out2/lora/adapter_model.safetensors")
    assert w1.keys() == w2.keys() and w1
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-6), k


@pytest.mark.slow
def test_omni_checkpoint_exports_peft_and_merged(tiny_qwen3_omni_thinker, tmp_path):
    """scripts/export.py on an omni checkpoint: the peft LoRA equals the adapter's own export, and the merged
    transformers directory loads back as a model whose logits equal the LoRA model's."""
    from safetensors.torch import load_file

    from omnirl import checkpoint
    from omnirl import distributed as D
    from omnirl.models import get_adapter
    from omnirl.recipe import config_for
    from scripts.export import main as export_main
    from tests.test_omni import ATTENTION, requests

    cfg = config_for("qwen3_omni_thinker")
    cfg.model.path, cfg.model.adapter, cfg.run.output_dir = (
        str(tiny_qwen3_omni_thinker),
        "qwen3_omni_thinker",
        str(tmp_path),
    )
    cfg.lora.target_modules = ATTENTION
    adapter = get_adapter(cfg.model.adapter)(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for p in adapter.trainable_parameters():  # a non-zero LoRA, as after training
        p.data = torch.randn(p.shape, generator=gen) * 0.05
    optimizer = torch.optim.AdamW(adapter.trainable_parameters(), lr=1e-3)
    ckpt = checkpoint.save(cfg, 1, adapter.model, optimizer, D.init_distributed())

    assert export_main([str(ckpt), str(tmp_path / "peft"), "--format", "peft"]) == 0
    adapter.export_lora(tmp_path / "own")
    ours, exported = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("own", "peft"))
    assert ours.keys() == exported.keys() and all(torch.equal(ours[k], exported[k]) for k in ours)

    assert export_main([str(ckpt), str(tmp_path / "merged"), "--merge"]) == 0
    full = config_for("qwen3_omni_thinker")
    full.model.path, full.model.adapter, full.model.finetune = (
        str(tmp_path / "merged"),
        cfg.model.adapter,
        "full",
    )
    merged = get_adapter(full.model.adapter)(full, torch.device("cpu"))
    assert not [n for n, _ in merged.model.named_parameters() if "lora_" in n]
    inputs = adapter.collate([adapter.prepare(r) for r in requests(2, ["image"])])
    with torch.no_grad():
        want = adapter.lm_head(adapter.model(**inputs, position_ids=adapter.rope_positions(inputs))[:, -1])
        got = merged.lm_head(merged.model(**inputs, position_ids=merged.rope_positions(inputs))[:, -1])
    assert (want - got).abs().max() < 1e-4
