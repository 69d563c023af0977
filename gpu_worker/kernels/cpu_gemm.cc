#include "gpu_worker/kernels/cpu_gemm.h"

#include "gpu_worker/kernels/gemm_lanes.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {
namespace {

// The fixed order every path follows for one output y[i][j]: 16 partial sums s[l], s[l] =
// fma(x[i][k], w[j][k], s[l]) for k = l, l + 16, l + 32, ... in increasing k (the last block
// padded with zeros), then t[l] = s[l] + s[l + 8], u[l] = t[l] + t[l + 4], v[l] = u[l] + u[l + 2],
// y = v[0] + v[1].
constexpr int kLanes = 16;

// Bytes of weights a panel of columns keeps in a core's L2 (512 KiB-2 MiB on the CPUs we run on)
// while the rows pass over them.
constexpr int64_t kPanelBytes = 384 * 1024;

// A tile: out[r * C + c] = the fixed-order dot product of x row r and w row c, for R rows and C
// columns; ld* in elements.
using TileFn = void (*)(const float* x, int64_t ldx, const void* w, int64_t ldw, int64_t k,
                        float* out);

template <int R, int C, typename W>
void TilePortable(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k, float* out) {
  const W* w = static_cast<const W*>(wv);
  float acc[R][C][kLanes] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, k - k0));
    for (int c = 0; c < C; ++c) {
      float wl[kLanes] = {};
      for (int l = 0; l < lanes; ++l) wl[l] = GemmWiden(w[c * ldw + k0 + l]);
      for (int r = 0; r < R; ++r) {
        for (int l = 0; l < kLanes; ++l) {
          const float xl = l < lanes ? x[r * ldx + k0 + l] : 0.0f;
          acc[r][c][l] = std::fma(xl, wl[l], acc[r][c][l]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * C + c] = GemmReduceLanes(acc[r][c]);
  }
}

#if defined(__x86_64__)
#define FMOE_AVX2 __attribute__((target("avx2,fma")))
#define FMOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

FMOE_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
FMOE_AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// ReduceLanes of s = (lo, hi): t = lo + hi, then the same tree (gemm_lanes.h).
FMOE_AVX2 inline float Reduce8(__m256 t) { return GemmReduce8(t); }

// One 16-wide step of the AVX2 tile: lanes 0-7 into lo, 8-15 into hi.
template <int R, int C, typename W>
FMOE_AVX2 inline void StepAvx2(const float* x, int64_t ldx, const W* w, int64_t ldw,
                               __m256 (&lo)[R][C], __m256 (&hi)[R][C]) {
  __m256 xv[R];
  for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx);
  for (int c = 0; c < C; ++c) {
    const __m256 wv = Load8(w + c * ldw);
    for (int r = 0; r < R; ++r) lo[r][c] = _mm256_fmadd_ps(xv[r], wv, lo[r][c]);
  }
  for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + 8);
  for (int c = 0; c < C; ++c) {
    const __m256 wv = Load8(w + c * ldw + 8);
    for (int r = 0; r < R; ++r) hi[r][c] = _mm256_fmadd_ps(xv[r], wv, hi[r][c]);
  }
}

template <int R, int C, typename W>
FMOE_AVX2 void TileAvx2(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                        float* out) {
  const W* w = static_cast<const W*>(wv);
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  }
  const int64_t full = k - k % kLanes;
  for (int64_t k0 = 0; k0 < full; k0 += kLanes) StepAvx2<R, C>(x + k0, ldx, w + k0, ldw, lo, hi);
  if (full < k) {
    // The last block, zero-padded to 16 lanes, through the same step.
    alignas(32) float xt[R][kLanes] = {};
    alignas(32) float wt[C][kLanes] = {};
    for (int r = 0; r < R; ++r) {
      for (int64_t l = full; l < k; ++l) xt[r][l - full] = x[r * ldx + l];
    }
    for (int c = 0; c < C; ++c) {
      for (int64_t l = full; l < k; ++l) wt[c][l - full] = GemmWiden(w[c * ldw + l]);
    }
    StepAvx2<R, C>(&xt[0][0], kLanes, &wt[0][0], kLanes, lo, hi);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * C + c] = Reduce8(_mm256_add_ps(lo[r][c], hi[r][c]));
  }
}

