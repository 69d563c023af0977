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
  # The disk tier reads experts with io_uring.
  liburing-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv
  # The metrics test parses /metrics with a real Prometheus parser.
  python3-prometheus-client
)

# The GPU build: PyPI's torch wheel, whose LibTorch (torch/lib, torch/share/cmake/Torch) is built
# against CUDA 13.0 and pulls NVIDIA's CUDA libraries as nvidia-* wheels (about 3 GB). Pinned:
# the source is built and tested against this version.
FMOE_TORCH_CUDA_VERSION=2.11.0
# lm-evaluation-harness for the router's compatibility test (tests/integration/lm_eval_check.py):
# pinned, as its API models' payloads and parsing are what the test checks against.
FMOE_LM_EVAL_VERSION=0.4.13
# Downloaded wheels are kept here and installed from here, so a fresh checkout (or a new .venv)
# does not download them again. pip's own cache is used too, but keeps nothing when the index
# (or a proxy) sends no caching headers.
FMOE_WHEELS="${FMOE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/fmoe/wheels}"

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

# True when this machine has an NVIDIA GPU (nvidia-smi lists one).
fmoe_have_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# True when the GPU build is wanted: FMOE_CUDA=1, or FMOE_CUDA unset and a GPU present.
# FMOE_CUDA=0 builds the cpu way even on a GPU machine.
fmoe_want_cuda() {
  case "${FMOE_CUDA:-}" in
    1 | ON | on | yes | true) return 0 ;;
    0 | OFF | off | no | false) return 1 ;;
    "") fmoe_have_gpu ;;
    *) fmoe_die "FMOE_CUDA=${FMOE_CUDA}: expected 1 (GPU build) or 0 (cpu build)" ;;
  esac
}

# Creates $FMOE_ROOT/.venv when it is missing (the openai client and the CUDA LibTorch live there).
fmoe_venv() {
  [ -x "$FMOE_ROOT/.venv/bin/python" ] || python3 -m venv "$FMOE_ROOT/.venv"
}

# Prints the torch directory of the pinned CUDA LibTorch in .venv (what CMAKE_PREFIX_PATH
# names), installing it first when .venv has another version or none: from the wheels kept in
# $FMOE_WHEELS, else downloaded there from PyPI first. Returns 2 when PyPI cannot be reached
# (and the wheels are not kept yet), 1 on any other failure.
fmoe_cuda_libtorch() {
  local py="$FMOE_ROOT/.venv/bin/python"
  local pin="torch==$FMOE_TORCH_CUDA_VERSION"
  local pip=("$FMOE_ROOT/.venv/bin/pip" --disable-pip-version-check -q)
  fmoe_venv || return 1
  local have
  have="$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
  if [ "$have" != "$FMOE_TORCH_CUDA_VERSION" ]; then
    mkdir -p "$FMOE_WHEELS" || return 1
    if ! "${pip[@]}" install --no-index --find-links "$FMOE_WHEELS" "$pin" >/dev/null 2>&1; then
      # Only the index page, with one short try: does PyPI (or the configured index) answer?
      "${pip[@]}" index versions --retries 0 --timeout 20 torch >/dev/null 2>&1 || return 2
      fmoe_log "downloading $pin (CUDA 13.0) and its nvidia-* libraries from PyPI into" \
               "$FMOE_WHEELS (about 3 GB, kept for later runs)"
      "${pip[@]}" download --progress-bar off -d "$FMOE_WHEELS" "$pin" >&2 || return 1
      "${pip[@]}" install --no-index --find-links "$FMOE_WHEELS" "$pin" >&2 || return 1
    fi
    fmoe_log "installed $pin into .venv"
  fi
  "$py" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])'
}

# Checks what the GPU build needs besides the wheel: nvcc, of the CUDA major the wheel is built
# for (13).
fmoe_check_nvcc() {
  local nvcc
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  [ -x "$nvcc" ] || fmoe_die "the GPU build needs nvcc from the CUDA 13 toolkit (not found in" \
    "PATH or /usr/local/cuda/bin); install it, or build for cpu with FMOE_CUDA=0"
  local release
  release="$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p')"
  case "$release" in
    13.*) ;;
    *) fmoe_log "warning: nvcc is CUDA $release; torch $FMOE_TORCH_CUDA_VERSION is for CUDA 13" ;;
  esac
}

# fmoe_build_cuda BUILD_DIR [cmake -D options...] -- [targets...]: fmoe_build with FMOE_CUDA=ON
# against the pinned CUDA LibTorch (installed first when missing). Dies when PyPI is unreachable.
fmoe_build_cuda() {
  local dir="$1"; shift
  fmoe_check_nvcc
  local torch rc=0
  torch="$(fmoe_cuda_libtorch)" || rc=$?
  [ "$rc" -ne 2 ] || fmoe_die "PyPI is unreachable and torch==$FMOE_TORCH_CUDA_VERSION is not" \
    "installed in .venv nor kept in $FMOE_WHEELS: the GPU build needs it (FMOE_CUDA=0: cpu build)"
  [ "$rc" -eq 0 ] || fmoe_die "installing torch==$FMOE_TORCH_CUDA_VERSION into .venv failed"
  fmoe_log "LibTorch: PyPI's torch $FMOE_TORCH_CUDA_VERSION (CUDA) in $torch"
  # CMake keeps the LibTorch it found first: a build directory configured against another one
  # starts its configuration again (its objects stay).
  if [ -f "$dir/CMakeCache.txt" ] && ! grep -qF "Torch_DIR:PATH=$torch/" "$dir/CMakeCache.txt"; then
    fmoe_log "$dir was configured against another LibTorch: configuring it again"
    rm -f "$dir/CMakeCache.txt"
  fi
  fmoe_build "$dir" -DFMOE_CUDA=ON "-DCMAKE_PREFIX_PATH=$torch" "$@"
}
