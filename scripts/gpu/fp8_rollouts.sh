#!/usr/bin/env bash
# The FP8 rollout measurements (rollout.precision fp8, docs/fp8_rollout.md) as single-GPU processes, one
# job per GPU side by side (on one GPU: one job per call):
#
#   bash scripts/gpu/fp8_rollouts.sh OUT_DIR [JOBS] [CAP_S]
#
# JOBS (default "repeats"), in the order given, job i on GPU i:
#   repeats: Qwen-Image, 32 images, FP8 on every step packed compiled against the stock pipeline
#            compiled, timed in turn three times (--interleave --repeats 3)
#   repeats128: the same pair at the reference's 128 images, timed in turn twice (--repeats 2)
#   qwen128: Qwen-Image at the reference's 128 images: bf16, FP8 on every step, FP8 on the untrained
#            steps, all packed compiled, and the stock pipeline compiled
#   sd3:    SD3.5-Medium at its recipe's 48 images per GPU, the same four
#   wan:     Wan2.2 TI2V-5B, 16 videos, the same four
#   flux:    FLUX.1-dev at flux_dancegrpo_hpsv3's settings (720 px, 16 steps, no true CFG), 24 images in
#            batches of 12 (a group), the same four, the base in bf16 under a LoRA (the recipe's full
#            fine-tune keeps float32 weights: with the stock pipeline's batches beside them, more than 80 GB)
#   fluxstep: three whole steps (step 0, then two steady ones) of flux_dancegrpo_hpsv3 compiled, bf16 then
#            FP8 on the untrained steps, with a LoRA (the recipe's full fine-tune of 12 B weights with Adam
#            does not fit one GPU)
#   solrl:   one whole step (then a second) of qwen_image_flowgrpo_ocr compiled: bf16, FP8 on the untrained
#            steps, and Sol-RL (FP8 on every step, 2 best + 2 worst of each group regenerated in bf16)
# Full-size random-init models (benchmarks.rollout_packing, scripts.gpu.phase_memory); QWEN_BPE=path to
# qwen.tiktoken gives Qwen-Image the real Qwen2 tokenizer. Writes OUT_DIR/fp8_JOB*.{json,log}; each
# rollout_packing JSON is rewritten after every cell; CAP_S (default 560) stops a job.
set -uo pipefail
out=${1:?usage: bash scripts/gpu/fp8_rollouts.sh OUT_DIR [JOBS] [CAP_S]}
read -r -a jobs <<<"${2:-repeats}"
cap=${3:-560}
mkdir -p "$out" && out=$(realpath "$out")
bpe=${QWEN_BPE:+$(realpath "$QWEN_BPE")}  # before the cd below
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
qwen=(--model qwen_image)
[[ -n $bpe ]] && qwen+=(--qwen-bpe "$bpe")
common=(--random-init --serial-requests 0 --logprob-check 0 --max-num-seqs --compiled-max-num-seqs
    --stock-compiled --no-stock-eager)
four() {  # MAX_NUM_SEQS SPLIT: bf16, FP8 every step, FP8 untrained steps (CFG as SPLIT says)
    echo "--cells $1$2:compiled $1$2:compiled:fp8 $1$2:compiled:fp8:untrained --stock-batch $1"
}
run_job() {  # JOB GPU
    local job=$1 gpu=$2 args
    case $job in
    repeats) read -r -a args <<<"--images 32 --cells 32:split:compiled:fp8 --stock-batch 32 --interleave --repeats 3" ;;
    repeats128) read -r -a args <<<"--images 128 --cells 32:split:compiled:fp8 --stock-batch 32 --interleave --repeats 2" ;;
    qwen128) read -r -a args <<<"--images 128 $(four 32 :split)" ;;
    sd3) read -r -a args <<<"--model sd3 --images 48 $(four 32 '')" ;;
    wan) read -r -a args <<<"--model wan_ti2v --images 16 $(four 16 :split)" ;;
    flux) read -r -a args <<<"--model flux --finetune lora --images 24 --steps 16 $(four 12 '')" ;;
    fluxstep)
        for mode in bf16 untrained; do
            local extra=()
            [[ $mode != bf16 ]] && extra=(--rollout.precision fp8)
            CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29555 + gpu)) timeout -k 10 "$cap" \
                python -m scripts.gpu.phase_memory --recipe flux_dancegrpo_hpsv3 --steps 3 --rollout.compile \
                --model.finetune lora "${extra[@]}" --out "$out/fp8_fluxstep_$mode" \
                >"$out/fp8_fluxstep_$mode.log" 2>&1
        done
        return
        ;;
    solrl)
        local recipe=(--recipe qwen_image_flowgrpo_ocr --steps 2 --rollout.compile)
        [[ -n $bpe ]] && recipe+=(--qwen-bpe "$bpe")
        for mode in bf16 untrained solrl; do
            local extra=()
            [[ $mode != bf16 ]] && extra=(--rollout.precision fp8)
            [[ $mode == solrl ]] && extra+=(--rollout.fp8.select 2)
            CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29555 + gpu)) timeout -k 10 "$cap" \
                python -m scripts.gpu.phase_memory "${recipe[@]}" "${extra[@]}" \
                --out "$out/fp8_solrl_$mode" >"$out/fp8_solrl_$mode.log" 2>&1
        done
        return
        ;;
    *) echo "unknown job $job" >&2 && return 2 ;;
    esac
    local model=("${qwen[@]}")
    [[ " ${args[*]} " == *" --model "* ]] && model=()
    # Each process opens its own 1-rank process group: one port each.
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29555 + gpu)) timeout -k 10 "$cap" \
        python -m benchmarks.rollout_packing "${model[@]}" "${common[@]}" "${args[@]}" \
        --out "$out/fp8_$job.json" >"$out/fp8_$job.log" 2>&1
}
for gpu in "${!jobs[@]}"; do
    run_job "${jobs[$gpu]}" "$gpu" &
done
wait
for log in "$out"/fp8_*.log; do
    echo "== $log"
    grep -v '^{' "$log" | tail -12
done