// GCC 12's AVX-512 intrinsics start their results from a self-initialised "undefined" value,
// which -Wuninitialized reports in every caller (GCC bug 105593); the values are all defined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

FMOE_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
FMOE_AVX512 inline __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FMOE_AVX512 inline __m512 LoadTail16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
FMOE_AVX512 inline __m512 LoadTail16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FMOE_AVX512 inline float Reduce16(__m512 s) {
  const __m256 lo = _mm512_castps512_ps256(s);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
  return GemmReduce8(_mm256_add_ps(lo, hi));
}

template <int R, int C, typename W>
FMOE_AVX512 void TileAvx512(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                            float* out) {
  const W* w = static_cast<const W*>(wv);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t full = k - k % kLanes;
  for (int64_t k0 = 0; k0 < full; k0 += kLanes) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k0);
    for (int c = 0; c < C; ++c) {
      const __m512 wl = Load16(w + c * ldw + k0);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wl, acc[r][c]);
    }
  }
  if (full < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - full)) - 1u);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + full);
    for (int c = 0; c < C; ++c) {
      const __m512 wl = LoadTail16(w + c * ldw + full, m);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wl, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * C + c] = Reduce16(acc[r][c]);
  }
}
#pragma GCC diagnostic pop
#endif

// An instruction set's tiles: the main one (rows x cols), one row of it (rows left over), one
// column (columns left over) and one output; each for float32 and bfloat16 weights.
struct Tile {
  int rows = 1, cols = 1;
  TileFn f32 = nullptr, bf16 = nullptr;
  TileFn For(GemmType t) const { return t == GemmType::kBFloat16 ? bf16 : f32; }
};
struct Kernels {
  std::string_view isa;
  Tile main, row, column, one;
};

#define FMOE_TILE(fn, R, C) \
  Tile { R, C, &fn<R, C, float>, &fn<R, C, uint16_t> }

const Kernels& PortableKernels() {
  static const Kernels k{"portable", FMOE_TILE(TilePortable, 2, 4), FMOE_TILE(TilePortable, 1, 4),
                         FMOE_TILE(TilePortable, 2, 1), FMOE_TILE(TilePortable, 1, 1)};
  return k;
}

#if defined(__x86_64__)
const Kernels& Avx2Kernels() {
  // 16 registers: 2 x 3 tiles keep 12 accumulators, 2 rows of x and a weight vector.
  static const Kernels k{"avx2", FMOE_TILE(TileAvx2, 2, 3), FMOE_TILE(TileAvx2, 1, 3),
                         FMOE_TILE(TileAvx2, 2, 1), FMOE_TILE(TileAvx2, 1, 1)};
  return k;
}
const Kernels& Avx512Kernels() {
  // 32 registers: 4 x 6 tiles keep 24 accumulators, 4 rows of x and a weight vector.
  static const Kernels k{"avx512", FMOE_TILE(TileAvx512, 4, 6), FMOE_TILE(TileAvx512, 1, 6),
                         FMOE_TILE(TileAvx512, 4, 1), FMOE_TILE(TileAvx512, 1, 1)};
  return k;
}
#endif

#undef FMOE_TILE

// The kernels of the named code when this CPU runs it, else null.
const Kernels* Named(std::string_view isa) {
  if (!CpuRunsIsa(isa)) return nullptr;
  if (isa == "portable") return &PortableKernels();
#if defined(__x86_64__)
  if (isa == "avx2") return &Avx2Kernels();
  if (isa == "avx512") return &Avx512Kernels();
#endif
  return nullptr;
}

