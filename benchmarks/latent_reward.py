"""A latent reward in process against decoding + PickScore, on SD3.5-Medium, in one process.

    python -m benchmarks.latent_reward --random-init [--samples 36] [--steps 2] [--out FILE]
    python -m benchmarks.latent_reward --tiny            # the plumbing, on the tiny models (CPU)

With the settings of yaml/sd35_flowgrpo_dinalrm (512 px, float32, LoRA r32 on the attention) and one
rank's batch of it (`--samples`, 2 prompts x 18), it measures:

1. The reward's time and device memory per step: DiNa-LRM in process (the policy's first 12 blocks under
   the reward's LoRA, on the final latents; `omnirl.rewards.dina_lrm`) against the VAE decode of the same
   latents followed by PickScore (a CLIP ViT-H/14, float32; `omnirl.rewards.pickscore`). Each is timed
   after one warm-up call (`--repeats` calls, the mean); memory is the peak allocated above what was
   allocated before the call, and the weights each adds to the device.
2. What the shared backbone saves: the bytes of a separate copy of the embedders and blocks 0-11 (what a
   reward server or a full fine-tune's frozen copy holds), measured by making that copy on the device.
3. One whole step's split: `--steps` RL steps of the recipe through the trainer on one device
   (prompts_per_step 2, the recipe's per-rank share on 7 ranks), its logged times and phase peaks, with
   model.dtype `--step-dtype` (bfloat16 by default: the recipe's float32 step, ~60 T-FLOP per denoising
   step for 36 samples, runs for minutes on one GPU without TF32).

`--random-init` builds SD3.5-Medium from its public configs with random weights
(`omnirl.models.random_init`), a DiNa-LRM of the published shapes with random weights (its LoRA r64 over
the 12 blocks' attention, its head) and a random PickScore of PickScore_v1's shapes; the outputs are noise,
speed and memory are the real models'. The tokenizers are the tiny character-level ones: prompts are
padded to their fixed lengths (CLIP 77, T5 256) for the transformer; PickScore's text is cut at 77.
Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from omnirl import distributed as D
from omnirl.memory import GIB, empty_cache, synchronize

# PickScore_v1 is CLIP ViT-H/14 (open_clip's laion2B model in transformers' layout)
PICKSCORE_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      max_position_embeddings=77)  # fmt: skip
PICKSCORE_VISION = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                        num_attention_heads=16, image_size=224, patch_size=14)  # fmt: skip
DINA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def write_dina(out: Path, transformer, n: int, idx: list[int], rank: int) -> Path:
    """A random DiNa-LRM in the published layout for `transformer`'s shapes: config.json, the LoRA's keys
    as peft saves them (the attention projections of the first `n` blocks) and the head's state dict."""
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists
    from safetensors.torch import save_file

    from omnirl.rewards.dina_lrm import RewardHead

    options = dict(use_proj_in=False, width=-1, out_dim=1, num_queries=4, num_attn_heads=8, dropout=0.0)
    model = dict(num_transformer_layers=n, use_lora=True, use_logistic=False, visual_head_idx=idx,
                 text_head_idx=idx, reward_head=options)  # fmt: skip
    (out / "checkpoint" / "backbone_lora").mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model": model}))
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=DINA_TARGETS)
    config.save_pretrained(str(out / "checkpoint" / "backbone_lora"))
    state = {}
    g = torch.Generator().manual_seed(0)
    for name, m in transformer.named_modules():
        block = name.split(".")[1] if name.startswith("transformer_blocks.") else None
        if block is None or int(block) >= n or ".lora_" in name or name.endswith(".base_layer"):
            continue
        if isinstance(m, (torch.nn.Linear, LoraLayer)) and check_target_module_exists(config, name):
            base = m.base_layer if isinstance(m, LoraLayer) else m
            state[f"base_model.model.{name}.lora_A.weight"] = (
                torch.randn(rank, base.in_features, generator=g) * 0.01
            )
            state[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(base.out_features, rank, generator=g) * 0.01
            )
    save_file(state, out / "checkpoint" / "backbone_lora" / "adapter_model.safetensors")
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    torch.save(RewardHead(dim, len(idx), len(idx), options).state_dict(), out / "checkpoint" / "rm_head.pt")
    return out


