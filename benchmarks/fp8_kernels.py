"""The FP8 rollout's kernels on a GPU (rollout.precision fp8: omnirl.rollout.fp8): the row-wise
quantisation against fp32 (within e4m3 rounding), the scaled matmul against the product of the dequantised
operands (eager and compiled), against torchao's float8 dynamic row-wise linear where torchao is installed
(the same math through a maintained library), and the time of one linear layer at Qwen-Image's block
shapes in bf16 and in FP8 (compiled: the quantisation fused, as the rollout runs it), with and without
fast accumulation (rollout.fp8.fast_accum). `--row-sweep`: only which row counts the device's scaled
matmul takes (raw, and through `fp8_linear`, eager and compiled, with and without fast accumulation).

    python -m benchmarks.fp8_kernels --out fp8_kernels.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.measure import cuda_time
from omnirl import distributed as D
from omnirl.rollout.fp8 import Float8Linear, dequantise, fp8_linear, quantise_rows

# Row counts of Qwen-Image forwards: 1 and 2 rows of 1,030 tokens (1,024 image + the negative prompt's 6),
# 32 of them, and counts around 16.
SWEEP_ROWS = (2060, 1030, 2064, 32960, 1, 2, 15, 16, 17)


def row_sweep(device) -> dict:
    """For each row count: "ok" or the error's first line, per way of calling the FP8 GEMM."""
    linear = torch.nn.Linear(3072, 12288, device=device, dtype=torch.bfloat16)
    stand_in = Float8Linear(linear)
    stand_in.load(linear)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a shape each
    compiled = torch.compile(fp8_linear, fullgraph=True, dynamic=False)
    result: dict = {}
    for m in SWEEP_ROWS:
        x = torch.randn(m, 3072, device=device, dtype=torch.bfloat16)
        w = (stand_in.weight_q, stand_in.weight_scale, stand_in.bias)
        q, s = quantise_rows(x)
        for name in ("raw", "raw_no_bias", "fp8_linear", "compiled"):
            for fast in (False, True):
                try:
                    if name.startswith("raw"):
                        bias = w[2] if name == "raw" else None
                        torch._scaled_mm(
                            q,
                            w[0].t(),
                            scale_a=s,
                            scale_b=w[1],
                            bias=bias,
                            out_dtype=x.dtype,
                            use_fast_accum=fast,
                        )
                    else:
                        (fp8_linear if name == "fp8_linear" else compiled)(x, *w, fast_accum=fast)
                    torch.cuda.synchronize(device)
                    verdict = "ok"
                except RuntimeError as e:
                    verdict = str(e).splitlines()[0][:120]
                result[f"{m} {name}{' fast' if fast else ''}"] = verdict
                print(m, name, "fast" if fast else "exact", verdict, flush=True)
    return result


# Qwen-Image's block linears (hidden 3072, MLP 12288) at the reference's batch: 32 rows of 1,024 image tokens.
SHAPES = {"attn qkv/out 3072x3072": (3072, 3072), "mlp up 3072->12288": (3072, 12288)}
SHAPES["mlp down 12288->3072"] = (12288, 3072)
ROWS = 32 * 1024


def cuda_ms(fn, iters: int = 20) -> float:
    """Milliseconds per call (`measure.cuda_time`), after 3 warm-up calls."""
    return 1e3 * cuda_time(fn, iters, warmup=3)


