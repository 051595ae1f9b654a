#!/usr/bin/env bash
# Install omnirl with its test extras and run the whole suite (lint included). CI runs exactly this.
#   bash scripts/test.sh [pytest args]
# Then, with no pytest args (or OMNIRL_VLLM_TESTS=1), the vLLM rollout tests (`-m vllm`) run in the separate
# venv of scripts/vllm_cpu_env.sh (built from scratch on a fresh machine, ~2.5-4 min); in the main venv they
# skip, vllm not being importable there. OMNIRL_VLLM_TESTS=0 leaves them out.
set -euo pipefail
cd "$(dirname "$0")/.."
OMNIRL_EXTRAS=test source scripts/_env.sh
ruff check .
ruff format --check .
python -m pytest -q "$@"
if [ "${OMNIRL_VLLM_TESTS:-$([ "$#" -eq 0 ] && echo 1 || echo 0)}" = 1 ]; then
  bash scripts/vllm_cpu_env.sh .venv-vllm
  PYTHONPATH="$PWD" .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm.py
fi
