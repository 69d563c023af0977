#!/usr/bin/env bash
# Runs codec_fuzz from fresh seeds: make_corpus writes the seeds into an emptied
# WORK_DIR/corpus (where libFuzzer also adds what it finds) and crash inputs land in
# WORK_DIR/artifacts. The remaining arguments go to libFuzzer.
# Usage: run_codec_fuzz.sh MAKE_CORPUS CODEC_FUZZ WORK_DIR [libFuzzer flags...]
# ctest runs it for 60 s (test codec_fuzz_short). Longer by hand, e.g. an hour on 2 cores:
#   tests/fuzz/run_codec_fuzz.sh build-fuzz/bin/make_corpus build-fuzz/bin/codec_fuzz \
#     /tmp/codec-fuzz -max_total_time=3600 -timeout=10 -rss_limit_mb=2048 -jobs=2 -workers=2
# (-jobs writes fuzz-<n>.log into the current directory.) Replay a crash:
#   build-fuzz/bin/codec_fuzz /tmp/codec-fuzz/artifacts/crash-<sha1>
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 MAKE_CORPUS CODEC_FUZZ WORK_DIR [libFuzzer flags...]" >&2
  exit 2
fi
make_corpus="$1" codec_fuzz="$2" work="$3"
shift 3
rm -rf "$work/corpus" "$work/artifacts"
mkdir -p "$work/corpus" "$work/artifacts"
"$make_corpus" "$work/corpus"
exec "$codec_fuzz" -artifact_prefix="$work/artifacts/" "$@" "$work/corpus"