def torchao_check(linear, x, y, ref, scale_ref: float) -> dict:
    """torchao's float8 dynamic row-wise linear on the same layer and input against ours (`y`) and fp32."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    try:
        ao = torch.nn.Sequential(torch.nn.Linear(linear.in_features, linear.out_features)).to(x)
        ao[0].load_state_dict(linear.state_dict())
        quantize_(ao, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        y_ao = ao(x).float()
    except Exception as e:  # noqa: BLE001 (a cross-check: its failure is reported, the rest still runs)
        return {"torchao": f"{type(e).__name__}: {str(e)[:300]}"}
    return {
        "torchao_vs_ours_max_rel": ((y_ao - y.float()).abs().max() / scale_ref).item(),
        "torchao_vs_fp32_mean_rel": ((y_ao - ref).abs().mean() / scale_ref).item(),
    }


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=ROWS, help="activation rows of the timed layers")
    p.add_argument("--out", default="fp8_kernels.json")
    p.add_argument("--row-sweep", action="store_true", help="only which row counts the GEMM takes")
    a = p.parse_args()
    device = D.local_device()
    D.check_fp8_matmul(device)
    out: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if a.row_sweep:
        out["row_sweep"] = row_sweep(device)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return
    torch.manual_seed(0)

    # Quantisation: within e4m3 rounding of fp32 (2^-4 relative; 2^-10 of the row's scale below normals).
    x = torch.randn(1024, 3072, device=device) * torch.logspace(-3, 4, 1024, device=device)[:, None]
    q, scale = quantise_rows(x)
    err = (dequantise(q, scale) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    out["quantise"] = {"within_rounding": bool((err <= bound * (1 + 1e-6)).all())}
    normal = x.abs() >= scale * 2.0**-6  # in e4m3's normal range (of the scaled values)
    out["quantise"]["max_rel_error_normal"] = (err / x.abs().clamp(min=1e-30))[normal].max().item()

    compiled = torch.compile(fp8_linear, fullgraph=True, dynamic=False)
    out["layers"] = {}
    for name, (k, n) in SHAPES.items():
        linear = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        stand_in = Float8Linear(linear)
        stand_in.load(linear)
        x = torch.randn(a.rows, k, device=device, dtype=torch.bfloat16)
        args = (x, stand_in.weight_q, stand_in.weight_scale, stand_in.bias)
        y_eager, y_compiled = fp8_linear(*args), compiled(*args)
        xq, xs = quantise_rows(x)
        exact = dequantise(xq, xs) @ dequantise(stand_in.weight_q, stand_in.weight_scale.t()).t()
        exact = exact + linear.bias.float()
        ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        scale_ref = ref.abs().mean().item()
        row = {
            # The GEMM of the quantised operands, rounded to bf16 at the end: bf16 rounding of the result.
            "eager_vs_quantised_product_max_rel": ((y_eager.float() - exact).abs().max() / scale_ref).item(),
            "compiled_vs_eager_max_rel": (
                (y_compiled.float() - y_eager.float()).abs().max() / scale_ref
            ).item(),
            "fp8_vs_fp32_mean_rel": ((y_eager.float() - ref).abs().mean() / scale_ref).item(),
            "bf16_vs_fp32_mean_rel": ((linear(x).float() - ref).abs().mean() / scale_ref).item(),
        }
        flops = 2 * a.rows * k * n
        bf16_ms = cuda_ms(lambda x=x, linear=linear: F.linear(x, linear.weight, linear.bias))
        fp8_ms = cuda_ms(lambda args=args: compiled(*args))
        # rollout.fp8.fast_accum: the tensor cores' own accumulator, no promotion to float32.
        y_fast = compiled(*args, fast_accum=True)
        fast_ms = cuda_ms(lambda args=args: compiled(*args, fast_accum=True))
        fast_vs_exact = (y_fast.float() - y_eager.float()).abs().max() / scale_ref
        row |= {
            "bf16_ms": bf16_ms, "fp8_compiled_ms": fp8_ms, "speedup": bf16_ms / fp8_ms,
            "bf16_tflops": flops / bf16_ms / 1e9, "fp8_tflops": flops / fp8_ms / 1e9,
            "fp8_fast_accum_ms": fast_ms, "fast_accum_speedup": bf16_ms / fast_ms,
            "fp8_fast_accum_tflops": flops / fast_ms / 1e9,
            "fast_accum_vs_fp32_mean_rel": ((y_fast.float() - ref).abs().mean() / scale_ref).item(),
            "fast_accum_vs_exact_max_rel": fast_vs_exact.item(),
        }  # fmt: skip
        try:
            import torchao  # noqa: F401
        except ImportError:
            row["torchao"] = "not installed"
        else:
            row |= torchao_check(linear, x, y_eager, ref, scale_ref)
        out["layers"][name] = row
        print(name, json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["quantise"]))
    print(
        f"{'layer':26s} {'bf16 ms':>8s} {'fp8 ms':>8s} {'speedup':>8s} {'fp8 TFLOP/s':>12s} {'fp8 err':>8s}"
        f" {'fast ms':>8s} {'speedup':>8s} {'fast err':>8s}"
    )
    for name, r in out["layers"].items():
        print(
            f"{name:26s} {r['bf16_ms']:8.3f} {r['fp8_compiled_ms']:8.3f} {r['speedup']:8.2f} "
            f"{r['fp8_tflops']:12.0f} {r['fp8_vs_fp32_mean_rel']:8.4f} {r['fp8_fast_accum_ms']:8.3f} "
            f"{r['fast_accum_speedup']:8.2f} {r['fast_accum_vs_fp32_mean_rel']:8.4f}"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
