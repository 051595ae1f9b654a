#!/usr/bin/env bash
# Rollout packing and the mmk12 recipe on two GPUs, in one command of ~5-6 minutes (it stops itself within
# OMNIRL_BUDGET_S, default 540 s):
#
#   bash scripts/gpu/two_gpu_runs.sh OUT_DIR
#   OMNIRL_DRY=1 bash scripts/gpu/two_gpu_runs.sh OUT_DIR   # rehearsal on CPU: tiny sizes, gloo, < 1 minute
#   OMNIRL_PARTS=mmk12 OMNIRL_BUDGET_S=240 ...               # one of the two runs, a shorter budget
#   OMNIRL_NPROC=1 ...                                       # on one GPU
#   OMNIRL_TRAIN_ARGS="--rollout.backend vllm" ...           # more overrides of the mmk12 run
#
# 1. Rollout packing, Qwen-Image (full size, random init, 512 px, 10 steps, True-CFG 4.0) on 2 GPUs:
#    `torchrun --nproc_per_node 2 -m benchmarks.rollout_packing`, 32 images per GPU, serial (timed on 2
#    requests per GPU, scaled) against packed (max_num_seqs 32); generation time per step = the slowest
#    GPU's. The counterpart of VeRL-Omni's 226 s serial -> 108 s packed (32 prompts x 16 images, 4 GPUs,
#    128 images per GPU); the summary also scales ours to 128 images per GPU.
# 2. The mmk12 recipe for 3 steps on 2 GPUs (`torchrun --nproc_per_node 2 scripts/train.py --recipe mmk12`
#    through scripts.gpu.train_entry, which adds the uniform_noise reward at 1e-3: a random-init model earns
#    no mmk12 reward, and groups without spread would be dropped, leaving no update to time), on a
#    random-init Qwen3-Omni-shaped thinker (scripts.gpu.two_gpu_runs checkpoint: 8 MoE layers, hidden
#    2048, 32 experts top 8, vocab 151936, bf16, lm_head x4) loaded through model.path, with K12 data from
#    scripts/make_k12_data.py; the recipe's settings except 8 prompts (x 16 responses: 64 per GPU) per step,
#    up to 256 new tokens, and no validation, checkpoint, LoRA export or tensorboard. Per step: time split
#    into generation, scoring wait and update, peak memory per GPU, actor-vs-rollout probability Pearson and
#    |dlogp| (bf16).
#
# Everything measured goes under OUT_DIR: summary.md (both tables), summary.log, rollout_packing.{json,log},
# rollout_packing_summary.json, mmk12.log, mmk12/metrics.jsonl (+ samples/), mmk12_summary.json,
# prepare.log. The checkpoint and data live in a temporary folder, removed at the end.
# Needs torch, transformers (>= 5.24 for part 2: 5.17's thinker has no model.language_model, so the LoRA
# finds no decoder layer), peft, diffusers, tyro, math-verify (+ latex2sympy2_extended, antlr4); pyarrow is
# optional (without it the K12 data are the repo's data/mmk12_tiny, written by the same generator).
set -uo pipefail

