#!/usr/bin/env bash
# The mmk12 recipe (GSPO + LoRA r32) on one GPU with a full-size random-init Qwen3-Omni thinker text model
# (48 layers, hidden 2048, 128 experts top 8: scripts.gpu.two_gpu_runs FULL_THINKER), one run per
# placement of its frozen base, each capped or not; what benchmarks/results/mmk12_full_thinker_one_gpu.md
# reports.
#
#   bash scripts/gpu/mmk12_placements.sh OUT_DIR PLACEMENT [PLACEMENT ...]
#   OMNIRL_DRY=1 ...                  # rehearsal on CPU: the tiny thinker, 1 step, < 1 minute a placement
#   OMNIRL_BUDGET_S=540 (default)     # seconds for the whole script; each run stops at what is left
#
# PLACEMENT: replicate (uncapped: the whole base on the GPU, the recipe's kv_cache_gib 32),
# replicate_80gb (capped at 74.5 GiB = 80 GB, the recipe's 80 GB settings: kv_cache_gib 5,
# micro_batch_tokens 8192), offload_80gb (capped; base in host memory, copied onto the GPU for the
# rollout: rollout_gather phase; KV cache 0.4 of the memory then free), offload_unit_80gb (capped;
# streamed one decoder layer per forward, the decode too; 1 step of 32 tokens: each decode step copies the
# whole base). Common settings: 2 steps (1 for offload_unit_80gb), 8 prompts x 16 responses, up to 256 new
# tokens, the uniform_noise reward at 1e-3 beside mmk12's (scripts/gpu/train_entry.py), K12 data from
# scripts/make_k12_data.py, no validation / checkpoint / export / tensorboard.
# Writes OUT_DIR/NAME.log, NAME_metrics.jsonl and NAME.json (python -m scripts.gpu.two_gpu_runs mmk12).
set -uo pipefail
out=${1:?usage: mmk12_placements.sh OUT_DIR PLACEMENT...}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
dry=${OMNIRL_DRY:-0}
budget=${OMNIRL_BUDGET_S:-540}
start=$SECONDS
work=${OMNIRL_WORK:-/tmp/mmk12_placements}  # the checkpoint config and data, kept for the next call
log() { echo "[$(date -u +%T) +$((SECONDS - start)) s] $*" | tee -a "$out/placements.log"; }

if [[ $dry == 1 ]]; then
    shape=--tiny recipe=mmk12_tiny threads=1 steps=1 device=(--device cpu)
    size=(--generation.max_new_tokens 16)
else
    shape=--full recipe=mmk12 threads=8 steps=2 device=()
    size=(--rollout.prompts_per_step 8 --generation.max_new_tokens 256)
fi
if [[ ! -f $work/ready$shape ]]; then
    rm -rf "$work" && mkdir -p "$work"
    if ! python -m scripts.gpu.two_gpu_runs checkpoint --out "$work/thinker" "$shape" --config-only \
        "${device[@]}" >"$out/prepare.log" 2>&1 ||
        ! python scripts/make_k12_data.py --out "$work/k12" --train 64 --val 8 >>"$out/prepare.log" 2>&1; then
        log "prepare failed: $(tail -3 "$out/prepare.log")"
        exit 1
    fi
    touch "$work/ready$shape"
fi
log "placements $* (commit $(git rev-parse --short HEAD 2>/dev/null || echo none), dry=$dry)"

for name in "$@"; do
    case $name in
        replicate) extra=() ;;
        replicate_80gb) extra=(--cap-gib 74.5 --generation.kv_cache_gib 5 --optim.micro_batch_tokens 8192) ;;
        offload_80gb) extra=(--cap-gib 74.5 --distributed.frozen_base offload --generation.kv_cache_gib None
            --generation.kv_cache_fraction 0.4) ;;
        offload_unit_80gb) extra=(--cap-gib 74.5 --distributed.frozen_base offload
            --distributed.rollout_gather unit --generation.kv_cache_gib None --generation.kv_cache_fraction 0.4
            --run.steps 1 --generation.max_new_tokens 32) ;;
        *) log "unknown placement $name"; exit 2 ;;
    esac
    cap=$((budget - (SECONDS - start) - 15))
    if ((cap < 60)); then log "$name skipped: $cap s left"; continue; fi
    log "$name (at most $cap s): ${extra[*]}"
    rm -rf "$work/run_$name"
    OMP_NUM_THREADS=$threads timeout -k 15 "$cap" torchrun --standalone --nproc_per_node 1 \
        -m scripts.gpu.train_entry --noise-weight 0.001 --recipe "$recipe" --random-init \
        --model.path "$work/thinker/random_thinker" --data.train_path "$work/k12/train.jsonl" \
        --data.val_path "$work/k12/val.jsonl" --run.steps "$steps" "${size[@]}" --validation.every 0 \
        --checkpoint.every 0 --export.no-lora-at-end --log.no-tensorboard --log.image_every 1 \
        --run.output_dir "$work/run_$name" "${extra[@]}" >"$out/$name.log" 2>&1
    log "$name exit status $? (124: stopped at its time limit); $(grep -c . "$work/run_$name/metrics.jsonl" \
        2>/dev/null || echo 0) steps logged"
    grep -v -i -E "warn|torchvision|^[WI][0-9]{4} " "$out/$name.log" | grep -v "it/s\]" | tail -4
    if [[ -s $work/run_$name/metrics.jsonl ]]; then
        cp "$work/run_$name/metrics.jsonl" "$out/${name}_metrics.jsonl"
        python -m scripts.gpu.two_gpu_runs mmk12 "$out/${name}_metrics.jsonl" --json "$out/$name.json" 2>&1 |
            tee -a "$out/placements.log"
    fi
done
log "done"
