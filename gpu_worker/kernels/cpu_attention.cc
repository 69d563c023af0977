#include "gpu_worker/kernels/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu_worker/kernels/gemm_lanes.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {
namespace {

constexpr int kLanes = 16;

// The exponential, as one sequence of float operations every path takes: n = nearest(x log2 e),
// r = x - n ln2 (two fused steps, Cody-Waite), e^r by Cephes' degree-6 polynomial (Horner with
// fused multiply-adds, then r^2 p + r + 1), times 2^n from the exponent bits; 0 below -87 (where
// 2^n would leave the normal range), NaN kept. For x <= 0 (the softmax's x - max).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpMin = -87.0f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

float ExpPortable(float x) {
  if (std::isnan(x)) return x;
  if (x < kExpMin) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float r2 = r * r;
  const float y = std::fma(p, r2, r) + 1.0f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return y * std::bit_cast<float>(bits);
}

// The kernel's three loops over positions, one set per instruction set.
struct Loops {
  // For kv KV heads from the one at element `off` of a pool row, each with `group` query heads
  // (query head i = h * group + g): scores[i * n + j] = the GEMM's fixed-order dot product of q
  // row i (float32, hd) and KV head h's key of position j (pool row rows[j]), for j < n. One
  // pass over the positions, each row's slice of the KV heads read once, ahead of its use.
  void (*scores)(const float* q, int64_t kv, int64_t group, const void* pool, int64_t ld,
                 int64_t off, const int64_t* rows, int64_t n, int64_t hd, float* scores);
  // e[j] = exp(e[j] - max) for j < n; returns their sum in 16 lanes (lane j mod 16) and the tree.
  float (*exp_sum)(float* e, int64_t n, float max);
  // acc[i * hd + d] = fma(p[i * n + j], v_j[d], acc[i * hd + d]) for j = 0, 1, ... n - 1 (v_j:
  // query head i's KV head's value of position j); one pass as scores'.
  void (*accumulate)(const float* p, int64_t kv, int64_t group, const void* pool, int64_t ld,
                     int64_t off, const int64_t* rows, int64_t n, int64_t hd, float* acc);
};

template <typename W>
const W* At(const void* pool, int64_t ld, int64_t off, int64_t row) {
  return static_cast<const W*>(pool) + row * ld + off;
}

template <typename W>
void ScoresPortable(const float* q, int64_t kv, int64_t group, const void* pool, int64_t ld,
                    int64_t off, const int64_t* rows, int64_t n, int64_t hd, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t h = 0; h < kv; ++h) {
      const W* k = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t i = h * group; i < (h + 1) * group; ++i) {
        float s[kLanes] = {};
        for (int64_t d = 0; d < hd; ++d) {
          s[d % kLanes] = std::fma(q[i * hd + d], GemmWiden(k[d]), s[d % kLanes]);
        }
        scores[i * n + j] = GemmReduceLanes(s);
      }
    }
  }
}

float ExpSumPortable(float* e, int64_t n, float max) {
  float s[kLanes] = {};
  for (int64_t j = 0; j < n; ++j) {
    e[j] = ExpPortable(e[j] - max);
    s[j % kLanes] += e[j];
  }
  return GemmReduceLanes(s);
}

template <typename W>
void AccumulatePortable(const float* p, int64_t kv, int64_t group, const void* pool, int64_t ld,
                        int64_t off, const int64_t* rows, int64_t n, int64_t hd, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t h = 0; h < kv; ++h) {
      const W* v = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t i = h * group; i < (h + 1) * group; ++i) {
        const float pj = p[i * n + j];
        for (int64_t d = 0; d < hd; ++d) {
          acc[i * hd + d] = std::fma(pj, GemmWiden(v[d]), acc[i * hd + d]);
        }
      }
    }
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

// ExpPortable's steps on 8 lanes.
FMOE_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, e);
}

// Prefetches the head's slice of pool row `row` (its key or value: hd elements) into L1: the rows
// of a sequence sit in 16-row blocks wherever the pool put them, which the hardware's prefetchers
// do not follow.
template <typename W>
inline void PrefetchRow(const void* pool, int64_t ld, int64_t off, int64_t row, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(At<W>(pool, ld, off, row));
  const auto bytes = static_cast<int64_t>(sizeof(W)) * hd;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}
constexpr int64_t kPrefetchAhead = 8;  // Positions.