def random_pickscore(device: torch.device, tiny: Path | None):
    """PickScore with random weights of PickScore_v1's shapes (or the tiny one), built on the device."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from omnirl.models.tokenizers import clip_tokenizer
    from omnirl.rewards.pickscore import PickScore

    if tiny is not None:
        return PickScore(str(tiny))
    tok = clip_tokenizer()
    ids = dict(vocab_size=49408, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)  # fmt: skip
    config = CLIPConfig(
        text_config={**PICKSCORE_TEXT, **ids}, vision_config=PICKSCORE_VISION, projection_dim=1024
    )
    reward = PickScore.__new__(PickScore)  # what its __init__ sets, without a checkpoint on disk
    reward.device = device
    with torch.device(device):
        reward.model = CLIPModel(config).eval().requires_grad_(False)
    images = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    reward.processor = CLIPProcessor(image_processor=images, tokenizer=tok)
    return reward


def measured(fn, repeats: int, device: torch.device) -> dict:
    """Seconds per call (mean of `repeats` after one warm-up) and the peak bytes allocated above the
    bytes allocated before the call (an accelerator's; 0 on CPU)."""
    fn()
    synchronize()
    accel = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if accel else 0
    if accel:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    synchronize()
    seconds = (time.perf_counter() - start) / repeats
    peak = torch.cuda.max_memory_allocated(device) - before if accel else 0
    return {"s": seconds, "peak_gib": peak / GIB, "out": out}


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def param_bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random-init", action="store_true", help="full-size SD3.5-Medium with random weights")
    p.add_argument("--tiny", action="store_true", help="the tiny models (CPU plumbing)")
    p.add_argument("--samples", type=int, default=36, help="latents scored per step (one rank's share)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up")
    p.add_argument("--steps", type=int, default=2, help="RL steps of the whole-step run (0: none)")
    p.add_argument("--step-dtype", default="bfloat16", help="model.dtype of the whole-step run (see above)")
    p.add_argument("--out", default="", help="write the JSON here")
    a = p.parse_args(argv)
    assert a.random_init != a.tiny, "give one of --random-init / --tiny"
    from omnirl.models import build_adapter, write_random_checkpoint
    from omnirl.models.base import Latent
    from omnirl.recipe import load_config
    from omnirl.rewards import to_pil
    from omnirl.rewards.dina_lrm import Backbone, DinaLRM
    from omnirl.testing import TINY_MODELS

    dist = D.init_distributed()
    device = dist.device
    tmp = Path(tempfile.mkdtemp(prefix="latent_reward_"))
    if a.tiny:
        ckpt = TINY_MODELS["sd3"](tmp / "sd3")
        recipe, size, n, idx = "sd3_tiny_flowgrpo_dinalrm", 32, 1, [1]
        overrides = ["--model.path", str(ckpt)]
    else:
        ckpt = tmp / "sd3"
        write_random_checkpoint("sd3", ckpt)
        recipe, size, n, idx = "sd35_flowgrpo_dinalrm", 512, 12, [4, 8, 12]
        overrides = ["--model.path", str(ckpt), "--model.weights", "random"]
    prompts_file = tmp / "prompts.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"prompt": f"a photo of thing number {i}"}) + "\n" for i in range(14))
    )
    base = [*overrides, "--data.train_path", str(prompts_file), "--data.val_path", str(prompts_file),
            "--run.output_dir", str(tmp / "out")]  # fmt: skip
    cfg = load_config(recipe, base + ["--reward.paths.dina_lrm", str(tmp / "dina")])
    start = time.perf_counter()
    adapter = build_adapter(cfg, device)
    load_s = time.perf_counter() - start
    write_dina(tmp / "dina", adapter.transformer, n, idx, 64 if not a.tiny else 8)
    before = allocated(device)
    dina = DinaLRM(str(tmp / "dina"), adapter, cfg)
    dina_weights = allocated(device) - before
    before = allocated(device)
    pick = random_pickscore(device, TINY_MODELS["pickscore"](tmp / "pickscore") if a.tiny else None)
    pick_weights = allocated(device) - before

    # One rank's batch of final latents with their conditioning, as the rollout hands them to a reward.
    h = size // adapter.vae_scale_factor
    prompts = [f"a photo of thing number {i // 18}" for i in range(a.samples)]
    embeds = {k: v.cpu() for k, v in adapter.encode(prompts, None).items()}
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(a.samples, adapter.transformer.config.in_channels, h, h, generator=g)
    samples = [Latent(latents[i], {k: v[i] for k, v in embeds.items()}, i) for i in range(a.samples)]
    rows = [{}] * a.samples
    empty_cache()
    in_process = measured(lambda: dina(samples, prompts, rows), a.repeats, device)
    decode = measured(lambda: adapter.decode(latents), a.repeats, device)
    images = [to_pil(im) for im in decode["out"]]
    score = measured(lambda: pick(images, prompts, rows), a.repeats, device)

    # A separate copy of what the in-process reward shares with the policy: the embedders and blocks 0-11.
    shared = [adapter.transformer.pos_embed, adapter.transformer.time_text_embed,
              adapter.transformer.context_embedder, *adapter.transformer.transformer_blocks[:n]]  # fmt: skip
    base_bytes = sum(
        p.numel() * p.element_size()
        for m in shared
        for name, p in m.named_parameters()
        if ".lora_" not in name
    )
    before = allocated(device)
    copy = Backbone(adapter.transformer, n)
    copy_bytes = allocated(device) - before
    copy_lora = sum(p.numel() * p.element_size() for name, p in copy.named_parameters() if ".lora_" in name)
    del copy
    empty_cache()

    result = {
        "command": "python -m benchmarks.latent_reward " + ("--tiny" if a.tiny else "--random-init"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "recipe": recipe,
        "samples": a.samples,
        "pixels": size,
        "load_s": load_s,
        "dina_in_process": {
            "s": in_process["s"],
            "peak_gib": in_process["peak_gib"],
            "weights_gib": dina_weights / GIB,
        },  # fmt: skip
        "vae_decode": {"s": decode["s"], "peak_gib": decode["peak_gib"]},
        "pickscore": {"s": score["s"], "peak_gib": score["peak_gib"], "weights_gib": pick_weights / GIB},
        "separate_copy": {
            "measured_gib": copy_bytes / GIB,
            "base_weights_gib": base_bytes / GIB,
            "of_which_lora_gib": copy_lora / GIB,
            "dtype": str(adapter.transformer.dtype),
        },  # fmt: skip
    }
    dina = pick = adapter = shared = None  # freed before the whole-step run loads its own
    empty_cache()
    if a.out:  # the reward's measurements stand alone: written before the longer whole-step run
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    if a.steps:
        result["step_dtype"] = a.step_dtype
        result["step"] = whole_step(a, recipe, base + ["--reward.paths.dina_lrm", str(tmp / "dina")], device)
    print(table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def whole_step(a, recipe: str, overrides: list[str], device: torch.device) -> list[dict]:
    """`--steps` steps of the recipe through the trainer (one rank's share of it), their logged split."""
    from omnirl.recipe import load_config
    from omnirl.trainer import train

    out = Path(overrides[overrides.index("--run.output_dir") + 1])
    steps = ["--run.steps", str(a.steps), "--model.dtype", a.step_dtype,
             "--distributed.param_dtype", a.step_dtype, "--rollout.prompts_per_step", "2",
             "--validation.every", "0", "--checkpoint.every", "0", "--log.image_every", "0",
             "--export.lora_at_end", "false"]  # fmt: skip
    train(load_config(recipe, overrides + steps))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keep = ("time/", "mem/", "reward/mean", "train/updates")
    return [{k: v for k, v in row.items() if k.startswith(keep) and "/rank" not in k} for row in rows]


def table(r: dict) -> str:
    lines = [
        f"{r['recipe']}: {r['samples']} samples at {r['pixels']} px on {r['device']} (torch {r['torch']})",
        f"{'reward of one step':<34}{'time s':>10}{'peak GiB':>10}{'weights GiB':>13}",
    ]
    d, v, s = r["dina_in_process"], r["vae_decode"], r["pickscore"]
    lines.append(
        f"{'DiNa-LRM in process (latents)':<34}{d['s']:>10.3f}{d['peak_gib']:>10.2f}{d['weights_gib']:>13.3f}"
    )
    lines.append(f"{'VAE decode':<34}{v['s']:>10.3f}{v['peak_gib']:>10.2f}{'(resident)':>13}")
    lines.append(
        f"{'PickScore on the images':<34}{s['s']:>10.3f}{s['peak_gib']:>10.2f}{s['weights_gib']:>13.3f}"
    )
    both = max(v["peak_gib"], s["peak_gib"])
    lines.append(f"{'decode + PickScore':<34}{v['s'] + s['s']:>10.3f}{both:>10.2f}{s['weights_gib']:>13.3f}")
    c = r["separate_copy"]
    lines.append(
        f"a separate copy of the embedders + shared blocks ({c['dtype']}): {c['measured_gib']:.3f} GiB "
        f"measured ({c['base_weights_gib']:.3f} GiB of base weights, {c['of_which_lora_gib']:.3f} GiB of "
        "LoRA copied with them)"
    )
    for row in r.get("step", []):
        lines.append(f"whole step, model.dtype {r['step_dtype']}:")
        keys = ("time/step_s", "time/rollout_s", "time/generate_s", "time/score_wait_s", "time/train_s",
                "mem/rollout_peak_gib", "mem/train_peak_gib")  # fmt: skip
        lines.append("step: " + ", ".join(f"{k} {row[k]:.2f}" for k in keys if k in row))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
