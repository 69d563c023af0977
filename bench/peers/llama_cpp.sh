#!/usr/bin/env bash
# bench/peers/llama_cpp.sh: llama.cpp against fmoe on the same weights, on this machine's CPU,
# side by side. A manual benchmark, not part of CI; bench/peers/README.md says what it does and
# what the figures mean.
#
# Usage (from anywhere; everything it makes goes under the work dir):
#   bench/peers/llama_cpp.sh [--work DIR] [--skip-build] [--models "tiny mixtral-1l"]
#                            [--dtypes "bf16 f32"] [--threads N] [--reps N] [--rounds N]
#                            [--prompt-tokens N] [--decode-tokens N] [--jobs N]
#                            [--fmoe-bin DIR] [--bw GBPS] [--smoke]
#
#   --work DIR         work dir (env FMOE_PEERS_WORK; default /tmp/fmoe-peers): the sdist, the
#                      llama.cpp build, the converter's venv, checkpoints, GGUFs, logs, results
#   --skip-build       use the llama.cpp build and venv already in the work dir
#   --models LIST      "tiny" (deploy/models/tiny-moe), "SHAPE-Nl" (fmoe-bench make-model
#                      --shape SHAPE --layers N, e.g. mixtral-1l = mixtral-8x7b, 1 layer), or a
#                      checkpoint directory (a path with a /); default "tiny mixtral-1l"
#   --dtypes LIST      bf16 and/or f32: the GGUF outtype and runtime_bench's --dtype
#   --threads N        threads for both (default 2)
#   --reps N           timed repetitions for both, after one warm-up each, per round (default 3)
#   --rounds N         rounds (default 3): each round runs both on every checkpoint, llama.cpp
#                      first in odd rounds and fmoe first in even ones, and measures the read
#                      bandwidth; a ratio is the median of the rounds' ratios, so a change in the
#                      machine's memory speed between rounds moves both sides of a ratio alike
#   --prompt-tokens N  prefill length (default 128); --decode-tokens N decode length (default 64)
#   --jobs N           build parallelism (default 2)
#   --fmoe-bin DIR     fmoe's binaries (default: build/bin of this checkout); nothing is rebuilt
#   --bw GBPS          read bandwidth for the decode bound (default: measured, a torch sum)
#   --smoke            prove the pipeline quickly: --reps 1 --rounds 1 --prompt-tokens 16
#                      --decode-tokens 8
#
# Full measurement: bench/peers/llama_cpp.sh   (then copy the table into bench/RESULTS.md)
set -euo pipefail

# --- the pinned peer -------------------------------------------------------------------------
LLPY_VERSION=0.3.36
LLPY_SDIST="llama_cpp_python-${LLPY_VERSION}.tar.gz"
LLPY_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TORCH_VERSION=2.11.0  # the converter's requirements-convert_hf_to_gguf.txt pins these
TRANSFORMERS_VERSION=4.57.6

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
SP_TOKENIZER="$REPO/tests/fixtures/tokenizers/sp/tokenizer.model"

WORK="${FMOE_PEERS_WORK:-/tmp/fmoe-peers}"
SKIP_BUILD=0
MODELS="tiny mixtral-1l"
DTYPES="bf16 f32"
THREADS=2
REPS=3
ROUNDS=3
PROMPT_TOKENS=128
DECODE_TOKENS=64
JOBS=2
FMOE_BIN="$REPO/build/bin"
BW=""
SMOKE=0

log() { printf '[peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  printf '[peers] FAILED: %s\n' "$*" >&2
  exit 1
}
usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