// G query heads' dot products with one key (the GEMM's order: lanes 0-7 in lo, 8-15 in hi),
// interleaved so their fused multiply-adds do not wait on each other.
template <int G, typename W>
FMOE_AVX2 inline void DotsAvx2(const float* q, int64_t hd, const W* k, const float* kt, float* out,
                               int64_t stride) {
  const int64_t full = hd - hd % kLanes;
  __m256 lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < full; d += kLanes) {
    const __m256 k0 = Load8(k + d), k1 = Load8(k + d + 8);
    for (int g = 0; g < G; ++g) {
      lo[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), k0, lo[g]);
      hi[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d + 8), k1, hi[g]);
    }
  }
  if (full < hd) {
    // The last block, zero-padded to 16 lanes (kt: the key's, padded by the caller).
    const __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
    for (int g = 0; g < G; ++g) {
      alignas(32) float qt[kLanes] = {};
      for (int64_t d = full; d < hd; ++d) qt[d - full] = q[g * hd + d];
      lo[g] = _mm256_fmadd_ps(_mm256_load_ps(qt), k0, lo[g]);
      hi[g] = _mm256_fmadd_ps(_mm256_load_ps(qt + 8), k1, hi[g]);
    }
  }
  for (int g = 0; g < G; ++g) out[g * stride] = GemmReduce8(_mm256_add_ps(lo[g], hi[g]));
}

template <typename W>
FMOE_AVX2 void ScoresAvx2(const float* q, int64_t kv, int64_t group, const void* pool, int64_t ld,
                          int64_t off, const int64_t* rows, int64_t n, int64_t hd, float* scores) {
  const int64_t full = hd - hd % kLanes;
  alignas(32) float kt[kLanes] = {};
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) PrefetchRow<W>(pool, ld, off, rows[j + kPrefetchAhead], kv * hd);
    for (int64_t h = 0; h < kv; ++h) {
      const W* k = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t d = full; d < hd; ++d) kt[d - full] = GemmWiden(k[d]);
      for (int64_t i = h * group; i < (h + 1) * group; i += 4) {
        const float* qi = q + i * hd;
        float* out = scores + i * n + j;
        switch (std::min<int64_t>(4, (h + 1) * group - i)) {
          case 1:
            DotsAvx2<1>(qi, hd, k, kt, out, n);
            break;
          case 2:
            DotsAvx2<2>(qi, hd, k, kt, out, n);
            break;
          case 3:
            DotsAvx2<3>(qi, hd, k, kt, out, n);
            break;
          default:
            DotsAvx2<4>(qi, hd, k, kt, out, n);
            break;
        }
      }
    }
  }
}

FMOE_AVX2 float ExpSumAvx2(float* e, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m256 a = Exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), m));
    const __m256 b = Exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j + 8), m));
    _mm256_storeu_ps(e + j, a);
    _mm256_storeu_ps(e + j + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  if (j < n) {
    alignas(32) float t[kLanes];
    for (int l = 0; l < kLanes; ++l) t[l] = j + l < n ? e[j + l] : max;
    const __m256 a = Exp8(_mm256_sub_ps(_mm256_load_ps(t), m));
    const __m256 b = Exp8(_mm256_sub_ps(_mm256_load_ps(t + 8), m));
    _mm256_store_ps(t, a);
    _mm256_store_ps(t + 8, b);
    alignas(32) float z[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      z[l] = j + l < n ? t[l] : 0.0f;
      if (j + l < n) e[j + l] = t[l];
    }
    lo = _mm256_add_ps(lo, _mm256_load_ps(z));
    hi = _mm256_add_ps(hi, _mm256_load_ps(z + 8));
  }
  return GemmReduce8(_mm256_add_ps(lo, hi));
}

// One pass over the positions (each value row read once, ahead of its use): the group's
// accumulators stay in L1 and each takes acc = fma(p_j, v_j, acc) for j = 0, 1, ... (the portable
// order). A pass per 16 values with the accumulators in registers measured slower: it walks the
// positions' rows (a pool row apart each, a page apart for a large model) once per pass.
template <typename W>
FMOE_AVX2 void AccumulateAvx2(const float* p, int64_t kv, int64_t group, const void* pool,
                              int64_t ld, int64_t off, const int64_t* rows, int64_t n, int64_t hd,
                              float* acc) {
  const int64_t full = hd - hd % 8;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) PrefetchRow<W>(pool, ld, off, rows[j + kPrefetchAhead], kv * hd);
    for (int64_t h = 0; h < kv; ++h) {
      const W* v = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t d = 0; d < full; d += 8) {
        const __m256 vd = Load8(v + d);
        for (int64_t i = h * group; i < (h + 1) * group; ++i) {
          float* a = acc + i * hd + d;
          _mm256_storeu_ps(
              a, _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * n + j), vd, _mm256_loadu_ps(a)));
        }
      }
      for (int64_t d = full; d < hd; ++d) {
        const __m128 vd = _mm_set_ss(GemmWiden(v[d]));
        for (int64_t i = h * group; i < (h + 1) * group; ++i) {
          float* a = acc + i * hd + d;
          *a = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(p[i * n + j]), vd, _mm_set_ss(*a)));
        }
      }
    }
  }
}

