#include "gpu_worker/kernels/cpu_gemm.h"

#include "gpu_worker/kernels/gemm_lanes.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {
namespace {

// The fixed order every path follows for one output y[i][j], by the weights' type (cpu_gemm.h):
// float32: 16 partial sums s[l], s[l] = fma(x[i][k], w[j][k], s[l]) for k = l, l + 16, l + 32,
// ... in increasing k (the last block padded with zeros); bfloat16: 16 partial sums over blocks of
// 32 in increasing order, block b adding s[l] = fma(x[i][32b + 2l + 1], w[j][32b + 2l + 1], s[l])
// and then s[l] = fma(x[i][32b + 2l], w[j][32b + 2l], s[l]) (the last block padded with zeros);
// then, both, t[l] = s[l] + s[l + 8], u[l] = t[l] + t[l + 4], v[l] = u[l] + u[l + 2],
// y = v[0] + v[1].
constexpr int kLanes = 16;
constexpr int kPairBlock = 2 * kLanes;  // bfloat16: the elements of one block, 32 (64 bytes)

// Bytes of weights a panel of columns keeps in a core's L2 (512 KiB-2 MiB on the CPUs we run on)
// while the rows pass over them.
constexpr int64_t kPanelBytes = 384 * 1024;

// A tile: out[r * C + c] = the fixed-order dot product of x row r and w row c, for R rows and C
// columns; ld* in elements.
using TileFn = void (*)(const float* x, int64_t ldx, const void* w, int64_t ldw, int64_t k,
                        float* out);

template <int R, int C>
void TilePortable(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k, float* out) {
  const float* w = static_cast<const float*>(wv);
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

// The bfloat16 tiles read x split in pairs (the SplitPairs functions, GemmSplitX): per block of 32
// along k, x's odd elements (16 floats) and then its even ones (16), the last block zero-padded, so
// that a 64-byte load of weights widens into its odd and even halves with a mask and a shift, no
// shuffle; ldx is the split row's length, k rounded up to 32.
using SplitFn = void (*)(const float* x, int64_t ldx, int64_t rows, int64_t k, float* out);

int64_t SplitLength(int64_t k) { return (k + kPairBlock - 1) / kPairBlock * kPairBlock; }

// Blocks [b0, k) of one row, zero-padded: the portable split, every split's last block, and the
// split of bfloat16 x, widened on the way (exactly: a bfloat16 is a float32's high half).
template <typename T>
void SplitBlocks(const T* xr, int64_t b0, int64_t k, float* o) {
  for (int64_t b = b0; b < k; b += kPairBlock) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t odd = b + 2 * l + 1, even = b + 2 * l;
      o[b + l] = odd < k ? GemmWiden(xr[odd]) : 0.0f;
      o[b + kLanes + l] = even < k ? GemmWiden(xr[even]) : 0.0f;
    }
  }
}

template <typename T>
void SplitPairsPortable(const T* x, int64_t ldx, int64_t rows, int64_t k, float* out) {
  for (int64_t r = 0; r < rows; ++r) SplitBlocks(x + r * ldx, 0, k, out + r * SplitLength(k));
}