value() {  # value FLAG "$@": FLAG's value, or a clear failure
  [[ $# -ge 3 && -n $3 ]] || die "$1 needs a value"
  printf '%s' "$3"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --work) WORK="$(value "$1" "$@")"; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --models) MODELS="$(value "$1" "$@")"; shift 2 ;;
    --dtypes) DTYPES="$(value "$1" "$@")"; shift 2 ;;
    --threads) THREADS="$(value "$1" "$@")"; shift 2 ;;
    --reps) REPS="$(value "$1" "$@")"; shift 2 ;;
    --rounds) ROUNDS="$(value "$1" "$@")"; shift 2 ;;
    --prompt-tokens) PROMPT_TOKENS="$(value "$1" "$@")"; shift 2 ;;
    --decode-tokens) DECODE_TOKENS="$(value "$1" "$@")"; shift 2 ;;
    --jobs) JOBS="$(value "$1" "$@")"; shift 2 ;;
    --fmoe-bin) FMOE_BIN="$(value "$1" "$@")"; shift 2 ;;
    --bw) BW="$(value "$1" "$@")"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    -h | --help) usage ;;
    *) printf 'unknown argument: %s\n\n' "$1" >&2; usage ;;
  esac
done
if [[ $SMOKE -eq 1 ]]; then
  REPS=1 ROUNDS=1 PROMPT_TOKENS=16 DECODE_TOKENS=8
fi
for n in THREADS REPS ROUNDS PROMPT_TOKENS DECODE_TOKENS JOBS; do
  [[ "${!n}" =~ ^[1-9][0-9]*$ ]] || die "--$(tr 'A-Z_' 'a-z-' <<<"$n") ${!n}: not a positive integer"
done
for d in $DTYPES; do
  [[ $d == bf16 || $d == f32 ]] || die "--dtypes: \"$d\" is not bf16 or f32"
