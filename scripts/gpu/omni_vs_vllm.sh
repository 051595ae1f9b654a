#!/usr/bin/env bash
# The omni rollout backends against plain vLLM on one GPU (vLLM installed). The benchmark thinker (8 MoE
# layers) on four loads (64 concurrent with 128 requests, 256 with 256; full length and 1% stop tokens; up
# to 384 new tokens): the native engine (with its defaults; with the mmk12 recipe's merged LoRA and compiled
# norms and routers, ours_norms; and that with 4 row buckets, ours_rows), the vLLM backend (seeded;
# unseeded; unseeded without log-probs, rollout.vllm.logprobs false) and plain vLLM, the unseeded backends
# and plain vLLM three times (interleaved); then a deeper thinker (DEEP_LAYERS) at full length, 64
# concurrent, 64 requests. Kernel tables of ours_norms, the unseeded backend and plain vLLM on every load.
# (What each of the backend's settings costs plain vLLM alone: the vllm_plain_* methods of
# benchmarks.generate_throughput.)
#   bash scripts/gpu/omni_vs_vllm.sh OUT [DEEP_LAYERS] [BUDGET_S]   (the deeper run gets what is left)
set -uo pipefail
out=${1:?usage: bash scripts/gpu/omni_vs_vllm.sh OUT [DEEP_LAYERS] [BUDGET_S]}
deep=${2:-24}
budget=${3:-560}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
start=$SECONDS
shape=(--random-init --hidden 2048 --experts 32 --experts-per-tok 8 --moe-intermediate 768 --dtype bfloat16
    --head-scale 4 --max-new-tokens 384 --kv-cache-gib 20 --check-logprobs --kernels 15
    --lora-std 0.01 --kernel-methods "ours_norms,vllm_unseeded,vllm_plain")
python -m benchmarks.generate_throughput "${shape[@]}" --layers 8 \
    --loads 64:0:128,64:0.01:128,256:0:256,256:0.01:256 --repeats 3 \
    --repeat-methods vllm_unseeded,vllm_nolp,vllm_plain \
    --methods ours,ours_norms,ours_rows,vllm,vllm_unseeded,vllm_nolp,vllm_plain \
    --out "$out/layers8.json" 2>&1 | grep --line-buffered -v -E "it/s\]|Writing model|Loading weights" >"$out/layers8.log"
echo "8 layers: done at +$((SECONDS - start)) s"
left=$((budget - (SECONDS - start) - 5))
[ "$left" -ge 60 ] || { echo "no time left for $deep layers ($left s)"; exit 0; }
timeout "$left" python -m benchmarks.generate_throughput "${shape[@]}" --layers "$deep" \
    --num-requests 64 --loads 64:0 --methods ours,ours_norms,vllm,vllm_unseeded,vllm_nolp,vllm_plain \
    --out "$out/layers$deep.json" 2>&1 | grep --line-buffered -v -E "it/s\]|Writing model|Loading weights" >"$out/layers$deep.log"
echo "$deep layers: done at +$((SECONDS - start)) s"