out=${1:?usage: bash scripts/gpu/two_gpu_runs.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
dry=${OMNIRL_DRY:-0}
budget=${OMNIRL_BUDGET_S:-540}  # seconds for the whole script (540: it ends inside a 10-minute job limit)
parts=${OMNIRL_PARTS:-packing,mmk12}  # which of the two runs
nproc=${OMNIRL_NPROC:-2}        # ranks (GPUs) of both runs
packing_cap=280                 # the packing run's most; the training run gets what is left
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

log() { echo "[$(date +%T) +$((SECONDS - start)) s] $*" | tee -a "$out/summary.log"; }
left() { echo $((budget - (SECONDS - start))); }

log "two_gpu_runs: OUT=$out dry=$dry commit=$(git rev-parse --short HEAD 2>/dev/null || echo none)"
python - <<'EOF' 2>&1 | tee -a "$out/summary.log"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "GPUs", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for m in ("transformers", "peft", "diffusers", "tyro", "math_verify", "pyarrow"):
    spec = importlib.util.find_spec(m)
    print(m, "MISSING" if spec is None else getattr(__import__(m), "__version__", "ok"))
import transformers
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
    print("WARNING: transformers < 5.24: the mmk12 run will fail at LoRA injection (model.language_model)")
EOF
if [[ $dry == 1 ]]; then
    ckpt_args=(--tiny --device cpu)
    k12_args=(--train 16 --val 4)
    threads=1
else
    ckpt_args=(--device cpu)  # on the host, beside the packing run, whose GPUs stay its own
    k12_args=(--train 64 --val 8)
    threads=8  # per rank (torchrun's default is 1): host-side work of the rollouts
fi

# The thinker checkpoint and the K12 data, in the background while the packing run builds its models.
if python -c "import pyarrow" 2>/dev/null; then
    data=$work/k12
    make_data=(python scripts/make_k12_data.py --out "$data" "${k12_args[@]}")
else
    data=data/mmk12_tiny
    make_data=(echo "pyarrow missing: K12 data from $data (written by scripts/make_k12_data.py)")
fi
(
    OMP_NUM_THREADS=4 nice -n 10 python -m scripts.gpu.two_gpu_runs checkpoint --out "$work/thinker" \
        "${ckpt_args[@]}" && "${make_data[@]}"
) >>"$out/prepare.log" 2>&1 &  # appended to, as the dry run's tiny Qwen-Image build is
prepare=$!

# ------------------------------------------------------------------------------------- 1. rollout packing
if [[ $dry == 1 ]]; then
    python scripts/make_tiny_models.py --out "$work/tiny" --only qwen_image >>"$out/prepare.log" 2>&1
    packing_args=(--path "$work/tiny/qwen_image" --images 4 --serial-requests 1 --max-num-seqs 4 --size 64
        --steps 2)
else
    packing_args=(--random-init --images 32 --serial-requests 2 --max-num-seqs 32)
fi
if [[ ,$parts, == *,packing,* ]]; then
    log "1. rollout packing (at most $packing_cap s)"
    OMP_NUM_THREADS=$threads timeout -k 20 "$packing_cap" \
        torchrun --standalone --nproc_per_node "$nproc" -m benchmarks.rollout_packing "${packing_args[@]}" \
        --compiled-max-num-seqs --stock-batch --logprob-check 0 \
        --out "$out/rollout_packing.json" >"$out/rollout_packing.log" 2>&1
    log "rollout packing exit status $? (124: stopped at its time limit); last lines of its log:"
    grep -v -i -E "warn|torchvision|^[WI][0-9]{4} " "$out/rollout_packing.log" | tail -8
fi
if [[ -f $out/rollout_packing.json ]]; then
    python -m scripts.gpu.two_gpu_runs packing "$out/rollout_packing.json" \
        --json "$out/rollout_packing_summary.json" >"$work/packing.md" 2>&1
    cat "$work/packing.md"
fi

# ------------------------------------------------------------------------------------- 2. mmk12 training
wait "$prepare"
prepared=$?
log "checkpoint and data: exit status $prepared; last lines of prepare.log:"
tail -3 "$out/prepare.log"
if [[ $dry == 1 ]]; then
    train_args=(--run.steps 2 --rollout.prompts_per_step 2 --rollout.group_size 4
        --generation.max_new_tokens 16 --generation.kv_cache_gib 0.25 --model.dtype float32
        --distributed.param_dtype float32 --reward.num_workers 2 --optim.mini_batches 2)
else
    train_args=(--run.steps 3 --rollout.prompts_per_step 8 --generation.max_new_tokens 256)
fi
read -r -a extra_train_args <<<"${OMNIRL_TRAIN_ARGS:-}"
train_args+=("${extra_train_args[@]}")
train_cap=$(($(left) - 25))
if [[ ,$parts, != *,mmk12,* ]]; then
    log "2. mmk12 training not asked for (OMNIRL_PARTS=$parts)"
elif [[ $prepared == 0 && $train_cap -gt 60 ]]; then
    log "2. mmk12 training (at most $train_cap s)"
    OMP_NUM_THREADS=$threads timeout -k 20 "$train_cap" \
        torchrun --standalone --nproc_per_node "$nproc" -m scripts.gpu.train_entry --noise-weight 0.001 \
        --recipe mmk12 --model.path "$work/thinker/random_thinker" \
        --data.train_path "$data/train.jsonl" --data.val_path "$data/val.jsonl" \
        --run.output_dir "$out/mmk12" --validation.every 0 --checkpoint.every 0 --export.no-lora-at-end \
        --log.no-tensorboard \
        --log.image_every 1 "${train_args[@]}" >"$out/mmk12.log" 2>&1
    log "mmk12 training exit status $? (124: stopped at its time limit); last lines of its log:"
    grep -v -i -E "warn|torchvision|^[WI][0-9]{4} " "$out/mmk12.log" | tail -8
else
    log "2. mmk12 training skipped: prepare exit status $prepared, $train_cap s left"
fi
if [[ -s $out/mmk12/metrics.jsonl ]]; then
    python -m scripts.gpu.two_gpu_runs mmk12 "$out/mmk12/metrics.jsonl" --json "$out/mmk12_summary.json" \
        >"$work/mmk12.md" 2>&1
    cat "$work/mmk12.md"
fi

{
    echo "# rollout packing and mmk12 on $nproc GPUs ($(date -u +%F), dry=$dry)"
    echo
    echo "## 1. Rollout packing (python -m benchmarks.rollout_packing ${packing_args[*]})"
    echo
    cat "$work/packing.md" 2>/dev/null || echo "(no result)"
    echo
    echo "## 2. mmk12, $nproc ranks (${train_args[*]})"
    echo
    cat "$work/mmk12.md" 2>/dev/null || echo "(no result)"
} >"$out/summary.md"
log "done in $((SECONDS - start)) s; wrote $out/summary.md"