const Kernels& Active() {
  static const Kernels& k = []() -> const Kernels& {
    const char* env = std::getenv("FMOE_GEMM_ISA");
    if (env != nullptr &&
        (std::string_view(env) == "portable" || std::string_view(env) == "avx2")) {
      if (const Kernels* named = Named(env)) return *named;
    }
    for (std::string_view isa : {"avx512", "avx2"}) {
      if (const Kernels* named = Named(isa)) return *named;
    }
    return PortableKernels();
  }();
  return k;
}

void Store(const GemmProblem& p, int64_t i, int64_t j, int rows, int cols, const float* out) {
  for (int r = 0; r < rows; ++r) {
    if (p.y_type == GemmType::kBFloat16) {
      uint16_t* y = static_cast<uint16_t*>(p.y) + (i + r) * p.ldy + j;
      for (int c = 0; c < cols; ++c) y[c] = GemmRoundToBFloat16(out[r * cols + c]);
    } else {
      float* y = static_cast<float*>(p.y) + (i + r) * p.ldy + j;
      std::memcpy(y, out + r * cols, sizeof(float) * static_cast<size_t>(cols));
    }
  }
}

const void* WeightRow(const GemmProblem& p, int64_t j) {
  const size_t elem = p.w_type == GemmType::kBFloat16 ? 2 : 4;
  return static_cast<const char*>(p.w) + static_cast<size_t>(j * p.ldw) * elem;
}

void Run(const Kernels& ks, const GemmProblem& p, int64_t n0, int64_t n1) {
  if (p.m <= 0 || n1 <= n0) return;
  float out[64];
  if (p.k == 0) {
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = n0; j < n1; ++j) {
        out[0] = 0.0f;
        Store(p, i, j, 1, 1, out);
      }
    }
    return;
  }
  const int rb = ks.main.rows, cb = ks.main.cols;
  // Columns in panels whose weights stay in a core's L2 while every row passes over them, so each
  // weight comes from memory once; a row tile's x is reused by every column tile of the panel.
  const int64_t w_bytes = p.w_type == GemmType::kBFloat16 ? 2 : 4;
  const int64_t panel = std::max<int64_t>(cb, kPanelBytes / (w_bytes * p.k) / cb * cb);
  const TileFn main = ks.main.For(p.w_type), row = ks.row.For(p.w_type);
  const TileFn column = ks.column.For(p.w_type), one = ks.one.For(p.w_type);
  const int64_t i_full = p.m / rb * rb;
  for (int64_t j0 = n0; j0 < n1; j0 += panel) {
    const int64_t j1 = std::min(n1, j0 + panel);
    for (int64_t i = 0; i < p.m;) {
      const int rows = i < i_full ? rb : 1;
      const TileFn wide = rows == rb ? main : row, narrow = rows == rb ? column : one;
      const float* x = p.x + i * p.ldx;
      int64_t j = j0;
      for (; j + cb <= j1; j += cb) {
        wide(x, p.ldx, WeightRow(p, j), p.ldw, p.k, out);
        Store(p, i, j, rows, cb, out);
      }
      for (; j < j1; ++j) {
        narrow(x, p.ldx, WeightRow(p, j), p.ldw, p.k, out);
        Store(p, i, j, rows, 1, out);
      }
      i += rows;
    }
  }
}

}  // namespace

bool CpuRunsIsa(std::string_view isa) {
  if (isa == "portable") return true;
#if defined(__x86_64__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }
#endif
  return false;
}

void GemmColumns(const GemmProblem& p, int64_t n0, int64_t n1) { Run(Active(), p, n0, n1); }

bool GemmColumnsOn(std::string_view isa, const GemmProblem& p, int64_t n0, int64_t n1) {
  const Kernels* ks = Named(isa);
  if (ks == nullptr) return false;
  Run(*ks, p, n0, n1);
  return true;
}

int64_t GemmColumnTile() { return Active().main.cols; }

std::string_view GemmIsa() { return Active().isa; }

}  // namespace fmoe
