#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the whole system on this
# machine (map service, two cpu worker ranks, router on http://127.0.0.1:8000) with the shipped
# tiny model, in the foreground. Ctrl-C stops everything.
#   deploy/up.sh [MANIFEST]     (default: deploy/manifests/local.yaml)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

manifest="${1:-$FMOE_ROOT/deploy/manifests/local.yaml}"
fmoe_install_deps
fmoe_build "$FMOE_ROOT/build" -DCMAKE_BUILD_TYPE=Release -- \
  fmoe fmoe-router fmoe-map-service fmoe-worker
fmoe_log "starting: build/bin/fmoe launch $manifest"
exec "$FMOE_ROOT/build/bin/fmoe" launch "$manifest"