template <int R, int C>
void PairTilePortable(const float* xs, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                      float* out) {
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  float acc[R][C][kLanes] = {};
  for (int64_t b = 0; b < k; b += kPairBlock) {
    for (int c = 0; c < C; ++c) {
      float wo[kLanes], we[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        const int64_t odd = b + 2 * l + 1, even = b + 2 * l;
        wo[l] = odd < k ? GemmWiden(w[c * ldw + odd]) : 0.0f;
        we[l] = even < k ? GemmWiden(w[c * ldw + even]) : 0.0f;
      }
      for (int r = 0; r < R; ++r) {
        const float* x = xs + r * ldx + b;
        for (int l = 0; l < kLanes; ++l) {
          acc[r][c][l] = std::fma(x[l], wo[l], acc[r][c][l]);
          acc[r][c][l] = std::fma(x[kLanes + l], we[l], acc[r][c][l]);
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

// An opaque copy of p: the compiler cannot tell that loads through it read what earlier loads
// through p read, so it loads again instead of keeping those values in registers.
template <typename T>
inline void Launder(const T*& p) {
  asm("" : "+r"(p));
}

FMOE_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

// ReduceLanes of s = (lo, hi): t = lo + hi, then the same tree (gemm_lanes.h).
FMOE_AVX2 inline float Reduce8(__m256 t) { return GemmReduce8(t); }

// One 16-wide step of the AVX2 tile: lanes 0-7 into lo, 8-15 into hi.
template <int R, int C>
FMOE_AVX2 inline void StepAvx2(const float* x, int64_t ldx, const float* w, int64_t ldw,
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

template <int R, int C>
FMOE_AVX2 void TileAvx2(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                        float* out) {
  const float* w = static_cast<const float*>(wv);
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

FMOE_AVX2 void SplitPairsAvx2(const float* x, int64_t ldx, int64_t rows, int64_t k, float* out) {
  const int64_t full = k - k % kPairBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* o = out + r * SplitLength(k);
    for (int64_t b = 0; b < full; b += kPairBlock) {
      // shuffle_ps takes lanes {1, 3} (0xdd) or {0, 2} (0x88) of each 128-bit half of both
      // inputs; the 64-bit permute (0xd8) puts the halves in order.
      for (int h = 0; h < 2; ++h) {
        const __m256 a = _mm256_loadu_ps(xr + b + 16 * h), c = _mm256_loadu_ps(xr + b + 16 * h + 8);
        const __m256 odd = _mm256_shuffle_ps(a, c, 0xdd), even = _mm256_shuffle_ps(a, c, 0x88);
        _mm256_storeu_ps(o + b + 8 * h,
                         _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8)));
        _mm256_storeu_ps(o + b + kLanes + 8 * h,
                         _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8)));
      }
    }
    SplitBlocks(xr, full, k, o);
  }
}

// The bfloat16 tile, per half block of 16 weights (32 bytes, 8 lanes: the first half into lo,
// the second into hi): a pass of the odd ones (the high halves of the 32-bit words, their low
// halves shifted out) with x's odd split elements, then a pass of the even ones (shifted up) with
// x's even ones, each holding one vector of x per row: 2 R C accumulators, R rows of x and a
// weight vector, as the float32 tile (a mask register for the odd halves would leave 2 x 3 tiles
// one short, and GCC would then reload x for every column). The second pass loads the weights
// again (from L1): `Launder` hides that they are the same bytes, or GCC would keep the first
// pass's C vectors for it and spill. One row (decode) takes a single pass with both halves of
// x. One loop for every block, the last one's weights read from a zero-padded copy. The loops
// over rows, columns and halves are unrolled whole (the pragmas): left as loops, GCC keeps the
// accumulators in memory.
template <int R, int C>
FMOE_AVX2 void PairTileAvx2(const float* xs, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                            float* out) {
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  const int64_t full = k - k % kPairBlock;
  alignas(32) uint16_t wt[C][kPairBlock] = {};
  for (int c = 0; c < C && full < k; ++c) {
    std::memcpy(wt[c], w + c * ldw + full, sizeof(uint16_t) * static_cast<size_t>(k - full));
  }
  __m256 acc[2][R][C];
#pragma GCC unroll 16
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[h][r][c] = _mm256_setzero_ps();
    }
  }
  for (int64_t b = 0; b < k; b += kPairBlock) {
    const uint16_t* wb = b < full ? w + b : &wt[0][0];
    const int64_t ld = b < full ? ldw : kPairBlock;
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      if constexpr (R == 1) {
        // One row: its odd and even x, both halves of each weight vector and the mask of the
        // odd halves fit in registers.
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        const __m256 xo = _mm256_loadu_ps(xs + b + 8 * h);
        const __m256 xe = _mm256_loadu_ps(xs + b + kLanes + 8 * h);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * ld + kLanes * h));
          acc[h][0][c] =
              _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(raw, high)), acc[h][0][c]);
          acc[h][0][c] =
              _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), acc[h][0][c]);
        }
        continue;
      }
      __m256 xv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xs + r * ldx + b + 8 * h);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * ld + kLanes * h));
        const __m256 wo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[h][r][c] = _mm256_fmadd_ps(xv[r], wo, acc[h][r][c]);
      }
      Launder(wb);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xs + r * ldx + b + kLanes + 8 * h);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * ld + kLanes * h));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[h][r][c] = _mm256_fmadd_ps(xv[r], we, acc[h][r][c]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r * C + c] = Reduce8(_mm256_add_ps(acc[0][r][c], acc[1][r][c]));
  }
}

// GCC 12's AVX-512 intrinsics start their results from a self-initialised "undefined" value,
// which -Wuninitialized reports in every caller (GCC bug 105593); the values are all defined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

FMOE_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
FMOE_AVX512 inline __m512 LoadTail16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
FMOE_AVX512 inline float Reduce16(__m512 s) {
  const __m256 lo = _mm512_castps512_ps256(s);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
  return GemmReduce8(_mm256_add_ps(lo, hi));
}

