#!/usr/bin/env bash
# The whole RL step on one GPU, per diffusion recipe, through scripts.gpu.phase_memory (full-size random-init
# models, the trainer itself): the steady-state split (generation, scoring wait, the update's forward, KL
# reference pass, backward and optimizer, sleep/wake), step 0 apart, images/s and each phase's MFU.
#
#   bash scripts/gpu/step_time.sh OUT_DIR [JOBS] [CAP_S]
#
# JOBS (default "sd35 sd35_compiled"), in the order given, one process each:
#   sd35:          SD3.5-Medium Flow-GRPO LoRA at the reference comparison's settings (512 px, 10 steps, CFG
#                  4.5, 4 prompts x 8 images, LoRA r32 on the attention projections, micro-batches of 8,
#                  2 optimizer steps, kl_beta 0.04, T5 at 128 tokens, the JPEG compressibility reward), the
#                  recipe's shipped defaults otherwise (gradient checkpointing auto)
#   sd35_compiled: the same with train.compile and rollout.compile
#   sd35_gc:       the same as sd35 with gradient checkpointing forced on (the recipes' former value)
#   sd35_sleep:    the same as sd35 with every sleep forced on (memory.sleep true; the default auto keeps on
#                  the device, from step 1, what step 0's peaks say fits)
#   sd35_mb16, sd35_mb32: the same as sd35 with micro-batches of 16 / 32 rows (optim.micro_batch_size; the
#                  loss is normalised by the mini-batch, so the update is the same whatever the size)
#   sd35_fp8:      sd35_compiled with FP8 in both halves: rollout.precision fp8 at every step and
#                  train.precision fp8 (one function: no bf16 recompute of the old log-probs)
#   qwen:          Qwen-Image Flow-GRPO OCR LoRA at its recipe's settings, 32 images, the JPEG reward (the
#                  recipe compiles its rollout and its update)
#   qwen_compiled: the same with train.compile and rollout.compile named (what the recipe now sets)
#   qwen_eager:    the same as qwen with the update eager (train.compile false)
#   wan:           Wan2.2 TI2V-5B DanceGRPO at its recipe's settings (704x1280, 9 frames, 10 steps, True-CFG
#                  5.0 as two forwards, 5 trained steps a video, micro-batches of 4, 4 optimizer steps) as a
#                  one-GPU LoRA run (r32 on the attention projections; the recipe is a full fine-tune on 8
#                  GPUs), 2 prompts x 8 videos, the frames' brightness as reward; as the recipe ships (the
#                  rollout compiled, the update eager)
#   wan_compiled:  the same with train.compile too
#   wan_eager:     the same with rollout.compile false (both halves eager)
#   ltx:           LTX-2.3 text to video + audio Flow-GRPO LoRA at its recipe's settings (256x384, 81 frames
#                  with audio, 24 steps, CFG fused, 3 trained steps a video, LoRA r64, micro-batches of 4),
#                  1 prompt x 8 videos (the rollout's max_num_seqs), the audio's loudness as reward; eager
#                  as the recipe ships (its models take ~68 GiB: an H200)
#   ltx_compiled:  the same with train.compile and rollout.compile
#   bagel:         BAGEL-7B-MoT Flow-GRPO OCR LoRA at its recipe's settings (512 px, 15 steps, three-branch
#                  CFG, 2 trained steps an image, LoRA r64, micro-batches of 8, 2 optimizer steps), 2 prompts
#                  x 16 images, the JPEG reward; eager as the recipe ships
#   bagel_compiled: the same with train.compile and rollout.compile
# Writes OUT_DIR/step_JOB.{json,md,log}; CAP_S (default 280) stops a job (its JSON is still written).
# QWEN_BPE=path to qwen.tiktoken gives Qwen-Image the real Qwen2 tokenizer. STEP_ARGS="--steps 8" appends
# arguments to every job's (the last of a repeated argument counts). TINY=1: the tiny recipes on the
# CPU, 2 steps (a rehearsal of the plumbing).
set -uo pipefail
out=${1:?usage: bash scripts/gpu/step_time.sh OUT_DIR [JOBS] [CAP_S]}
read -r -a jobs <<<"${2:-sd35 sd35_compiled}"
cap=${3:-280}
mkdir -p "$out" && out=$(realpath "$out")
bpe=${QWEN_BPE:+$(realpath "$QWEN_BPE")}
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ckpt=${CKPT_DIR:-/tmp/omnirl_step_ckpt}
write() {  # MODEL: the random-init checkpoint, written once per machine
    [[ -f $ckpt/$1/model_index.json ]] && return
    local extra=""
    [[ $1 == qwen_image && -n $bpe ]] && extra=", '$bpe'"
    python -c "from pathlib import Path; from omnirl.models import write_random_checkpoint as w; \
w('$1', Path('$ckpt/$1')$extra)"
}
sd35=(--recipe sd35_flowgrpo_ocr --rollout.prompts_per_step 4 --rollout.group_size 8
    --family.max_sequence_length 128 --reward jpeg_compressibility=1 --steps 4)