// GCC 12's AVX-512 intrinsics start their results from a self-initialised "undefined" value,
// which -Wuninitialized reports in every caller (GCC bug 105593); the values are all defined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

// ExpPortable's steps on 16 lanes.
FMOE_AVX512 inline __m512 Exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
}

template <int G, typename W>
FMOE_AVX512 inline void DotsAvx512(const float* q, int64_t hd, const W* k, float* out,
                                   int64_t stride) {
  const int64_t full = hd - hd % kLanes;
  __m512 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < full; d += kLanes) {
    const __m512 kv = LoadTail16(k + d, 0xffff);
    for (int g = 0; g < G; ++g) {
      acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * hd + d), kv, acc[g]);
    }
  }
  if (full < hd) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (hd - full)) - 1u);
    const __m512 kv = LoadTail16(k + full, tail);
    for (int g = 0; g < G; ++g) {
      acc[g] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + g * hd + full), kv, acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) out[g * stride] = Reduce16(acc[g]);
}

template <typename W>
FMOE_AVX512 void ScoresAvx512(const float* q, int64_t kv, int64_t group, const void* pool,
                              int64_t ld, int64_t off, const int64_t* rows, int64_t n, int64_t hd,
                              float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) PrefetchRow<W>(pool, ld, off, rows[j + kPrefetchAhead], kv * hd);
    for (int64_t h = 0; h < kv; ++h) {
      const W* k = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t i = h * group; i < (h + 1) * group; i += 4) {
        const float* qi = q + i * hd;
        float* out = scores + i * n + j;
        switch (std::min<int64_t>(4, (h + 1) * group - i)) {
          case 1:
            DotsAvx512<1>(qi, hd, k, out, n);
            break;
          case 2:
            DotsAvx512<2>(qi, hd, k, out, n);
            break;
          case 3:
            DotsAvx512<3>(qi, hd, k, out, n);
            break;
          default:
            DotsAvx512<4>(qi, hd, k, out, n);
            break;
        }
      }
    }
  }
}

FMOE_AVX512 float ExpSumAvx512(float* e, int64_t n, float max) {
  const __m512 m = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t left = std::min<int64_t>(kLanes, n - j);
    const __mmask16 k = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 x = _mm512_mask_loadu_ps(m, k, e + j);
    const __m512 y = _mm512_maskz_mov_ps(k, Exp16(_mm512_sub_ps(x, m)));
    _mm512_mask_storeu_ps(e + j, k, y);
    sum = _mm512_add_ps(sum, y);
  }
  return Reduce16(sum);
}