done
[[ -n $MODELS ]] || die "--models is empty"
[[ -z $BW || $BW =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--bw $BW: not a number of GB/s"

mkdir -p "$WORK" || die "cannot create the work dir $WORK"
WORK="$(cd "$WORK" && pwd)"
SRC="$WORK/src/llama_cpp_python-${LLPY_VERSION}"
LLAMA_CPP="$SRC/vendor/llama.cpp"
LLAMA_BUILD="$WORK/llama-build"
LLAMA_BENCH="$LLAMA_BUILD/bin/llama-bench"
VENV="$WORK/venv"
PY="$VENV/bin/python"
LOGS="$WORK/logs"
RESULTS="$WORK/results/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$LOGS" "$RESULTS" || die "cannot write in the work dir $WORK"

# run_logged STEP LOG CMD...: runs CMD with its output in LOG; on failure prints LOG's tail.
run_logged() {
  local step="$1" logfile="$2"
  shift 2
  if ! "$@" >"$logfile" 2>&1; then
    printf '%s\n' "----- last lines of $logfile -----" >&2
    tail -n 30 "$logfile" >&2
    die "$step (full log: $logfile)"
  fi
}

# run_split STEP OUT LOG CMD...: as run_logged, CMD's stdout in OUT and its stderr in LOG.
run_split() {
  local step="$1" outfile="$2" logfile="$3"
  shift 3
  if ! "$@" >"$outfile" 2>"$logfile"; then
    printf '%s\n' "----- last lines of $logfile and $outfile -----" >&2
    tail -n 20 "$logfile" "$outfile" >&2
    die "$step (logs: $logfile, $outfile)"
  fi
}

# --- 1. llama.cpp: sdist, extract, CPU build ---------------------------------------------------
fetch_and_build() {
  local t0=$SECONDS
  if [[ ! -f "$WORK/$LLPY_SDIST" ]]; then
    log "downloading the llama-cpp-python $LLPY_VERSION sdist from PyPI"
    run_logged "pip download llama-cpp-python==$LLPY_VERSION" "$LOGS/sdist.log" \
      python3 -m pip download --no-binary :all: --no-deps -d "$WORK" \
      "llama-cpp-python==$LLPY_VERSION"
  else
    log "using the cached sdist $WORK/$LLPY_SDIST"
  fi
  local sum
  sum="$(sha256sum "$WORK/$LLPY_SDIST" | cut -d' ' -f1)"
  [[ $sum == "$LLPY_SHA256" ]] ||
    die "$WORK/$LLPY_SDIST: sha256 $sum, expected $LLPY_SHA256 (remove it to download again)"
  if [[ ! -f "$SRC/.extracted" ]]; then
    log "extracting to $WORK/src"
    rm -rf "$SRC"
    mkdir -p "$WORK/src"
    tar -xzf "$WORK/$LLPY_SDIST" -C "$WORK/src" || die "extracting $WORK/$LLPY_SDIST"
    [[ -f "$LLAMA_CPP/CMakeLists.txt" ]] || die "the sdist has no vendor/llama.cpp"
    touch "$SRC/.extracted"
  fi
  log "configuring llama.cpp (Release, CPU only, GGML_NATIVE=ON): $LLAMA_BUILD"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  run_logged "cmake configure of llama.cpp" "$LOGS/llama-configure.log" \
    cmake -S "$LLAMA_CPP" -B "$LLAMA_BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
  log "building llama-bench with -j $JOBS (log: $LOGS/llama-build.log; ~5 min on 2 cores)"
  run_logged "building llama-bench" "$LOGS/llama-build.log" \
    cmake --build "$LLAMA_BUILD" --target llama-bench -j "$JOBS"
  [[ -x $LLAMA_BENCH ]] || die "no $LLAMA_BENCH after the build"
  log "llama.cpp built in $((SECONDS - t0)) s"
}

# --- 2. the converter's venv -------------------------------------------------------------------
make_venv() {
  local t0=$SECONDS
  if [[ -f "$VENV/.fmoe-peers-ok" ]]; then
    log "using the venv $VENV"
    return
  fi
  log "making the converter's venv $VENV"
  rm -rf "$VENV"
  run_logged "python3 -m venv $VENV" "$LOGS/venv.log" python3 -m venv "$VENV"
  # convert_hf_to_gguf.py imports torch at the top. The CPU wheel where its index is reachable;
  # otherwise PyPI's (a CUDA build: ~3 GB more of nvidia-* wheels, only its CPU side is used).
  log "installing torch $TORCH_VERSION (CPU wheel, or PyPI's when the PyTorch index is unreachable)"
  if ! "$PY" -m pip install --retries 0 --timeout 20 \
    --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION" \
    >"$LOGS/venv-torch-cpu.log" 2>&1; then
    log "the PyTorch CPU index failed ($LOGS/venv-torch-cpu.log); torch from PyPI"
    run_logged "pip install torch==$TORCH_VERSION" "$LOGS/venv-torch.log" \
      "$PY" -m pip install "torch==$TORCH_VERSION"
  fi
  log "installing the vendored gguf-py, numpy, sentencepiece, transformers"
  run_logged "pip install of the converter's requirements" "$LOGS/venv-reqs.log" \
    "$PY" -m pip install "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
    "transformers==$TRANSFORMERS_VERSION" "protobuf>=4.21.0,<5.0.0" "$LLAMA_CPP/gguf-py"
  run_logged "importing the converter's modules" "$LOGS/venv-check.log" \
    "$PY" -c "import torch, transformers, sentencepiece, numpy, gguf"
  touch "$VENV/.fmoe-peers-ok"
  log "venv ready in $((SECONDS - t0)) s"
}

# --- 3. checkpoints and GGUFs ------------------------------------------------------------------
# checkpoint_dir NAME: prints the checkpoint directory of NAME, making it first if needed.
checkpoint_dir() {
  local name="$1"
  if [[ $name == tiny ]]; then
    echo "$REPO/deploy/models/tiny-moe"
  elif [[ $name == */* ]]; then
    [[ -f "$name/config.json" ]] || die "$name: no config.json"
    (cd "$name" && pwd)
  elif [[ $name =~ ^(.+)-([0-9]+)l$ ]]; then
    local shape="${BASH_REMATCH[1]}" layers="${BASH_REMATCH[2]}" dir="$WORK/models/$name"
    [[ $shape == mixtral ]] && shape=mixtral-8x7b
    if [[ ! -f "$dir/config.json" ]]; then  # make-model writes config.json last
      log "making $name: fmoe-bench make-model --shape $shape --layers $layers (bfloat16)"
      mkdir -p "$dir"
      run_logged "fmoe-bench make-model --shape $shape --layers $layers" \
        "$LOGS/make-model-$name.log" \
        "$FMOE_BIN/fmoe-bench" make-model --shape "$shape" --layers "$layers" \
        --dtype bfloat16 --out "$dir" --force
    fi
    echo "$dir"
  else
    die "--models: \"$name\" is not tiny, SHAPE-Nl (e.g. mixtral-1l) or a directory"
  fi
}

# stage_for_converter NAME CKPT: prints a directory the converter reads: CKPT's config.json and
# weights linked, and, where CKPT has no SentencePiece tokenizer.model, the SentencePiece test
# tokenizer (600 pieces, unk 0, bos 1, eos 2), padded by the converter to vocab_size. The
# converter refuses fmoe's byte-level BPE tokenizer.json (its pre-tokenizer hash is not in its
# list); llama-bench feeds random token ids, so the tokenizer never touches the timing.
stage_for_converter() {
  local name="$1" ckpt="$2" stage="$WORK/stage/$1" f
  rm -rf "$stage"
  mkdir -p "$stage"
  for f in "$ckpt"/config.json "$ckpt"/*.safetensors "$ckpt"/model.safetensors.index.json; do
    [[ -e $f ]] && ln -s "$f" "$stage/"
  done
  if [[ -f "$ckpt/tokenizer.model" ]]; then
    ln -s "$ckpt/tokenizer.model" "$stage/"
    [[ -f "$ckpt/tokenizer_config.json" ]] && ln -s "$ckpt/tokenizer_config.json" "$stage/"
  else
    local vocab
    vocab="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
      "$ckpt/config.json")" || die "$ckpt/config.json: no vocab_size"
    ((vocab >= 600)) || die "$ckpt: vocab_size $vocab < the 600 ids of $SP_TOKENIZER"
    cp "$SP_TOKENIZER" "$stage/tokenizer.model"
  fi
  echo "$stage"
}

# gguf_of NAME CKPT DTYPE: prints the GGUF of CKPT at DTYPE, converting it if not cached.
gguf_of() {
  local name="$1" ckpt="$2" dtype="$3" out="$WORK/gguf/$1-$3.gguf"
  mkdir -p "$WORK/gguf"
  if [[ -f $out && $out -nt "$ckpt/config.json" ]]; then
    log "using the cached $out"
  else
    local stage t0=$SECONDS
    stage="$(stage_for_converter "$name" "$ckpt")"
    log "converting $name to GGUF $dtype (log: $LOGS/convert-$name-$dtype.log)"
    rm -f "$out" "$out.part"
    run_logged "convert_hf_to_gguf.py $name --outtype $dtype" "$LOGS/convert-$name-$dtype.log" \
      "$PY" "$LLAMA_CPP/convert_hf_to_gguf.py" "$stage" --outtype "$dtype" --outfile "$out.part"
    mv "$out.part" "$out"
    log "converted $name $dtype in $((SECONDS - t0)) s: $(du -h "$out" | cut -f1)"
  fi
  echo "$out"
}

# --- 4. the runs -------------------------------------------------------------------------------
bench_llama() {  # LABEL DTYPE GGUF ROUND
  local tag="$1-$2" gguf="$3" r="$4"
  # Every weight read into memory before the timing (-lm none -lzm off), as fmoe holds them:
  # mmap'd experts that the one-token warm-up did not route to would fault in while timed.
  local common=(-m "$gguf" -t "$THREADS" -r "$REPS" -lm none -lzm off -o json)
  log "round $r, llama-bench $tag: decode $DECODE_TOKENS after $PROMPT_TOKENS, $THREADS threads," \
    "$REPS reps"
  run_split "llama-bench decode $tag" "$RESULTS/llama-decode-$tag-r$r.json" \
    "$LOGS/llama-bench-decode-$tag-r$r.log" \
    "$LLAMA_BENCH" "${common[@]}" -n "$DECODE_TOKENS" -p 0 -d "$PROMPT_TOKENS"
  log "round $r, llama-bench $tag: prefill $PROMPT_TOKENS, every row's output (-embd 1)"
  run_split "llama-bench prefill $tag" "$RESULTS/llama-prefill-$tag-r$r.json" \
    "$LOGS/llama-bench-prefill-$tag-r$r.log" \
    "$LLAMA_BENCH" "${common[@]}" -p "$PROMPT_TOKENS" -n 0 -embd 1
}

bench_fmoe() {  # LABEL DTYPE CKPT ROUND
  local tag="$1-$2" ckpt="$3" r="$4" torch_dtype=float32 batches=(--batch 1) i prompts=()
  [[ $2 == bf16 ]] && torch_dtype=bfloat16
  for ((i = 0; i < REPS; i++)); do batches+=(--batch 1); done  # the first is the warm-up
  [[ -f "$REPO/../shared/data/prompts/puffin-dev.jsonl" ]] &&
    prompts=(--prompts "$REPO/../shared/data/prompts/puffin-dev.jsonl")
  log "round $r, runtime_bench $tag: --dtype $torch_dtype --threads $THREADS, 1 warm-up + $REPS" \
    "runs"
  run_split "runtime_bench $tag" "$RESULTS/fmoe-$tag-r$r.md" "$LOGS/runtime-bench-$tag-r$r.log" \
    "$FMOE_BIN/runtime_bench" --model "$ckpt" --dtype "$torch_dtype" --threads "$THREADS" \
    --prompt-tokens "$PROMPT_TOKENS" --decode-tokens "$DECODE_TOKENS" "${prompts[@]}" \
    "${batches[@]}"
}

# The read bandwidth for the decode bound, GB/s: --bw, else the best of 10 sums over 1 GiB by the
# venv's torch with --threads threads (a rough figure; on a busy machine, a low one). Measured once
# a round; the table's bound takes the rounds' best.
read_bandwidth() {
  if [[ -n $BW ]]; then
    echo "$BW"
    return
  fi
  "$PY" - "$THREADS" 2>>"$LOGS/bandwidth.log" <<'PYEOF' || true
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.ones(1 << 28)  # 1 GiB of float32
x.sum()
best = float("inf")
for _ in range(10):
    t0 = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - t0)
print(f"{x.numel() * 4 / best / 1e9:.1f}")
PYEOF
}

# The share of the CPUs busy over 2 s (percent), while nothing of ours runs: other work on the
# machine. llama.cpp's threads spin at every op's barrier, so it loses far more than fmoe to it.
others_cpu() {
  local a b
  read -r -a a </proc/stat
  sleep 2
  read -r -a b </proc/stat
  local idle=$(((b[4] + b[5]) - (a[4] + a[5]))) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  ((total > 0)) || { echo 0; return; }
  echo $((100 * (total - idle) / total))
}
check_quiet() {  # WHEN: logs the others' CPU use, warns when the machine is busy
  local busy
  busy="$(others_cpu)"
  if ((busy > 10)); then
    log "WARNING ($1): ${busy}% of the CPUs busy with other work; llama.cpp suffers more from it" \
      "than fmoe: these figures are not fit for bench/RESULTS.md"
  else
    log "$1: ${busy}% of the CPUs busy with other work"
  fi
  echo "$busy"
}

# --- main --------------------------------------------------------------------------------------
for bin in runtime_bench fmoe-bench; do
  [[ -x "$FMOE_BIN/$bin" ]] || die "no $FMOE_BIN/$bin: build fmoe first (or --fmoe-bin DIR)"
done
log "work dir $WORK; models: $MODELS; dtypes: $DTYPES; $THREADS threads, $REPS reps," \
  "prefill $PROMPT_TOKENS, decode $DECODE_TOKENS; results: $RESULTS"
BUSY_START="$(check_quiet "before the build")"
if [[ $SKIP_BUILD -eq 1 ]]; then
  [[ -x $LLAMA_BENCH ]] || die "--skip-build: no $LLAMA_BENCH (run once without --skip-build)"
  [[ -f "$VENV/.fmoe-peers-ok" ]] || die "--skip-build: no venv in $VENV (run once without it)"
  [[ -f "$LLAMA_CPP/convert_hf_to_gguf.py" ]] || die "--skip-build: no llama.cpp under $SRC"
  log "--skip-build: using $LLAMA_BENCH and $VENV"
else
  fetch_and_build
  make_venv
fi

# Every checkpoint and GGUF first, so that the rounds run back to back.
ROWS="$RESULTS/rows.tsv"
: >"$ROWS"
for name in $MODELS; do
  ckpt="$(checkpoint_dir "$name")"
  label="$name"
  [[ $name == */* ]] && label="$(basename "$ckpt")"
  for dtype in $DTYPES; do
    gguf="$(gguf_of "$label" "$ckpt" "$dtype")"
    printf '%s\t%s\t%s\t%s\n' "$label" "$dtype" "$ckpt" "$gguf" >>"$ROWS"
  done
done

bws=()
for ((round = 1; round <= ROUNDS; round++)); do
  bw="$(read_bandwidth)"
  log "round $round of $ROUNDS: read bandwidth ${bw:-unknown} GB/s"
  [[ -n $bw ]] && bws+=("$bw")
  while IFS=$'\t' read -r -u 3 label dtype ckpt gguf; do
    if ((round % 2 == 1)); then
      bench_llama "$label" "$dtype" "$gguf" "$round"
      bench_fmoe "$label" "$dtype" "$ckpt" "$round"
    else
      bench_fmoe "$label" "$dtype" "$ckpt" "$round"
      bench_llama "$label" "$dtype" "$gguf" "$round"
    fi
  done 3<"$ROWS"
done

BUSY_END="$(check_quiet "after the runs")"
"$PY" - "$RESULTS" "$ROWS" "${bws[*]}" "$PROMPT_TOKENS" "$DECODE_TOKENS" "$THREADS" "$REPS" \
  "$BUSY_START" "$BUSY_END" "$ROUNDS" \
  >"$RESULTS/table.md" <<'EOF' || die "making the table from $RESULTS"
import glob, json, re, statistics, sys

results, rows, bws, prompt, decode, threads, reps, busy_start, busy_end, rounds = sys.argv[1:11]
prompt, decode, rounds = int(prompt), int(decode), int(rounds)
bws = [float(b) for b in bws.split()]
bw = max(bws) if bws else None


def last_level_cache_bytes():
    sizes = [0]
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        m = re.match(r"(\d+)([KMG]?)", open(f).read().strip())
        if m:
            sizes.append(int(m[1]) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m[2]])
    return max(sizes)


llc = last_level_cache_bytes()


def llama_ts(path):
    runs = json.load(open(path))
    if len(runs) != 1:
        sys.exit(f"{path}: {len(runs)} tests, expected 1")
    return statistics.median(runs[0]["samples_ts"])


def fmoe_ts(path):
    # Rows "| 1 | P | prefill | decode | ms |"; the first is the warm-up.
    rows = [l.split("|")[1:-1] for l in open(path) if re.match(r"^\| *1 \| *\d+ \|", l)]
    if len(rows) < 2:
        sys.exit(f"{path}: no timed row after the warm-up")
    rows = rows[1:]
    return (statistics.median(float(r[2]) for r in rows),
            statistics.median(float(r[3]) for r in rows))


def mixtral_macs(cfg):
    # Per token: (decoder layers, logits), in multiply-adds = parameters read; None unless the
    # config is Mixtral-style (every layer attention + top-k of num_local_experts SwiGLU experts).
    try:
        h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or h // nh
        e, k, i = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
        layer = 2 * h * nh * hd + 2 * h * nkv * hd + h * e + k * 3 * h * i
        return cfg["num_hidden_layers"] * layer, cfg["vocab_size"] * h
    except KeyError:
        return None


def ratio(fm, ll):
    # The median of the rounds' ratios, and their range when there are several rounds.
    rs = sorted(f / l for f, l in zip(fm, ll))
    text = f"{statistics.median(rs):.2f}"
    return text + (f" ({rs[0]:.2f}-{rs[-1]:.2f})" if len(rs) > 1 else "")


out = []
out.append(f"| checkpoint | dtype | decode tok/s fmoe | llama.cpp | fmoe / llama.cpp "
           f"| prefill-{prompt} tok/s fmoe | llama.cpp | fmoe / llama.cpp | decode bound tok/s "
           f"| decode read GB/s fmoe / llama.cpp |")
out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
notes = {}
for line in open(rows):
    name, dtype, ckpt, _ = line.rstrip("\n").split("\t")
    tag = f"{name}-{dtype}"
    fm_pp, fm_tg, ll_pp, ll_tg = [], [], [], []
    for r in range(1, rounds + 1):
        pp, tg = fmoe_ts(f"{results}/fmoe-{tag}-r{r}.md")
        fm_pp.append(pp)
        fm_tg.append(tg)
        ll_tg.append(llama_ts(f"{results}/llama-decode-{tag}-r{r}.json"))
        ll_pp.append(llama_ts(f"{results}/llama-prefill-{tag}-r{r}.json"))
    med = statistics.median
    cfg = json.load(open(f"{ckpt}/config.json"))
    macs = mixtral_macs(cfg)
    bound, rates = "n/a", "n/a"
    if macs:
        active_bytes = (macs[0] + macs[1]) * (2 if dtype == "bf16" else 4)
        rates = f"{med(fm_tg) * active_bytes / 1e9:.1f} / {med(ll_tg) * active_bytes / 1e9:.1f}"
        if bw:
            bound = f"{bw * 1e9 / active_bytes:.1f}"
        if active_bytes <= llc:
            bound += " (in cache)" if bw else ""
            rates += " (in cache)"
    out.append(f"| {name} | {dtype} | {med(fm_tg):.1f} | {med(ll_tg):.1f} | {ratio(fm_tg, ll_tg)} "
               f"| {med(fm_pp):.0f} | {med(ll_pp):.0f} | {ratio(fm_pp, ll_pp)} | {bound} "
               f"| {rates} |")
    if macs:
        extra = macs[1] * (prompt - 1) / (prompt * macs[0] + macs[1])
        notes[name] = (f"{name}: llama.cpp's prefill (-embd 1) also computes the logits of "
                       f"{prompt - 1} more rows than fmoe: +{100 * extra:.0f}% multiply-adds")
print("\n".join(out))
print()
print(f"{threads} threads; {rounds} round(s), llama.cpp first in odd rounds and fmoe first in even "
      f"ones; in each, the median of {reps} timed runs after one warm-up. Rates: the median over "
      f"the rounds; ratios: the median of the rounds' ratios, with their range. Decode: "
      f"{decode} tokens after a {prompt}-token context (llama-bench -d {prompt}); prefill: "
      f"{prompt} tokens, every row through every layer (llama-bench -embd 1). Other work "
      f"on the machine: {busy_start}% of the CPUs before, {busy_end}% after.")
if bw:
    print(f"Decode bound: {bw:g} GB/s read bandwidth (the best of the rounds' "
          f"{', '.join(f'{b:g}' for b in bws)}) / (active parameters per token x bytes per "
          f"parameter). Decode read: active parameters per token x bytes per parameter x "
          f"decode tok/s. \"in cache\": the active weights fit in the {llc >> 20} MiB "
          f"last-level cache, so DRAM does not bound it.")
for n in notes.values():
    print(f"- {n}")
EOF
log "table ($RESULTS/table.md):"
cat "$RESULTS/table.md"
