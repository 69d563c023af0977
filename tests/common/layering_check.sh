#!/usr/bin/env bash
# The layers of common/: the base (common/*) includes none of its subfolders; model/, text/ and
# wire/ include the base and nothing of each other; nothing in common/ includes a process's code
# or a tool; and nlohmann/json.hpp is included through common/json.h only, so every file sees
# its instantiations declared extern. Prints every include that breaks this and fails if there is
# one.
set -u
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
cd "$root" || exit 2
above='gpu_worker|router|map_service|services|tools|bench|tests'
bad=0
check() {  # check FILES... -- PATTERN
  local pattern="${*: -1}" files=("${@:1:$#-1}")
  ((${#files[@]})) || return 0
  if grep -HnE "^[[:space:]]*#[[:space:]]*include[[:space:]]+\"($pattern)/" "${files[@]}"; then
    bad=1
  fi
}
shopt -s nullglob
check common/*.h common/*.cc "common/(model|text|wire)|$above"
check common/model/*.h common/model/*.cc common/model/families/*.h common/model/families/*.cc \
  "common/(text|wire)|$above"
check common/text/*.h common/text/*.cc "common/(model|wire)|$above"
check common/wire/*.h common/wire/*.cc "common/(model|text)|$above"
direct=$(grep -rlE --include='*.h' --include='*.cc' --include='*.cu' \
  '^[[:space:]]*#[[:space:]]*include[[:space:]]+<nlohmann/json\.hpp>' \
  common gpu_worker router map_service services tools bench tests | grep -vx 'common/json.h')
if [ -n "$direct" ]; then
  echo "$direct" | sed 's/$/: includes <nlohmann\/json.hpp>; include "common\/json.h" instead/'
  bad=1
fi
if ((bad)); then
  echo "layering_check: the includes above cross the layers of common/ (see common/README.md)" >&2
  exit 1
fi
echo "layering_check: common/ layers clean"