// AccumulateAvx2's pass on 16 lanes (the last block masked).
template <typename W>
FMOE_AVX512 void AccumulateAvx512(const float* p, int64_t kv, int64_t group, const void* pool,
                                  int64_t ld, int64_t off, const int64_t* rows, int64_t n,
                                  int64_t hd, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchAhead < n) PrefetchRow<W>(pool, ld, off, rows[j + kPrefetchAhead], kv * hd);
    for (int64_t h = 0; h < kv; ++h) {
      const W* v = At<W>(pool, ld, off + h * hd, rows[j]);
      for (int64_t d = 0; d < hd; d += kLanes) {
        const int64_t left = std::min<int64_t>(kLanes, hd - d);
        const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
        const __m512 vd = LoadTail16(v + d, mask);
        for (int64_t i = h * group; i < (h + 1) * group; ++i) {
          float* a = acc + i * hd + d;
          _mm512_mask_storeu_ps(
              a, mask,
              _mm512_fmadd_ps(_mm512_set1_ps(p[i * n + j]), vd, _mm512_maskz_loadu_ps(mask, a)));
        }
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif

struct Kernels {
  std::string_view isa;
  Loops f32, bf16;
  const Loops& For(GemmType t) const { return t == GemmType::kBFloat16 ? bf16 : f32; }
};

#define FMOE_LOOPS(suffix, exp_sum, W) \
  Loops { &Scores##suffix<W>, &exp_sum, &Accumulate##suffix<W> }

const Kernels& PortableKernels() {
  static const Kernels k{"portable", FMOE_LOOPS(Portable, ExpSumPortable, float),
                         FMOE_LOOPS(Portable, ExpSumPortable, uint16_t)};
  return k;
}

#if defined(__x86_64__)
const Kernels& Avx2Kernels() {
  static const Kernels k{"avx2", FMOE_LOOPS(Avx2, ExpSumAvx2, float),
                         FMOE_LOOPS(Avx2, ExpSumAvx2, uint16_t)};
  return k;
}
const Kernels& Avx512Kernels() {
  static const Kernels k{"avx512", FMOE_LOOPS(Avx512, ExpSumAvx512, float),
                         FMOE_LOOPS(Avx512, ExpSumAvx512, uint16_t)};
  return k;
}
#endif

#undef FMOE_LOOPS

// The kernels of the named code when this CPU runs it, else null. The active code is the GEMM's
// (GemmIsa: the best this CPU runs, or FMOE_GEMM_ISA's).
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
    const Kernels* named = Named(GemmIsa());
    return named != nullptr ? *named : PortableKernels();
  }();
  return k;
}

float Bf16Round(float f) { return GemmWiden(GemmRoundToBFloat16(f)); }

// Per-thread scratch: the group's queries, scores and accumulators, grown once and reused.
std::vector<float>& Scratch() {
  thread_local std::vector<float> s;
  return s;
}

void Run(const Kernels& ks, const DecodeAttentionProblem& p, int64_t h0, int64_t h1) {
  if (h1 <= h0 || p.positions <= 0 || p.heads <= 0 || p.kv_heads <= 0) return;
  const Loops& loops = ks.For(p.type);
  const bool bf16 = p.type == GemmType::kBFloat16;
  const int64_t group = p.heads / p.kv_heads, hd = p.head_dim, n = p.positions;
  // The range's query heads [h0 * group, h1 * group): queries, accumulators, scores.
  const int64_t first = h0 * group, qh = (h1 - h0) * group;
  // Each part starts on a 64-byte line: an accumulator vector split over two lines defeats the
  // store-to-load forwarding its next update depends on.
  auto lines = [](int64_t floats) { return (floats + 15) / 16 * 16; };
  std::vector<float>& scratch = Scratch();
  const auto need = static_cast<size_t>(lines(qh * hd) * 2 + lines(qh * n) + 16);
  if (scratch.size() < need) scratch.resize(need);
  const auto base = reinterpret_cast<uintptr_t>(scratch.data());
  float* q = scratch.data() + ((64 - base % 64) % 64) / sizeof(float);
  float* acc = q + lines(qh * hd);
  float* s = acc + lines(qh * hd);
  for (int64_t i = 0; i < qh * hd; ++i) {
    const int64_t e = first * hd + i;
    q[i] =
        bf16 ? GemmWiden(static_cast<const uint16_t*>(p.q)[e]) : static_cast<const float*>(p.q)[e];
  }
  loops.scores(q, h1 - h0, group, p.k_pool, p.pool_ld, h0 * hd, p.rows, n, hd, s);
  for (int64_t i = 0; i < qh; ++i) {
    float* si = s + i * n;
    // LibTorch's expression: matmul (rounded to the dtype), * scale (rounded again), then the
    // softmax in float32 with the sink as one more logit.
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      si[j] = bf16 ? Bf16Round(Bf16Round(si[j]) * p.scale) : si[j] * p.scale;
      max = std::max(max, si[j]);
    }
    const float sink = p.sinks != nullptr ? p.sinks[first + i] : 0.0f;
    if (p.sinks != nullptr) max = std::max(max, sink);
    float sum = loops.exp_sum(si, n, max);
    if (p.sinks != nullptr) sum += ExpPortable(sink - max);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) si[j] = bf16 ? Bf16Round(si[j] * inv) : si[j] * inv;
  }
  std::fill(acc, acc + qh * hd, 0.0f);
  loops.accumulate(s, h1 - h0, group, p.v_pool, p.pool_ld, h0 * hd, p.rows, n, hd, acc);
  for (int64_t i = 0; i < qh * hd; ++i) {
    const int64_t e = first * hd + i;
    if (bf16) {
      static_cast<uint16_t*>(p.out)[e] = GemmRoundToBFloat16(acc[i]);
    } else {
      static_cast<float*>(p.out)[e] = acc[i];
    }
  }
}

}  // namespace

void DecodeAttentionHeads(const DecodeAttentionProblem& p, int64_t h0, int64_t h1) {
  Run(Active(), p, h0, h1);
}

bool DecodeAttentionHeadsOn(std::string_view isa, const DecodeAttentionProblem& p, int64_t h0,
                            int64_t h1) {
  const Kernels* ks = Named(isa);
  if (ks == nullptr) return false;
  Run(*ks, p, h0, h1);
  return true;
}

float DecodeAttentionExp(float x) { return ExpPortable(x); }

}  // namespace fmoe
