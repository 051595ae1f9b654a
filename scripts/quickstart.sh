#!/usr/bin/env bash
# omnirl quickstart: install, write the tiny models, run a real 2-rank Flow-GRPO run on CPU.
#   bash scripts/quickstart.sh [--section.field value ...]   (extra flags override the recipe)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
python scripts/make_tiny_models.py --out tiny_models --only sd3
# --nproc_per_node: train.py checks the config, then starts the 2 ranks as `torchrun --standalone` does (a
# rendezvous on a free local port, so a second quickstart or any other job never collides).
python scripts/train.py --nproc_per_node 2 --recipe sd3_tiny_flowgrpo "$@"
python scripts/summarize_run.py outputs/sd3_tiny_flowgrpo/metrics.jsonl
