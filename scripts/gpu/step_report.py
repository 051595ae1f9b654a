"""The report of `scripts.gpu.phase_memory`: per step, each phase's work time, peak device memory and
sleep/wake traffic; over the steady steps, the step's split (generation, scoring wait, the update's parts,
sleep/wake, the rest) with each phase's share of the counted FLOPs' ideal time (docs/update.md).
"""

from __future__ import annotations

import re
import statistics

PHASE_KEY = re.compile(r"^(?:mem|time)/(.+)_(?:peak_gib|sleep_gib|wake_gib|sleep_s|wake_s)$")
PHASE_ORDER = ("rollout", "train", "validate")


def per_rank(row: dict, key: str) -> list[float]:
    """KEY/rank0, KEY/rank1, ... of a metrics row (omnirl.step.per_rank), in rank order."""
    values = []
    while f"{key}/rank{len(values)}" in row:
        values.append(row[f"{key}/rank{len(values)}"])
    return values


def phase_names(row: dict) -> list[str]:
    """The phases a metrics row has keys of: rollout, train, validate first, any other after."""
    names = {m.group(1) for k in row if (m := PHASE_KEY.match(k))}
    names |= {n for n in PHASE_ORDER if f"time/{n}_s" in row}
    return sorted(names, key=lambda n: (PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER), n))


