# Shared by deploy/up.sh and deploy/test.sh: install what is missing, then build.
# Sourced, not run.

FMOE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Debian packages the build, the services and the tests need.
FMOE_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git ca-certificates
  # The fuzz build: libclang-rt-dev (libFuzzer, the sanitizer runtimes) is only a Recommends of
  # clang, and we install without recommends.
  clang libclang-rt-dev
  libtorch-dev
  libgloo-dev
  libzmq3-dev cppzmq-dev
  libflatbuffers-dev flatbuffers-compiler
  librocksdb-dev
  libboost-dev
  libyaml-cpp-dev nlohmann-json3-dev libspdlog-dev libcli11-dev
  libsentencepiece-dev libpcre2-dev libicu-dev
  libopenblas0-openmp
  zlib1g-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv
  # The metrics test parses /metrics with a real Prometheus parser.
  python3-prometheus-client
)

fmoe_log() { printf '\033[1m[fmoe]\033[0m %s\n' "$*" >&2; }
fmoe_die() { printf '[fmoe] error: %s\n' "$*" >&2; exit 1; }

# Installs the packages that are not installed yet; does nothing when all are.
fmoe_install_deps() {
  local missing=()
  local pkg
  for pkg in "${FMOE_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    fmoe_log "dependencies: all ${#FMOE_PACKAGES[@]} Debian packages present"
    return 0
  fi
  fmoe_log "dependencies: installing ${#missing[@]} missing Debian packages: ${missing[*]}"
  if ! command -v apt-get >/dev/null 2>&1; then
    fmoe_die "apt-get is not available; install these packages by hand: ${missing[*]}"
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo)
    else
      fmoe_die "not root: run as root (or with passwordless sudo), or install: ${missing[*]}"
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q || fmoe_die "apt-get update failed"
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" \
    || fmoe_die "apt-get install failed for: ${missing[*]}"
}

# fmoe_build BUILD_DIR [cmake -D options...] -- [targets...]
fmoe_build() {
  local dir="$1"; shift
  local cmake_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do cmake_args+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  local jobs
  jobs="$(nproc 2>/dev/null || echo 2)"
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
  # Paths below the checkout are hashed relative to it, so another clone of the project (a fresh
  # CI checkout, a second work tree) reuses the objects already compiled.
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$FMOE_ROOT")}"
  fmoe_log "configuring $dir ${cmake_args[*]}"
  cmake -S "$FMOE_ROOT" -B "$dir" -G Ninja "${cmake_args[@]}" >"$dir.configure.log" 2>&1 \
    || { cat "$dir.configure.log" >&2; fmoe_die "cmake configure failed (log: $dir.configure.log)"; }
  fmoe_log "building $dir with $jobs jobs ${*:+(targets: $*)}"
  if [ $# -gt 0 ]; then
    cmake --build "$dir" -j "$jobs" --target "$@" || fmoe_die "build failed"
  else
    cmake --build "$dir" -j "$jobs" || fmoe_die "build failed"
  fi
}
