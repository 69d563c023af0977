#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, and runs the whole test suite:
#   1. the full build (LibTorch, CUDA sources when nvcc is present), warnings as errors, ctest.
#      Its LibTorch is Debian's (cpu), or, on a machine with an NVIDIA GPU (or with FMOE_CUDA=1),
#      PyPI's CUDA LibTorch (deploy/lib.sh pins it) in build-cuda/ with FMOE_CUDA=ON; there the
#      tests labelled gpu run too, one at a time;
#   2. an ASan+UBSan build of the Torch-free libraries and their tests, ctest;
#   3. a clang build of the libFuzzer targets (tests/fuzz/), ctest -L fuzz: short fuzz runs of
#      the wire decoder, the router's request parsing, the tiktoken.model reader and the chat
#      template compiler and renderer (among others), from generated seeds;
#   4. when stage 1 used Debian's LibTorch: the GPU build's guard, for machines without a GPU
#      (CI): build-cuda/ against PyPI's CUDA LibTorch with FMOE_CUDA=ON, and the tests that run
#      LibTorch code but for those of the processes working together (ctest -L torch
#      -LE 'gpu|cluster'). Skipped, saying so, when PyPI is unreachable or nvcc is missing;
#      FMOE_CUDA=0 leaves it out.
# Before stage 1 it prepares .venv with the official `openai` and `anthropic` Python clients,
# `langchain-openai` and lm-evaluation-harness (`lm-eval[api]`, without torch: its API models and
# the router's remote tokenizer need none) from PyPI for the router's compatibility tests; without
# PyPI those tests say they were skipped.
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
if [ ! -x "$FMOE_ROOT/.venv/bin/python" ] ||
   ! "$FMOE_ROOT/.venv/bin/python" -c "import openai, anthropic, langchain_openai, lm_eval, tenacity" \
     2>/dev/null; then
  fmoe_log "installing the openai, anthropic, langchain-openai and lm-eval Python clients into .venv (router compatibility tests)"
  if ! { fmoe_venv && \
         "$FMOE_ROOT/.venv/bin/pip" install -q --disable-pip-version-check openai anthropic \
           langchain-openai "lm-eval[api]==$FMOE_LM_EVAL_VERSION"; }; then
    fmoe_log "PyPI is unreachable: the openai, anthropic, langchain and lm-eval client tests will be SKIPPED"
  fi
fi
fmoe_log "running the test suite ($(basename "$main_build")/)"
(cd "$main_build" && ctest --output-on-failure --timeout 900 -j 2 -LE gpu)
fmoe_log "running the gpu tests ($(basename "$main_build")/, label gpu; skipped without a GPU)"
(cd "$main_build" && ctest --output-on-failure --timeout 900 -L gpu)
stage_done "stage 1 ($(basename "$main_build")/)"

# -O0 -g1: the sanitizers' checks are the point here, not speed, and -O0 compiles in about half
# the time of -O1 (bench/RESULTS.md, "Build and test time"); the host kernels, the JSON parser
# and the grammar matcher keep -O1 (their CMakeLists.txt) so the tests that drive them stay
# quick. malloc_context_size=12 (30 by default): an allocation's recorded stack, which the
# allocation-heavy request tests spend most of their time recording, still twelve frames deep.
fmoe_build "$FMOE_ROOT/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFMOE_SANITIZE=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O0 -g1 -DNDEBUG" \
  -DFMOE_WERROR=ON -DFMOE_CUDA=OFF -DFMOE_BUILD_BENCH=OFF
fmoe_log "running the sanitizer suite (build-asan/: ASan+UBSan, Torch-free)"
(cd "$FMOE_ROOT/build-asan" && \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:malloc_context_size=12 \
  UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure --timeout 900 -j 2)
stage_done "stage 2 (build-asan/)"

fmoe_build "$FMOE_ROOT/build-fuzz" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DFMOE_FUZZ=ON -DFMOE_TORCH=OFF -DFMOE_CUDA=OFF -DFMOE_BUILD_BENCH=OFF -DFMOE_BUILD_TESTS=OFF \
  -DFMOE_WERROR=ON -- codec_fuzz make_corpus request_fuzz make_request_corpus curve_key_fuzz \
  model_config_fuzz make_config_corpus tiktoken_fuzz make_tiktoken_corpus \
  tool_calls_fuzz make_tool_calls_corpus \
  json_schema_fuzz make_json_schema_corpus grammar_fuzz make_grammar_corpus \
  chat_template_fuzz make_template_corpus harmony_fuzz make_harmony_corpus make_curve_key_corpus \
  think_fuzz make_think_corpus \
  plan_fuzz make_plan_corpus
fmoe_log "running the fuzz suite (build-fuzz/: libFuzzer+ASan+UBSan, clang)"
# Two at once: each fuzzer is one process for its SECONDS, so both cores stay busy.
(cd "$FMOE_ROOT/build-fuzz" && ctest --output-on-failure -L fuzz -j 2)
stage_done "stage 3 (build-fuzz/)"

# Stage 4: what a GPU machine builds, checked on one without a GPU. Every break of the CUDA
# LibTorch 2.x build (headers, c10d's API, the libraries it loads, symbols it exports) shows here.
# To fit CI's budget (2 cores, 40 min for this whole command) it builds the targets that compile
# LibTorch code and the programs the LibTorch tests start (target torch_suite), not the
# Torch-free tests and benchmarks that stages 1-2 already build and run from the same sources,
# and runs the tests labelled torch: those linking LibTorch and those starting fmoe-worker or
# fmoe-generate, but for those labelled cluster (the router, the launcher, many hosts, the soak:
# 6 tests, about 400 of the 740 s these tests take one after another), which check the processes
# working together, the same code whichever LibTorch the worker runs, and which stage 1 ran
# (bench/RESULTS.md, "Build and test time").
case "${FMOE_CUDA:-}" in 0 | OFF | off | no | false) gpu_guard=no ;; *) gpu_guard=yes ;; esac
if [ "$main_build" = "$FMOE_ROOT/build" ] && [ "$gpu_guard" = yes ]; then
  torch_rc=0
  if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    fmoe_log "stage 4 (build-cuda/) SKIPPED: no nvcc (the CUDA 13 toolkit) on this machine"
  else
    torch_dir="$(fmoe_cuda_libtorch)" || torch_rc=$?
    if [ "$torch_rc" -eq 2 ]; then
      fmoe_log "stage 4 (build-cuda/) SKIPPED: PyPI is unreachable, and" \
               "torch==$FMOE_TORCH_CUDA_VERSION is neither in .venv nor kept in $FMOE_WHEELS"
    elif [ "$torch_rc" -ne 0 ]; then
      fmoe_die "installing torch==$FMOE_TORCH_CUDA_VERSION into .venv failed"
    else
      stage_done "stage 4: the CUDA LibTorch in .venv"
      fmoe_build_cuda "$FMOE_ROOT/build-cuda" -DCMAKE_BUILD_TYPE=Release -DFMOE_WERROR=ON -- \
        torch_suite
      stage_done "stage 4: build (build-cuda/, target torch_suite)"
      fmoe_log "running the LibTorch tests against PyPI's CUDA LibTorch (build-cuda/, no GPU used)"
      (cd "$FMOE_ROOT/build-cuda" && \
        ctest --output-on-failure --timeout 900 -j 2 -L torch -LE 'gpu|cluster')
      stage_done "stage 4: tests (build-cuda/, ctest -L torch -LE 'gpu|cluster')"
    fi
  fi
fi

fmoe_log "all tests passed in $(( $(date +%s) - start )) s"
