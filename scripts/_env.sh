# Sourced by quickstart.sh and test.sh: use the active virtualenv, or create .venv, and install omnirl.
# CPU machines get torch 2.13.0 (CPU build) first; machines that already have torch keep theirs.
set -euo pipefail
if [ -z "${VIRTUAL_ENV:-}" ]; then
  # --system-site-packages: a machine-wide torch (GPU images) stays visible and is kept.
  [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
  source .venv/bin/activate
fi
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
fi
python -m pip install -q -e ".[${OMNIRL_EXTRAS:-ocr}]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import omnirl, torch, diffusers" || { echo "omnirl install failed" >&2; exit 1; }