template <int R, int C>
FMOE_AVX512 void TileAvx512(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t k,
                            float* out) {
  const float* w = static_cast<const float*>(wv);
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

FMOE_AVX512 void SplitPairsAvx512(const float* x, int64_t ldx, int64_t rows, int64_t k,
                                  float* out) {
  const __m512i odd_idx =
      _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i even_idx =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const int64_t full = k - k % kPairBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* o = out + r * SplitLength(k);
    for (int64_t b = 0; b < full; b += kPairBlock) {
      const __m512 a = _mm512_loadu_ps(xr + b), c = _mm512_loadu_ps(xr + b + kLanes);
      _mm512_storeu_ps(o + b, _mm512_permutex2var_ps(a, odd_idx, c));
      _mm512_storeu_ps(o + b + kLanes, _mm512_permutex2var_ps(a, even_idx, c));
    }
    SplitBlocks(xr, full, k, o);
  }
}

// The bfloat16 tile, per block of 32: a pass of the odd weights (masked high halves) with x's odd
// split elements at xs[0..16), then a pass of the even ones (shifted up) with xs[16..32), each
// holding one vector of x per row: R C accumulators, R rows of x, a weight vector and the mask,
// as the float32 tile. The second pass loads the weights again (from L1): `Launder` hides that
// they are the same bytes, or GCC would keep the first pass's C vectors for it and spill the
// accumulators. One row (decode) takes a single pass with both halves of x. One loop for every
// block, the last one's weights masked. The loops over rows and columns are unrolled whole (the
// pragmas): left as loops, GCC keeps the accumulators in memory.
template <int R, int C>
FMOE_AVX512 void PairTileAvx512(const float* xs, int64_t ldx, const void* wv, int64_t ldw,
                                int64_t k, float* out) {
  const uint16_t* w = static_cast<const uint16_t*>(wv);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t full = k - k % kPairBlock;
  const auto tail = static_cast<__mmask32>((uint64_t{1} << (k - full)) - 1u);
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < k; b += kPairBlock) {
    const __mmask32 m = b < full ? ~__mmask32{0} : tail;
    const uint16_t* wb = w + b;
    if constexpr (R == 1) {
      // One row: its odd and even x and each weight vector's two halves fit in registers.
      const __m512 xo = _mm512_loadu_ps(xs + b), xe = _mm512_loadu_ps(xs + b + kLanes);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const __m512i raw = _mm512_maskz_loadu_epi16(m, wb + c * ldw);
        acc[0][c] =
            _mm512_fmadd_ps(xo, _mm512_castsi512_ps(_mm512_and_si512(raw, high)), acc[0][c]);
        acc[0][c] = _mm512_fmadd_ps(xe, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), acc[0][c]);
      }
      continue;
    }
    __m512 xv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(xs + r * ldx + b);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_maskz_loadu_epi16(m, wb + c * ldw);
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wo, acc[r][c]);
    }
    Launder(wb);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(xs + r * ldx + b + kLanes);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_maskz_loadu_epi16(m, wb + c * ldw);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], we, acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r * C + c] = Reduce16(acc[r][c]);
  }
}
#pragma GCC diagnostic pop
#endif

// An instruction set's tiles, for float32 weights (x as given) and for bfloat16 weights (x split
// in pairs): the main one (rows x cols), one row (rows left over; decode), one column (columns
// left over) and one output.
struct Tile {
  int rows = 1, cols = 1;
  TileFn fn = nullptr;
};
struct TileSet {
  Tile main, row, column, one;
};
struct Kernels {
  std::string_view isa;
  TileSet f32, bf16;
  SplitFn split = nullptr;
  const TileSet& For(GemmType t) const { return t == GemmType::kBFloat16 ? bf16 : f32; }
};

// The four tiles of an R x C main tile: R x C, 1 x C, R x 1 and 1 x 1.
TileSet Tiles(int r, int c, TileFn main, TileFn row, TileFn column, TileFn one) {
  return {{r, c, main}, {1, c, row}, {r, 1, column}, {1, 1, one}};
}
#define FMOE_TILES(fn, R, C) Tiles(R, C, &fn<R, C>, &fn<1, C>, &fn<R, 1>, &fn<1, 1>)

const Kernels& PortableKernels() {
  static const Kernels k{"portable", FMOE_TILES(TilePortable, 2, 4),
                         FMOE_TILES(PairTilePortable, 2, 4), &SplitPairsPortable<float>};
  return k;
}

