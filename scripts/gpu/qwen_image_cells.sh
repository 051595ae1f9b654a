#!/usr/bin/env bash
# The Qwen-Image packing cells against the stock pipeline, eager and compiled, on the two GPUs of an
# nvidia-h200-x2 machine at once (one single-GPU process per GPU; each cell's time is its own GPU's):
#
#   bash scripts/gpu/qwen_image_cells.sh OUT_DIR [IMAGES]
#
# GPU 0: omnirl packed, max_num_seqs 32: fused CFG eager, CFG as two forwards eager, two forwards compiled.
# GPU 1: two forwards compiled with one prompt bucket, then the stock QwenImagePipeline with 32 prompts
#        per call, eager and with its repeated blocks compiled.
# Full-size random-init Qwen-Image, 512 px, 10 steps, True-CFG 4.0, LoRA r64 (benchmarks/rollout_packing.py).
# Writes OUT_DIR/cells_gpu{0,1}.{json,log}; each JSON is rewritten after every cell.
set -uo pipefail
out=${1:?usage: bash scripts/gpu/qwen_image_cells.sh OUT_DIR [IMAGES]}
images=${2:-64}
mkdir -p "$out"
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
common=(--random-init --images "$images" --serial-requests 0 --logprob-check 0)
CUDA_VISIBLE_DEVICES=0 python benchmarks/rollout_packing.py "${common[@]}" --max-num-seqs 32 \
    --compiled-max-num-seqs --stock-batch --cells 32:split 32:split:compiled \
    --out "$out/cells_gpu0.json" >"$out/cells_gpu0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python benchmarks/rollout_packing.py "${common[@]}" --max-num-seqs \
    --compiled-max-num-seqs --stock-batch 32 --stock-compiled --cells 32:split:single:compiled \
    --out "$out/cells_gpu1.json" >"$out/cells_gpu1.log" 2>&1 &
wait
for g in 0 1; do
    echo "== GPU $g"
    grep -v '^{' "$out/cells_gpu$g.log" | tail -12
done
