#!/usr/bin/env bash
# Where the mmk12 run's actor-vs-rollout Pearson is lost: the generation benchmark's trainer-vs-rollout
# check with text prompts, with image prompts, and with image prompts and no early stop (every response
# max_new_tokens long, as in the mmk12 run), then the mmk12 recipe on one GPU (FSDP2 world 1).
#   bash scripts/gpu/pearson_probe.sh OUT [BUDGET_S]
set -uo pipefail
out=${1:?usage: bash scripts/gpu/pearson_probe.sh OUT [BUDGET_S]}
budget=${2:-560}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.." || exit 1
start=$SECONDS
common=(--num-requests 256 --max-num-seqs 64 --max-new-tokens 256 --check-logprobs --kv-cache-gib 20
    --methods ours)
shape=(--random-init --layers 8 --hidden 2048 --experts 32 --experts-per-tok 8 --moe-intermediate 768
    --dtype bfloat16 --head-scale 4)
timeout 150 python -m benchmarks.generate_throughput "${shape[@]}" "${common[@]}" --stop-frac 0.01 \
    --keep-model "$out/text" --out "$out/text/gt.json" >"$out/text.log" 2>&1
echo "text: $? at +$((SECONDS - start)) s"; grep -E "trainer vs|^ours" "$out/text.log"
model=$out/text/random_thinker
for v in "image 448 0.01" "image_nostop 448 0"; do
    read -r -a a <<<"$v"
    set -- "${a[@]}"
    timeout 120 python -m benchmarks.generate_throughput --model "$model" --dtype bfloat16 "${common[@]}" \
        --image-size "$2" --stop-frac "$3" --out "$out/$1/gt.json" >"$out/$1.log" 2>&1
    echo "$1: $? at +$((SECONDS - start)) s"; grep -E "trainer vs|^ours" "$out/$1.log"
done
rm -rf "$model"
left=$((budget - (SECONDS - start)))
echo "mmk12 on 1 GPU with $left s"
OMNIRL_NPROC=1 OMNIRL_PARTS=mmk12 OMNIRL_BUDGET_S=$left bash scripts/gpu/two_gpu_runs.sh "$out/mmk12_1gpu" \
    >"$out/mmk12_1gpu.log" 2>&1
tail -n 20 "$out/mmk12_1gpu.log"
