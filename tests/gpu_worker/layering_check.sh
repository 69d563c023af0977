#!/usr/bin/env bash
# The rooms of gpu_worker/, one library per folder (gpu_worker/README.md, "Rooms"), and what each
# may include of the others: a room includes only itself and the rooms below it.
#   core            sequence.h, request_executor.h, group_plan: includes nothing of gpu_worker/
#   observe         the observer interface, map publisher, trace recorder: core
#   sampling        logits processing and draws: core
#   cache/transfer  the links: nothing of gpu_worker/
#   kernels         the host's compute kernels (the CPU matrix product): nothing of gpu_worker/
#   cache/policies  the policies and their factory: core
#   cache/store     the host tier and the disk reader: cache/transfer
#   cache           the expert cache manager: core, cache/policies, cache/transfer, cache/store
#   control         the control plane: core
#   group           the c10d group: core
#   experts         the expert sources: core, kernels and the cache's rooms
#   model           the model runtime: core, kernels, observe, sampling, group, experts
#   engine          the leader's engine and the follower: model and everything below it
#   (gpu_worker/)   the rank and the programs: any room
# A file in a folder missing from this table fails the check (a new room is added here). Nothing
# in gpu_worker/ includes the router, the map service, the launcher, tools, bench or tests.
# Prints every include that breaks this and fails if there is one.
# Usage: layering_check.sh [ROOT]      (ROOT: the source tree; default: this checkout)
#        layering_check.sh --self-test  (plants bad includes in a copy: each must fail the check)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = "--self-test" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  cp -r "$here/../../gpu_worker" "$tmp/gpu_worker"
  "$0" "$tmp" >/dev/null 2>&1 || { echo "self-test: the clean copy fails" >&2; exit 1; }
  for plant in 'cache/policies/cache_policy.h:gpu_worker/model/model.h' \
               'sampling/sampler.cc:gpu_worker/cache/expert_cache.h' \
               'core/sequence.h:gpu_worker/control/worker.h' \
               'model/model.cc:gpu_worker/engine/engine.h' \
               'cache/expert_cache.h:gpu_worker/experts/expert_source.h' \
               'engine/engine.cc:router/api.h' \
               'unknown/new_file.h:common/status.h'; do
    rm -rf "$tmp/gpu_worker" && cp -r "$here/../../gpu_worker" "$tmp/gpu_worker"
    file="${plant%%:*}" header="${plant#*:}"
    mkdir -p "$(dirname "$tmp/gpu_worker/$file")"
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
cd "$root/gpu_worker" || exit 2
declare -A allowed=(
  [core]=''
  [observe]='core'
  [sampling]='core'
  [cache/transfer]=''
  [kernels]=''
  [cache/policies]='core'
  [cache/store]='cache/transfer'
  [cache]='core cache/policies cache/transfer cache/store'
  [control]='core'
  [group]='core'
  [experts]='core kernels cache cache/policies cache/transfer cache/store'
  [model]='core kernels observe sampling group experts cache cache/policies cache/transfer cache/store'
  [engine]='core kernels observe sampling group experts cache cache/policies cache/transfer cache/store model'
)
bad=0
# room_of PATH: the folder of a path below gpu_worker/ ("." for the top), without a subprocess.
room_of() {
  case "$1" in */*) room="${1%/*}" ;; *) room=. ;; esac
}
while IFS= read -r -d '' f; do
  f="${f#./}"
  room_of "$f"
  if [ "$room" != . ] && [ -z "${allowed[$room]+set}" ]; then
    echo "gpu_worker/$f: in folder $room/, which is not a room of tests/gpu_worker/layering_check.sh"
    bad=1
  fi
done < <(find . -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) -print0)
# Every include line of the folder at once: FILE:LINE:TEXT.
while IFS= read -r hit; do
  f="${hit%%:*}"
  f="${f#./}"
  line="${hit#*:*:}"
  room_of "$f"
  [ "$room" = . ] && rooms_ok='*' || rooms_ok=" $room ${allowed[$room]-} "
  if [[ "$line" =~ \"(router|map_service|services|tools|bench|tests)/ ]]; then
    echo "gpu_worker/$f: $line (another process's or the tests' code)"
    bad=1
  elif [[ "$line" =~ \"gpu_worker/(.+)\" ]]; then
    room_of "${BASH_REMATCH[1]}"
    if [ "$rooms_ok" != '*' ] && [[ "$rooms_ok" != *" $room "* ]]; then
      echo "gpu_worker/$f: $line (room ${f%/*}/ may include only:${rooms_ok% })"
      bad=1
    fi
  fi
done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"' --include='*.h' --include='*.cc' \
           --include='*.cu' .)
if ((bad)); then
  echo "layering_check: the includes above cross the rooms of gpu_worker/ (see gpu_worker/README.md)" >&2
  exit 1
fi
echo "layering_check: gpu_worker/ rooms clean"
