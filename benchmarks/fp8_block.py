"""One Qwen-Image transformer block in FP8 as the rollout runs it, at the batch shapes of small packed
batches: diffusers' `QwenImageTransformer2DModel` with one block of the real widths (24 heads of 128, MLP
12,288, text width 3,584; random init, bf16), its block's linears swapped for the FP8 stand-ins
(`omnirl.rollout.fp8.Fp8Rollout`, Qwen-Image's bf16-kept modulation) and the block compiled as
`generation.compile` compiles it (`omnirl.rollout.compiled.compile_forwards`: fullgraph, static shapes).
Each case REQUESTS:TEXT_TOKENS[:m] (m: the text rows padded to different lengths and masked, as a batch of
prompts of different lengths runs) runs the model in bf16, in FP8 eager and in FP8 compiled, and records
"ok" with the FP8 outputs' distance from bf16, or the error's first line. It finds where a compiled FP8
batch fails (a 2-request batch did, in cuBLASLt, where 32 ran) with the whole block around the GEMMs.

    python -m benchmarks.fp8_block --out fp8_block.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnirl import distributed as D
from omnirl.rollout.compiled import compile_forwards, swapped
from omnirl.rollout.fp8 import Fp8Rollout

# (requests, text tokens, masked): the reference recipe's prompts ran 80 text tokens, its negative prompt 6.
CASES = "1:6,2:6,2:80,2:80:m,4:6,32:6"
QWEN_IMAGE = {"num_attention_heads": 24, "attention_head_dim": 128, "joint_attention_dim": 3584}
TINY = {
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "joint_attention_dim": 48,
    "axes_dims_rope": (8, 12, 12),
}


def parse_cases(text: str) -> list[tuple[int, int, bool]]:
    cases = []
    for part in text.split(","):
        fields = part.split(":")
        if (
            len(fields) not in (2, 3)
            or not all(f.isdigit() for f in fields[:2])
            or fields[2:] not in ([], ["m"])
        ):
            raise SystemExit(f"--cases: {part!r} is not REQUESTS:TEXT_TOKENS[:m]")
        cases.append((int(fields[0]), int(fields[1]), fields[2:] == ["m"]))
    return cases


def build(device: torch.device, tiny: bool):
    from diffusers import QwenImageTransformer2DModel

    from omnirl.models.qwen_image.adapter import QwenImageAdapter

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(num_layers=1, **(TINY if tiny else QWEN_IMAGE))
    model = model.to(device, torch.bfloat16).eval()
    return model, Fp8Rollout(list(model.transformer_blocks), QwenImageAdapter.fp8_keep_bf16)


def inputs(model, requests: int, text: int, masked: bool, grid: int, device: torch.device) -> dict:
    """The transformer's inputs for `requests` rows of grid x grid image tokens and `text` text tokens; with
    `masked` every other row's text is cut to half its length (zero-padded and masked)."""
    g = torch.Generator(device="cpu").manual_seed(requests * 1000 + text)
    channels, width = model.config.in_channels, model.config.joint_attention_dim
    mask = torch.ones(requests, text, dtype=torch.bool)
    if masked:
        mask[1::2, text // 2 :] = False
    embeds = torch.randn(requests, text, width, generator=g) * mask[..., None]
    return {
        "hidden_states": torch.randn(requests, grid * grid, channels, generator=g).to(device, torch.bfloat16),
        "timestep": torch.rand(requests, generator=g).to(device, torch.bfloat16),
        "encoder_hidden_states": embeds.to(device, torch.bfloat16),
        "encoder_hidden_states_mask": mask.to(device) if masked else None,
        "img_shapes": [[(1, grid, grid)]] * requests,
        "return_dict": False,
    }


def block_sweep(
    device: torch.device, cases, tiny: bool = False, grid: int = 32, compile: bool = True
) -> dict:
    """For each case: "ok" and the FP8 outputs' mean / max distance from bf16 (relative to bf16's mean
    magnitude), eager and compiled, or the error's first line."""
    model, fp8 = build(device, tiny)
    compiled = compile_forwards(model.transformer_blocks) if compile else []
    result: dict = {}
    for requests, text, masked in cases:
        name = f"{requests}:{text}{':m' if masked else ''}"
        x = inputs(model, requests, text, masked, grid, device)
        row: dict = {"image_rows": requests * grid * grid, "text_rows": requests * text}
        with torch.no_grad():
            ref = model(**x)[0].float()
            scale = ref.abs().mean().item()
            with fp8.swapped():
                for way in ("eager", "compiled") if compile else ("eager",):
                    start = time.perf_counter()
                    try:
                        with swapped(compiled if way == "compiled" else []):
                            out = model(**x)[0].float()
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        diff = (out - ref).abs()
                        row[way] = "ok"
                        row[f"{way}_mean_rel"] = diff.mean().item() / scale
                        row[f"{way}_max_rel"] = diff.max().item() / scale
                    except Exception as e:  # noqa: BLE001 (recorded: the next case still runs)
                        row[way] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    row[f"{way}_s"] = time.perf_counter() - start
        result[name] = row
        print(name, json.dumps(row), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=CASES, help="REQUESTS:TEXT_TOKENS[:m],... (m: rows of two lengths)")
    p.add_argument("--grid", type=int, default=32, help="image tokens per side (32: 512 px)")
    p.add_argument("--tiny", action="store_true", help="a tiny block (CPU rehearsal)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--out", default="fp8_block.json")
    a = p.parse_args()
    cases = parse_cases(a.cases)
    device = D.local_device()
    D.check_fp8_matmul(device)
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out |= {"torch": torch.__version__, "cases": a.cases, "grid": a.grid, "tiny": a.tiny}
    out["block_sweep"] = block_sweep(device, cases, a.tiny, a.grid, not a.no_compile)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
