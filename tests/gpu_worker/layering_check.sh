#!/usr/bin/env bash
# The layers of gpu_worker/, by library (gpu_worker/CMakeLists.txt, gpu_worker/README.md):
#   vocabulary  sequence.h, forward_observer.h, request_executor.h: include only each other
#   fmoe_cache  the expert cache, its policies and the links (Torch-free): the vocabulary and
#               itself, nothing of the control plane or the runtime
#   fmoe_worker_control  the rank's control plane, sampling, the group plan, the trace recorder
#               (Torch-free): the vocabulary and itself, nothing of the cache or the runtime
#   fmoe_runtime and the programs: anything below.
# Nothing in gpu_worker/ includes the router, the map service, the launcher, tools, bench or
# tests. Prints every include that breaks this and fails if there is one.
# Usage: layering_check.sh [ROOT]      (ROOT: the source tree; default: this checkout)
#        layering_check.sh --self-test  (plants a bad include in a copy: the check must fail)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = "--self-test" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  cp -r "$here/../../gpu_worker" "$tmp/gpu_worker"
  "$0" "$tmp" >/dev/null 2>&1 || { echo "self-test: the clean copy fails" >&2; exit 1; }
  for plant in 'cache_policy.h:gpu_worker/model.h' 'sampler.cc:gpu_worker/expert_cache.h' \
               'sequence.h:gpu_worker/worker.h' 'engine.cc:router/api.h'; do
    rm -rf "$tmp/gpu_worker" && cp -r "$here/../../gpu_worker" "$tmp/gpu_worker"
    file="${plant%%:*}" header="${plant#*:}"
    echo "#include \"$header\"" >> "$tmp/gpu_worker/$file"
    if "$0" "$tmp" >/dev/null 2>&1; then
      echo "self-test: a planted include of $header in $file was not caught" >&2
      exit 1
    fi
  done
  echo "layering_check: self-test caught every planted include"
  exit 0
fi
root="${1:-$(cd "$here/../.." && pwd)}"
cd "$root" || exit 2
vocabulary='sequence|forward_observer|request_executor'
cache='expert_cache|hybrid_split|cache_policy|moe_infinity_policy|policy_factory|transfer_engine|transfer_queue|fence_registry'
control='worker|sampler|group_plan|trace_recorder|load_reporter'
bad=0
# check_files ALLOWED FILES...: every gpu_worker include of FILES names an allowed header.
check_files() {
  local allowed="$1"
  shift
  local f line
  for f in "$@"; do
    [ -f "$f" ] || continue
    while IFS= read -r line; do
      if ! [[ "$line" =~ \"gpu_worker/($allowed)\.h\" ]]; then
        echo "$f: $line"
        bad=1
      fi
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]+"gpu_worker/' "$f")
  done
}
files_of() {  # files_of NAMES-REGEX: the .h/.cc/.cu files of gpu_worker/ with those base names.
  local f base
  for f in gpu_worker/*.h gpu_worker/*.cc gpu_worker/*.cu; do
    base="$(basename "$f")"
    base="${base%.*}"
    [[ "$base" =~ ^($1)$ ]] && echo "$f"
  done
}
shopt -s nullglob
mapfile -t vocab_files < <(files_of "$vocabulary")
mapfile -t cache_files < <(files_of "$cache|transfer_engine_cuda|transfer_engine_cuda_none|emulated_link")
mapfile -t control_files < <(files_of "$control")
check_files "$vocabulary" "${vocab_files[@]}"
check_files "$vocabulary|$cache" "${cache_files[@]}"
check_files "$vocabulary|$control" "${control_files[@]}"
if grep -HnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"(router|map_service|services|tools|bench|tests)/' \
  gpu_worker/*.h gpu_worker/*.cc gpu_worker/*.cu; then
  bad=1
fi
if ((bad)); then
  echo "layering_check: the includes above cross the layers of gpu_worker/ (see gpu_worker/README.md)" >&2
  exit 1
fi
echo "layering_check: gpu_worker/ layers clean"
