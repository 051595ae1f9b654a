#!/usr/bin/env bash
# Install omnirl with its test extras and run the whole suite (lint included). CI runs exactly this.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
OMNIRL_EXTRAS=test source scripts/_env.sh
ruff check .
ruff format --check .
python -m pytest -q "$@"
