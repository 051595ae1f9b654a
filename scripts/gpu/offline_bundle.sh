#!/usr/bin/env bash
# Build an offline install of what a GPU host without internet lacks for omnirl and its vLLM backend, for
# a host that already has CPython 3.12 and torch 2.11.0+cu130 (vLLM 0.26.0 pins that torch).
#   bash scripts/gpu/offline_bundle.sh OUTDIR     (PYTHON: a CPython 3.12, default python3.12)
# OUTDIR gets part_aa, part_ab, ... (60 MiB each): xz-compressed tars of a pre-installed site directory,
# omnirl's own dependencies first, then vLLM's, and qwen.tiktoken (the dashscope wheel's, for the
# Qwen-Image recipes' random-init tokenizer). On the host, with the parts copied into one folder:
#   mkdir -p /tmp/site && cat part_a? | xz -dc | tar -x -i -C /tmp/site && export PYTHONPATH=/tmp/site
# part_aa alone holds omnirl's dependencies: `xz -dc part_aa 2>/dev/null | tar -x -C /tmp/site` writes them
# all and stops where vLLM's begin. The vLLM tree is pared down for Hopper GPUs:
# FlashAttention 2's kernels (Hopper runs FlashAttention 3), the Rust frontend binary and the Blackwell-only
# third-party sources are left out, so the bundle needs fewer parts.
set -euo pipefail
PY="${PYTHON:-python3.12}"
OUT="$(realpath -m "${1:?usage: offline_bundle.sh OUTDIR}")"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for t in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux2014 manylinux1 manylinux_2_5; do
  P="$P --platform ${t}_x86_64"
done
BASE="diffusers==0.42.1 transformers==5.24.0 peft==0.21.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  shtab==1.13.0 av==19.0.2 rapidfuzz==3.14.6 math-verify==0.9.0 latex2sympy2_extended==1.11.0
  antlr4-python3-runtime==4.13.2"
VLLM="vllm==0.26.0 annotated-types==0.8.0 apache-tvm-ffi==0.1.10 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2
  cbor2==6.3.0 depyf==0.20.0 dill==0.4.1 distro==1.9.0 fastapi==0.136.3 flashinfer-python==0.6.14 ijson==3.6.0
  jiter==0.19.0 lark==1.2.2 llguidance==1.6.1 msgspec==0.23.0 openai==2.54.0 openai-harmony==0.0.8
  outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
  python-json-logger==4.2.0 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
  typing-extensions==4.16.0 typing-inspection==0.4.5 xgrammar==0.2.7"
# shellcheck disable=SC2086
"$PY" -m pip install -q $P --no-compile --target "$WORK/site/base" $BASE
# shellcheck disable=SC2086
"$PY" -m pip install -q $P --no-compile --target "$WORK/site/vllm" $VLLM
# shellcheck disable=SC2086
"$PY" -m pip download -q $P -d "$WORK/ds" dashscope==2.0.2
unzip -p "$WORK"/ds/dashscope-*.whl '*/qwen.tiktoken' >"$WORK/site/base/qwen.tiktoken"
V="$WORK/site/vllm/vllm"
rm -f "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$V/vllm-rs" "$V"/third_party/deep_gemm/_C.cpython-31[34]-*.so
rm -rf "$V/third_party/fmha_sm100"
rm -rf "$WORK/site/base/bin" "$WORK/site/vllm/bin"
mkdir -p "$OUT"
rm -f "$OUT"/part_a?
# Two tar archives, each its own xz stream, one after the other: a decoder reads both streams as one, and
# tar stops at the first archive's end unless told to go on (-i), so part_aa alone gives omnirl's
# dependencies whole and nothing of vLLM's.
tar -C "$WORK/site/base" -cf - . | xz -T2 -6 -c >"$WORK/all.xz"
tar -C "$WORK/site/vllm" -cf - . | xz -T2 -6 -c >>"$WORK/all.xz"
split -b 60M "$WORK/all.xz" "$OUT/part_"
(cd "$OUT" && sha256sum part_a? >SHA256SUMS && ls -l part_a?)