qwen=(--recipe qwen_image_flowgrpo_ocr --rollout.prompts_per_step 4 --rollout.group_size 8
    --reward jpeg_compressibility=1 --steps 3)
wan=(--recipe wan22_ti2v_dancegrpo --model.finetune lora --lora.rank 32 --lora.alpha 64
    --rollout.prompts_per_step 2 --rollout.group_size 8 --reward video_brightness=1 --steps 3)
ltx=(--recipe ltx23_t2av_flowgrpo_lora --rollout.prompts_per_step 1 --rollout.group_size 8
    --reward audio_loudness=1 --steps 3)
bagel=(--recipe bagel_flowgrpo_ocr_lora --rollout.prompts_per_step 2 --rollout.group_size 16
    --reward jpeg_compressibility=1 --steps 3)
[[ -n $bpe ]] && qwen+=(--qwen-bpe "$bpe")
compiled=(--train.compile true --rollout.compile true)
fp8=(--rollout.precision fp8 --rollout.fp8.steps all --train.precision fp8)
for job in "${jobs[@]}"; do
    case $job in
    sd35) model=sd3 args=("${sd35[@]}") ;;
    sd35_compiled) model=sd3 args=("${sd35[@]}" "${compiled[@]}") ;;
    sd35_gc) model=sd3 args=("${sd35[@]}" --model.gradient_checkpointing true) ;;
    sd35_sleep) model=sd3 args=("${sd35[@]}" --memory.sleep true) ;;
    sd35_mb16) model=sd3 args=("${sd35[@]}" --optim.micro_batch_size 16) ;;
    sd35_mb32) model=sd3 args=("${sd35[@]}" --optim.micro_batch_size 32) ;;
    sd35_fp8) model=sd3 args=("${sd35[@]}" "${compiled[@]}" "${fp8[@]}") ;;
    qwen) model=qwen_image args=("${qwen[@]}") ;;
    qwen_compiled) model=qwen_image args=("${qwen[@]}" "${compiled[@]}") ;;
    qwen_eager) model=qwen_image args=("${qwen[@]}" --train.compile false) ;;
    wan) model=wan_ti2v args=("${wan[@]}") ;;
    wan_compiled) model=wan_ti2v args=("${wan[@]}" "${compiled[@]}") ;;
    wan_eager) model=wan_ti2v args=("${wan[@]}" --rollout.compile false) ;;
    ltx) model=ltx2 args=("${ltx[@]}") ;;
    ltx_compiled) model=ltx2 args=("${ltx[@]}" "${compiled[@]}") ;;
    bagel) model=bagel args=("${bagel[@]}") ;;
    bagel_compiled) model=bagel args=("${bagel[@]}" "${compiled[@]}") ;;
    *) echo "step_time.sh: unknown job $job" >&2; exit 2 ;;
    esac
    if [[ ${TINY:-0} == 1 ]]; then
        args+=(--tiny --steps 2 --rollout.prompts_per_step 2 --rollout.group_size 2)
    else
        write "$model" || exit 1
        args+=(--model.path "$ckpt/$model")
    fi
    read -r -a more <<<"${STEP_ARGS:-}"
    args+=("${more[@]}")
    mkdir -p "$out/$job"
    python -m scripts.gpu.phase_memory "${args[@]}" --budget-s "$cap" --out "$out/$job" 2>&1 |
        tee "$out/step_$job.log"
    for f in "$out/$job"/*.json; do [[ -f $f ]] && cp "$f" "$out/step_$job.json"; done
    for f in "$out/$job"/*.md; do [[ -f $f ]] && cp "$f" "$out/step_$job.md"; done
    rm -rf "${out:?}/$job"
done
