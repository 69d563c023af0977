#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the whole system on this
# machine (map service, worker ranks, router on http://127.0.0.1:8000) with the shipped tiny
# model, in the foreground. Ctrl-C stops everything.
#   deploy/up.sh [MANIFEST]
# Without a GPU: Debian's LibTorch, build/, and deploy/manifests/local.yaml (two cpu ranks).
# With an NVIDIA GPU (or FMOE_CUDA=1): PyPI's CUDA LibTorch (pinned in deploy/lib.sh, installed
# into .venv), build-cuda/ with FMOE_CUDA=ON, and deploy/manifests/cuda.yaml (one rank on
# cuda:0; local.yaml when FMOE_CUDA=1 finds no GPU). FMOE_CUDA=0 keeps the cpu way on a GPU
# machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

fmoe_install_deps
targets=(fmoe fmoe-router fmoe-map-service fmoe-worker)
if fmoe_want_cuda; then
  build="$FMOE_ROOT/build-cuda"
  if fmoe_have_gpu; then
    default_manifest="$FMOE_ROOT/deploy/manifests/cuda.yaml"
  else
    fmoe_log "FMOE_CUDA=1 but no GPU here: the GPU build serves with cpu ranks"
    default_manifest="$FMOE_ROOT/deploy/manifests/local.yaml"
  fi
  fmoe_build_cuda "$build" -DCMAKE_BUILD_TYPE=Release -- "${targets[@]}"
else
  build="$FMOE_ROOT/build"
  default_manifest="$FMOE_ROOT/deploy/manifests/local.yaml"
  fmoe_build "$build" -DCMAKE_BUILD_TYPE=Release -- "${targets[@]}"
fi
manifest="${1:-$default_manifest}"
fmoe_log "starting: $(basename "$build")/bin/fmoe launch $manifest"
exec "$build/bin/fmoe" launch "$manifest"
