#!/usr/bin/env bash
# The Qwen-Image packing cells against the stock pipeline, eager and compiled, as single-GPU processes
# side by side on the GPUs of one machine (each cell's time is its own GPU's):
#
#   bash scripts/gpu/qwen_image_cells.sh OUT_DIR [IMAGES] [JOBS] [CAP_S]
#
# JOBS (default "ours stock"), one GPU each, in order:
#   ours:   omnirl packed, max_num_seqs 32: fused CFG eager, CFG as two forwards eager, two forwards compiled
#   stock:  the stock QwenImagePipeline with 32 prompts per call, eager, then with its blocks compiled
#   single: omnirl packed, two forwards, one prompt bucket, compiled
# Full-size random-init Qwen-Image, 512 px, 10 steps, True-CFG 4.0, LoRA r64 (benchmarks.rollout_packing);
# QWEN_BPE=path/to/qwen.tiktoken gives it the real Qwen2 tokenizer (--qwen-bpe: real prompt lengths).
# Writes OUT_DIR/cells_JOB.{json,log}; each JSON is rewritten after every cell; CAP_S stops a job.
set -uo pipefail
out=${1:?usage: bash scripts/gpu/qwen_image_cells.sh OUT_DIR [IMAGES] [JOBS] [CAP_S]}
images=${2:-64}
read -r -a jobs <<<"${3:-ours stock}"
cap=${4:-560}
mkdir -p "$out" && out=$(realpath "$out")
bpe=${QWEN_BPE:+$(realpath "$QWEN_BPE")}  # before the cd below
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
common=(--random-init --images "$images" --serial-requests 0 --logprob-check 0 --max-num-seqs
    --compiled-max-num-seqs --stock-batch)
[[ -n $bpe ]] && common+=(--qwen-bpe "$bpe")
for gpu in "${!jobs[@]}"; do
    job=${jobs[$gpu]}
    case $job in
    ours) args=(--cells 32 32:split 32:split:compiled) ;;
    stock) args=(--stock-batch 32 --stock-compiled) ;;
    single) args=(--cells 32:split:single:compiled) ;;
    *) echo "unknown job $job" >&2 && exit 2 ;;
    esac
    # Each process opens its own 1-rank process group: one port each.
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29555 + gpu)) timeout -k 10 "$cap" \
        python -m benchmarks.rollout_packing "${common[@]}" "${args[@]}" \
        --out "$out/cells_$job.json" >"$out/cells_$job.log" 2>&1 &
done
wait
for job in "${jobs[@]}"; do
    echo "== $job"
    grep -v '^{' "$out/cells_$job.log" | tail -8
done
