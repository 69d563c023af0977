#!/usr/bin/env bash
# Runs a libFuzzer target from fresh seeds: MAKE_CORPUS (make_corpus for codec_fuzz,
# make_request_corpus for request_fuzz) writes the seeds into an emptied WORK_DIR/corpus (where
# libFuzzer also adds what it finds) and crash inputs land in WORK_DIR/artifacts. The remaining
# arguments go to libFuzzer.
# Usage: run_fuzz.sh MAKE_CORPUS FUZZER WORK_DIR [libFuzzer flags...]
# ctest runs each target briefly (tests codec_fuzz_short, request_fuzz_short). Longer by hand,
# e.g. an hour on 2 cores:
#   tests/fuzz/run_fuzz.sh build-fuzz/bin/make_corpus build-fuzz/bin/codec_fuzz \
#     /tmp/codec-fuzz -max_total_time=3600 -timeout=10 -rss_limit_mb=2048 -jobs=2 -workers=2
#   tests/fuzz/run_fuzz.sh build-fuzz/bin/make_request_corpus build-fuzz/bin/request_fuzz \
#     /tmp/request-fuzz -max_total_time=3600 -timeout=10 -rss_limit_mb=2048 -jobs=2 -workers=2
#   tests/fuzz/run_fuzz.sh build-fuzz/bin/make_tiktoken_corpus build-fuzz/bin/tiktoken_fuzz \
#     /tmp/tiktoken-fuzz -max_total_time=3600 -timeout=10 -rss_limit_mb=2048 -jobs=2 -workers=2
# (-jobs writes fuzz-<n>.log into the current directory.) Replay a crash:
#   build-fuzz/bin/codec_fuzz /tmp/codec-fuzz/artifacts/crash-<sha1>
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 MAKE_CORPUS FUZZER WORK_DIR [libFuzzer flags...]" >&2
  exit 2
fi
make_corpus="$1" fuzzer="$2" work="$3"
shift 3
rm -rf "$work/corpus" "$work/artifacts"
mkdir -p "$work/corpus" "$work/artifacts"
"$make_corpus" "$work/corpus"
exec "$fuzzer" -artifact_prefix="$work/artifacts/" "$@" "$work/corpus"
