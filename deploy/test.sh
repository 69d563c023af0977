#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, and runs the whole test suite:
#   1. the full build (LibTorch, CUDA sources when nvcc is present), warnings as errors, ctest.
#      Its LibTorch is Debian's (cpu), or, on a machine with an NVIDIA GPU (or with FMOE_CUDA=1),
#      PyPI's CUDA LibTorch (deploy/lib.sh pins it) in build-cuda/ with FMOE_CUDA=ON; there the
#      tests labelled gpu run too, one at a time;
#   2. an ASan+UBSan build of the Torch-free libraries and their tests, ctest;
#   3. a clang build of the libFuzzer targets (tests/fuzz/), ctest -L fuzz: short fuzz runs of
#      the wire decoder and of the router's request parsing, from generated seeds.
# Before stage 1 it prepares .venv with the official `openai` Python client from PyPI for the
# router's compatibility test; without PyPI that test says it was skipped.
# Exits non-zero on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

start=$(date +%s)
stage_start=$start
# Logs how long the stage that just ended took.
stage_done() {
  local now
  now=$(date +%s)
  fmoe_log "$1 took $((now - stage_start)) s"
  stage_start=$now
}

fmoe_install_deps

if fmoe_want_cuda; then
  main_build="$FMOE_ROOT/build-cuda"
  fmoe_build_cuda "$main_build" -DCMAKE_BUILD_TYPE=Release -DFMOE_WERROR=ON
else
  main_build="$FMOE_ROOT/build"
  fmoe_build "$main_build" -DCMAKE_BUILD_TYPE=Release -DFMOE_WERROR=ON
fi
if [ ! -x "$FMOE_ROOT/.venv/bin/python" ] || ! "$FMOE_ROOT/.venv/bin/python" -c "import openai" 2>/dev/null; then
  fmoe_log "installing the openai Python client into .venv (for the router compatibility test)"
  if ! { fmoe_venv && \
         "$FMOE_ROOT/.venv/bin/pip" install -q --disable-pip-version-check openai; }; then
    fmoe_log "PyPI is unreachable: the openai client test will be SKIPPED"
  fi
fi
fmoe_log "running the test suite ($(basename "$main_build")/)"
(cd "$main_build" && ctest --output-on-failure --timeout 900 -j 2 -LE gpu)
fmoe_log "running the gpu tests ($(basename "$main_build")/, label gpu; skipped without a GPU)"
(cd "$main_build" && ctest --output-on-failure --timeout 900 -L gpu)
stage_done "stage 1 ($(basename "$main_build")/)"

fmoe_build "$FMOE_ROOT/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMOE_SANITIZE=ON \
  -DFMOE_WERROR=ON -DFMOE_CUDA=OFF -DFMOE_BUILD_BENCH=OFF
fmoe_log "running the sanitizer suite (build-asan/: ASan+UBSan, Torch-free)"
(cd "$FMOE_ROOT/build-asan" && \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure --timeout 900 -j 2)
stage_done "stage 2 (build-asan/)"

fmoe_build "$FMOE_ROOT/build-fuzz" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DFMOE_FUZZ=ON -DFMOE_TORCH=OFF -DFMOE_CUDA=OFF -DFMOE_BUILD_BENCH=OFF -DFMOE_BUILD_TESTS=OFF \
  -DFMOE_WERROR=ON -- codec_fuzz make_corpus request_fuzz make_request_corpus
fmoe_log "running the fuzz suite (build-fuzz/: libFuzzer+ASan+UBSan, clang)"
(cd "$FMOE_ROOT/build-fuzz" && ctest --output-on-failure -L fuzz)
stage_done "stage 3 (build-fuzz/)"

fmoe_log "all tests passed in $(( $(date +%s) - start )) s"
