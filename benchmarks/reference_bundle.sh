#!/usr/bin/env bash
# What a GPU host without internet needs, beyond omnirl's offline bundle (scripts/gpu/offline_bundle.sh), to
# run the reference Flow-GRPO trainer under benchmarks/reference_step.py:
#   bash benchmarks/reference_bundle.sh OUTDIR FLOW_GRPO_CHECKOUT     (PYTHON: default python3)
# OUTDIR gets wheels/ and flow_grpo/ (the checkout's code, its COMMIT beside it). On the host:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site OUTDIR/wheels/*.whl
# Its train_sd3.py imports, at the top, absl, accelerate, ml_collections, diffusers, peft, torch, numpy, tqdm,
# PIL and wandb; its rewards module for jpeg_compressibility only PIL, numpy and torch. The host image holds
# absl-py, numpy, tqdm, pillow and pyyaml, the offline bundle diffusers, transformers and peft; missing are
# ml_collections (and absl-py, carried so the pair is one known version) and accelerate 1.4.0, the reference's
# pin: its script reaches the policy through `.module` (the DDP wrapper), which accelerate after 1.4 no
# longer puts on a one-process run. wandb is stubbed by the runner, not carried. The checkout's dataset/
# (prompt lists, some stored as LFS pointers) and *.pth (the aesthetic scorer's weights) are left out: the
# runner writes its own prompts and the JPEG reward needs no weights.
set -euo pipefail
PY="${PYTHON:-python3}"
OUT="$(realpath -m "${1:?usage: reference_bundle.sh OUTDIR FLOW_GRPO_CHECKOUT}")"
REF="$(realpath "${2:?usage: reference_bundle.sh OUTDIR FLOW_GRPO_CHECKOUT}")"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
P="$P --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
rm -rf "$OUT/wheels" "$OUT/flow_grpo"
mkdir -p "$OUT/wheels" "$OUT/flow_grpo"
# shellcheck disable=SC2086
"$PY" -m pip download -q $P -d "$OUT/wheels" accelerate==1.4.0 ml_collections==1.1.0 absl-py==2.5.1
tar -C "$REF" --exclude=./.git --exclude=./dataset --exclude='*.pth' -cf - . | tar -C "$OUT/flow_grpo" -xf -
if [[ ! -f $OUT/flow_grpo/COMMIT ]]; then
    git -C "$REF" rev-parse HEAD >"$OUT/flow_grpo/COMMIT"
fi
du -sh "$OUT"