def phase_stats(row: dict) -> dict[str, dict]:
    """Each phase's numbers in a metrics row (None where the row has no such key)."""
    out = {}
    for name in phase_names(row):
        stats = {
            "work_s": row.get(f"time/{name}_s"),
            "peak_gib": row.get(f"mem/{name}_peak_gib"),
            "peak_gib_per_rank": per_rank(row, f"mem/{name}_peak_gib"),
            "sleep_gib": row.get(f"mem/{name}_sleep_gib"),
            "sleep_s": row.get(f"time/{name}_sleep_s"),
            "wake_gib": row.get(f"mem/{name}_wake_gib"),
            "wake_s": row.get(f"time/{name}_wake_s"),
        }
        for way in ("sleep", "wake"):
            gib, s = stats[f"{way}_gib"], stats[f"{way}_s"]
            stats[f"{way}_gib_per_s"] = gib / s if gib and s else None
        out[name] = stats
    return out


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_table(row: dict, title: str = "") -> str:
    """One step of a metrics row as a markdown table: a row per phase."""
    step_s = row.get("time/step_s")
    parts = [f"step {fmt(step_s)} s"] if step_s is not None else []
    if "time/generate_s" in row:
        wait = fmt(row.get("time/score_wait_s"), 2)
        decode = f" (VAE decode {fmt(row['time/vae_decode_s'], 2)} s)" if row.get("time/vae_decode_s") else ""
        parts.append(f"generation {fmt(row['time/generate_s'])} s{decode}, scoring wait {wait} s")
    if "time/regenerate_s" in row:  # Sol-RL (rollout.fp8.select): the bf16 regeneration of the chosen
        parts.append(f"bf16 regeneration {fmt(row['time/regenerate_s'])} s")
    if "mem/host_gib" in row:
        parts.append(f"host buffers {fmt(row['mem/host_gib'])} GiB")  # pinned on an accelerator
    if "train/updates" in row:
        parts.append(f"optimizer steps {row['train/updates']:g}")
    head = f"**{title}step {row['step']}**" + (f" ({'; '.join(parts)})" if parts else "")
    lines = [
        head,
        "",
        "| phase | work s | peak GiB | to host GiB | to host s | to device GiB | to device s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in phase_stats(row).items():
        peak = fmt(s["peak_gib"])
        if len(s["peak_gib_per_rank"]) > 1:
            peak += " (" + " / ".join(fmt(v) for v in s["peak_gib_per_rank"]) + ")"
        lines.append(
            f"| {name} | {fmt(s['work_s'])} | {peak} | {fmt(s['sleep_gib'], 2)} | {fmt(s['sleep_s'], 2)} "
            f"| {fmt(s['wake_gib'], 2)} | {fmt(s['wake_s'], 2)} |"
        )
    return "\n".join(lines)


LEGEND = (
    "Per phase: work s = the phase's own time; peak GiB = peak device memory allocated from after its "
    "sleep to its end (the largest rank, each rank in brackets when there are several; none on CPU); to "
    "host = what the phase put to sleep on entry (rollout: optimizer state; train: text encoders and VAE), "
    "to device = what it woke (the reverse). Step 0 has no optimizer state yet, so its rollout sleeps none."
)


def report(rows: list[dict], title: str = "") -> str:
    return "\n\n".join([*(step_table(r, title) for r in rows), LEGEND]) + "\n"


def summarise_steps(rows: list[dict]) -> list[dict]:
    return [
        {
            "step": r["step"],
            "step_s": r.get("time/step_s"),
            "generate_s": r.get("time/generate_s"),
            "vae_decode_s": r.get("time/vae_decode_s"),
            "score_wait_s": r.get("time/score_wait_s"),
            "regenerate_s": r.get("time/regenerate_s"),
            "host_gib": r.get("mem/host_gib"),
            "optimizer_steps": r.get("train/updates"),
            "kept_frac": r.get("adv/kept_frac"),
            "phases": phase_stats(r),
        }
        for r in rows
    ]


UPDATE_PARTS = ("recompute", "memory_probe", "forward", "kl_reference", "backward", "optimizer")


def step_split(rows: list[dict], flops: dict | None, images: float | None = None) -> dict:
    """The whole step, split: per steady-state step (every step after step 0) generation (text encoding and
    denoising), its VAE decode, scoring wait, the update's parts (`time/train_<part>_s`), sleep/wake and the
    rest, with median, min and max over those steps; step 0 apart (compiling and first-touch costs); images
    per second per GPU (`images`: a step's images over the run's GPUs, else the count `flops` holds); and,
    given the counted transformer FLOPs of the rollout and the update (`flops`), each phase's MFU: the
    FLOPs' time at the measured bf16 matmul ceiling over the measured time."""

    def parts(r: dict) -> dict[str, float]:
        decode = r.get("time/vae_decode_s") or 0.0  # inside the generation
        probe = r.get("time/memory_probe_s") or 0.0  # likewise: the rollout's memory probes (step 0)
        out = {
            "generation": (r.get("time/generate_s") or 0.0) - decode - probe,
            "vae decode": decode,
            "rollout memory probe": probe,
            "scoring wait": r.get("time/score_wait_s") or 0.0,
        }
        for part in UPDATE_PARTS:
            out[f"update {part.replace('_', ' ')}"] = r.get(f"time/train_{part}_s") or 0.0
        out["sleep/wake"] = sum(v for k, v in r.items() if re.match(r"^time/\w+_(sleep|wake)_s$", k) and v)
        step = r.get("time/step_s") or 0.0
        out["other"] = max(step - sum(out.values()), 0.0)
        out["step"] = step
        out["rollout"] = r.get("time/rollout_s") or 0.0
        out["update"] = r.get("time/train_s") or 0.0
        return out

    if not rows:
        return {}
    steady = [parts(r) for r in rows[1:]] or [parts(rows[0])]
    names = list(steady[0])

    def stat(name: str) -> dict:
        vals = [p[name] for p in steady]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    out = {
        "steady_steps": [r["step"] for r in rows[1:]] or [rows[0]["step"]],
        "parts": {n: stat(n) for n in names},
        "step0": parts(rows[0]),
        "gradient_checkpointing": rows[-1].get("train/gradient_checkpointing"),
        "host_pin_s": rows[0].get("time/host_pin_s"),
    }
    if "compile/graphs" in rows[0]:  # inside the parts above: what compiling (or loading from the cache) took
        out["compile"] = {
            "step0_s": rows[0].get("time/compile_s") or 0.0,
            "step0_rollout_s": rows[0].get("time/rollout_compile_s"),
            "step0_graphs": rows[0]["compile/graphs"],
            "steady_s": sum(r.get("time/compile_s") or 0.0 for r in rows[1:]),
            "steady_graphs": sum(r.get("compile/graphs") or 0.0 for r in rows[1:]),
        }
    step = out["parts"]["step"]["median"]
    if images or flops:
        out["images_per_s"] = (images or flops["images"]) / step if step else None
    if flops:
        ceiling = flops["ceiling_tflops"] * 1e12
        for phase, key in (("rollout", "rollout_flop"), ("update", "update_flop")):
            t = out["parts"][phase]["median"]
            out[f"{phase}_mfu"] = flops[key] / ceiling / t if t and flops.get(key) else None
    return out


def split_table(split: dict, flops: dict | None) -> str:
    if not split:
        return ""
    p = split["parts"]
    lines = [
        f"**The whole step** (median of steps {split['steady_steps']}, min-max in brackets; step 0 apart)",
        "",
        "| part | steady s | step 0 s |",
        "|---|---|---|",
    ]
    for name, v in p.items():
        lines.append(
            f"| {name} | {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) | {split['step0'][name]:.2f} |"
        )
    notes = []
    if split.get("images_per_s"):
        notes.append(f"{split['images_per_s']:.3f} {split.get('samples', 'images')}/s per GPU")
    for phase in ("rollout", "update"):
        if split.get(f"{phase}_mfu"):
            notes.append(f"{phase} at {100 * split[f'{phase}_mfu']:.0f}% of the bf16 rate")
    if flops:
        notes.append(
            f"counted: rollout {flops['rollout_flop'] / 1e15:.2f} PFLOP, "
            f"update {flops['update_flop'] / 1e15:.2f} "
            f"PFLOP ({flops['update_passes']:g} transformer passes a row), measured matmul ceiling "
            f"{flops['ceiling_tflops']:.0f} TFLOP/s"
        )
    if c := split.get("compile"):
        where = (
            f", {c['step0_rollout_s']:.1f} s of it in the rollout"
            if c.get("step0_rollout_s") is not None
            else ""
        )
        notes.append(
            f"compiling: step 0 {c['step0_s']:.1f} s for {c['step0_graphs']:g} graphs{where}, the steady "
            f"steps {c['steady_s']:.1f} s for {c['steady_graphs']:g} (inside the parts above)"
        )
    if split.get("host_pin_s") is not None:
        notes.append(f"step 0 pinned the host chunks in {split['host_pin_s']:.2f} s beside its rollout")
    if split.get("gradient_checkpointing") is not None:
        notes.append(f"gradient checkpointing {'on' if split['gradient_checkpointing'] else 'off'}")
    return "\n".join(lines) + ("\n\n" + "; ".join(notes) + "." if notes else "") + "\n"


def count_flops(cfg, rows: list[dict], ceiling_tflops: float | None) -> dict | None:
    """Transformer FLOPs of the run's steady-state step, counted with FlopCounterMode on the meta device
    (benchmarks.measure.transformer_flops: one row at the family's fixed text length; None for families
    whose rows have per-prompt lengths). A trained row: forward + activation-gradient backward (2 passes),
    + 1 with gradient checkpointing, + 1 for the KL reference, + 1 for a recomputed old policy."""
    import torch

    from benchmarks.measure import text_lengths, transformer_flops
    from omnirl.models import build_adapter
    from omnirl.ops.diffusion import sampling_params

    if not rows or not ceiling_tflops or cfg.model.adapter not in ("sd3", "wan", "ltx2"):
        return None
    adapter = build_adapter(cfg, torch.device("meta"))
    params = sampling_params(cfg)
    per_row = transformer_flops(adapter, params)(text_lengths(adapter, None)[0])
    halves = 2 if cfg.sampling.guidance_scale > 1 else 1
    images = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    trained = cfg.sampling.sde_window_size or cfg.sampling.num_steps - 1
    kept = rows[-1].get("adv/kept_frac", 1.0)
    ckpt = rows[-1].get("train/gradient_checkpointing", 0.0)
    passes = 2 + ckpt + (cfg.algo.kl_beta > 0) + (cfg.algo.old_logprob == "recompute")
    return {
        "images": images,
        "row_tflop": per_row / 1e12,
        "rollout_flop": images * cfg.sampling.num_steps * halves * per_row,
        "update_flop": images * kept * trained * halves * per_row * passes * cfg.optim.epochs,
        "update_passes": passes,
        "ceiling_tflops": ceiling_tflops,
    }