#if defined(__x86_64__)
const Kernels& Avx2Kernels() {
  // 16 registers: 2 x 3 tiles keep 12 accumulators (lo and hi), 2 rows of x and a weight
  // vector.
  static const Kernels k{"avx2", FMOE_TILES(TileAvx2, 2, 3), FMOE_TILES(PairTileAvx2, 2, 3),
                         &SplitPairsAvx2};
  return k;
}
const Kernels& Avx512Kernels() {
  // 32 registers: 4 x 6 tiles keep 24 accumulators, 4 rows of x and a weight vector (bfloat16:
  // and the mask).
  static const Kernels k{"avx512", FMOE_TILES(TileAvx512, 4, 6), FMOE_TILES(PairTileAvx512, 4, 6),
                         &SplitPairsAvx512};
  return k;
}
#endif

#undef FMOE_TILES

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

// x split in pairs for bfloat16 weights: one buffer per thread, grown to the largest call's need
// and kept (no allocation per call once warm).
class SplitBuffer {
 public:
  float* Get(int64_t floats) {
    if (floats > size_) {
      data_ = std::make_unique<float[]>(static_cast<size_t>(floats));
      size_ = floats;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  int64_t size_ = 0;
};

// The most floats of split x a call keeps for all its rows (4 MiB); a call with more splits each
// row tile's x as it comes to it, once per panel.
constexpr int64_t kWholeSplitFloats = int64_t{1} << 20;

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
  const TileSet& ts = ks.For(p.w_type);
  const int rb = ts.main.rows;
  const int64_t cb = std::lcm(ts.main.cols, ts.row.cols);
  // Columns in panels whose weights stay in a core's L2 while every row passes over them, so each
  // weight comes from memory once; a row tile's x is reused by every column tile of the panel.
  const int64_t w_bytes = p.w_type == GemmType::kBFloat16 ? 2 : 4;
  const int64_t panel = std::max<int64_t>(cb, kPanelBytes / (w_bytes * p.k) / cb * cb);
  const int64_t i_full = p.m / rb * rb;
  // bfloat16 weights: x split in pairs, as the caller gave it (x_pairs), else all rows once when
  // they fit, else per row tile.
  const bool pairs = p.w_type == GemmType::kBFloat16;
  const int64_t kp = SplitLength(p.k);
  const bool given = pairs && p.x_pairs != nullptr;
  const bool whole = pairs && (given || p.m * kp <= kWholeSplitFloats);
  thread_local SplitBuffer split_buffer;
  const float* split = nullptr;
  float* own = nullptr;
  if (given) {
    split = p.x_pairs;
  } else if (pairs) {
    split = own = split_buffer.Get(whole ? p.m * kp : rb * kp);
    if (whole) ks.split(p.x, p.ldx, p.m, p.k, own);
  }
  for (int64_t j0 = n0; j0 < n1; j0 += panel) {
    const int64_t j1 = std::min(n1, j0 + panel);
    for (int64_t i = 0; i < p.m;) {
      const int rows = i < i_full ? rb : 1;
      const Tile& wide = rows == rb ? ts.main : ts.row;
      const TileFn narrow = rows == rb ? ts.column.fn : ts.one.fn;
      const float* x = split;
      int64_t ldx = kp;
      if (!pairs) {
        x = p.x + i * p.ldx;
        ldx = p.ldx;
      } else if (whole) {
        x = split + i * kp;
      } else {
        ks.split(p.x + i * p.ldx, p.ldx, rows, p.k, own);
      }
      int64_t j = j0;
      for (; j + wide.cols <= j1; j += wide.cols) {
        wide.fn(x, ldx, WeightRow(p, j), p.ldw, p.k, out);
        Store(p, i, j, rows, wide.cols, out);
      }
      for (; j < j1; ++j) {
        narrow(x, ldx, WeightRow(p, j), p.ldw, p.k, out);
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

int64_t GemmColumnTile() {
  const Kernels& k = Active();
  return std::lcm(std::lcm(k.f32.main.cols, k.f32.row.cols),
                  std::lcm(k.bf16.main.cols, k.bf16.row.cols));
}

int64_t GemmSplitLength(int64_t k) { return SplitLength(k); }

void GemmSplitX(const float* x, int64_t ldx, int64_t m, int64_t k, float* out) {
  Active().split(x, ldx, m, k, out);
}

void GemmSplitX(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, float* out) {
  SplitPairsPortable(x, ldx, m, k, out);
}

std::string_view GemmIsa() { return Active().isa; }

}  // namespace fmoe
