#include "gpu_worker/experts/cpu_expert.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "common/model/quant.h"
#include "gpu_worker/experts/quantized.h"
#include "gpu_worker/kernels/cpu_gemm.h"
#include "gpu_worker/kernels/gemm_lanes.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {

namespace {

constexpr int kTile = 4;  // Tokens per pass over a row in the fused kernels.
// Output rows per parallel task, rounded up to whole GEMM tiles: a task's rows meet every token
// in the matrix product (each weight read once per block of tokens).
constexpr int64_t kChunkRows = 64;

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {  // bfloat16 -> float32: the high half of the float's bits.
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__x86_64__)
#define FMOE_AVX2 __attribute__((target("avx2,fma,f16c")))

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return have;
}
#else
bool HaveAvx2() { return false; }
#endif

// A float expert's rows, read in place.
template <typename W>
struct PlainRows {
  const W* base;
  int64_t len;
  bool FusedDots(int64_t, const float*, int64_t, int64_t, float*, int64_t, float*) const {
    return false;
  }
};

// A stored scale (float32, bfloat16 or float16) as float32.
float ScaleAt(const void* p, at::ScalarType dtype, int64_t i) {
  if (dtype == at::kFloat) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (dtype == at::kBFloat16) return Widen(h);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// FP8 e4m3 bytes as float32 (Fp8E4m3ToFloat, tabulated).
const float* Fp8Table() {
  static const auto* table = [] {
    auto* t = new float[256];
    for (int b = 0; b < 256; ++b) t[b] = Fp8E4m3ToFloat(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

#if defined(__x86_64__)
// Eight FP8 e4m3 bytes as float32, exactly as Fp8E4m3ToFloat: a normal value's 7 low bits shifted
// into a float's exponent and mantissa with the exponent rebased (+120); exponent 0 is m x 2^-9;
// 0x7f is NaN; the sign bit moved to the top.
FMOE_AVX2 inline __m256 DecodeFp8x8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
  __m256 v = _mm256_blendv_ps(normal, sub,
                              _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// The eight 4-bit values of one int32 (nibble k = element k) as float32 0..15.
FMOE_AVX2 inline __m256 Nibbles8(int32_t word) {
  const __m256i v =
      _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
}

// buf[k] = fp8(row[k]) x scale for k < n (n a multiple of 8).
FMOE_AVX2 void Fp8RunAvx2(const uint8_t* row, float scale, int64_t n, float* buf) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < n; k += 8)
    _mm256_storeu_ps(buf + k, _mm256_mul_ps(DecodeFp8x8(row + k), s));
}

// buf[k] = (nibble k - offset) x scale for the 8 x words values.
FMOE_AVX2 void Int4RunAvx2(const int32_t* words, int64_t n_words, float offset, float scale,
                           float* buf) {
  const __m256 o = _mm256_set1_ps(offset), s = _mm256_set1_ps(scale);
  for (int64_t w = 0; w < n_words; ++w) {
    _mm256_storeu_ps(buf + 8 * w, _mm256_mul_ps(_mm256_sub_ps(Nibbles8(words[w]), o), s));
  }
}

// The fused kernels compute what the host GEMM (gpu_worker/kernels/cpu_gemm.h) computes over the
// dequantized rows: the same weights, the same 16 partial sums in the same order (the last block
// zero-padded), the same reduction, so the same bits; they decode each weight in registers instead
// of from a buffer: NT tokens per pass, 16 columns per step.

// The last, partial block of 16 columns: `w` holds its weights zero-padded; x's columns [k, len)
// of each token join the partial sums as one more step.
template <int NT>
FMOE_AVX2 inline void TailStep(const float* w, const float* x, int64_t ldx, int64_t k, int64_t len,
                               __m256 (&a0)[NT], __m256 (&a1)[NT]) {
  const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
  for (int t = 0; t < NT; ++t) {
    alignas(32) float xt[16] = {};
    for (int64_t j = k; j < len; ++j) xt[j - k] = x[t * ldx + j];
    a0[t] = _mm256_fmadd_ps(w0, _mm256_load_ps(xt), a0[t]);
    a1[t] = _mm256_fmadd_ps(w1, _mm256_load_ps(xt + 8), a1[t]);
  }
}

struct Floats16 {
  __m256 lo, hi;
};

FMOE_AVX2 inline Floats16 DecodeFp8Scaled16(const uint8_t* p, __m256 scale256) {
  const __m256i b =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // 16 x u16
  const __m256i mag = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3f80));
  const __m256i sign =
      _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
  const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3f80)),
                                       _mm256_set1_epi16(0x7e00));
  const __m256i h = _mm256_or_si256(_mm256_or_si256(mag, sign), nan);
  return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale256),
          _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale256)};
}

// FP8: `scales256[c / bi]` = the column block's scale x 2^8 (bi a multiple of 16).
template <int NT>
FMOE_AVX2 void Fp8DotsAvx2(const uint8_t* row, const float* scales256, int64_t bi, const float* x,
                           int64_t ldx, int64_t len, float* out) {
  __m256 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  int64_t k = 0, block = 0, block_end = bi;
  __m256 s = _mm256_set1_ps(scales256[0]);
  for (; k + 16 <= len; k += 16) {
    if (k >= block_end) {
      ++block;
      block_end += bi;
      s = _mm256_set1_ps(scales256[block]);
    }
    const Floats16 w = DecodeFp8Scaled16(row + k, s);
    const __m256 w0 = w.lo, w1 = w.hi;
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + k), a0[t]);
      a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + k + 8), a1[t]);
    }
  }
  if (k < len) {
    const float* table = Fp8Table();
    alignas(32) float w[16] = {};
    for (int64_t j = k; j < len; ++j) w[j - k] = table[row[j]] * (scales256[j / bi] * 0x1p-8f);
    TailStep<NT>(w, x, ldx, k, len, a0, a1);
  }
  for (int t = 0; t < NT; ++t) out[t] = GemmReduce8(_mm256_add_ps(a0[t], a1[t]));
}

// INT4: w = (nibble - offset[g]) x scale[g] for the column's group g (the group a multiple
// of 16).
template <int NT>
FMOE_AVX2 void Int4DotsAvx2(const int32_t* words, const float* offsets, const float* scales,
                            int64_t group, const float* x, int64_t ldx, int64_t len, float* out) {
  __m256 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  int64_t k = 0, g = 0, group_end = group;
  __m256 o = _mm256_set1_ps(offsets[0]), s = _mm256_set1_ps(scales[0]);
  for (; k + 16 <= len; k += 16) {
    if (k >= group_end) {
      ++g;
      group_end += group;
      o = _mm256_set1_ps(offsets[g]);
      s = _mm256_set1_ps(scales[g]);
    }
    const __m256 w0 = _mm256_mul_ps(_mm256_sub_ps(Nibbles8(words[k / 8]), o), s);
    const __m256 w1 = _mm256_mul_ps(_mm256_sub_ps(Nibbles8(words[k / 8 + 1]), o), s);
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + k), a0[t]);
      a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + k + 8), a1[t]);
    }
  }
  if (k < len) {
    alignas(32) float w[16] = {};
    for (int64_t j = k; j < len; ++j) {
      const float q = static_cast<float>((words[j / 8] >> (4 * (j % 8))) & 15);
      w[j - k] = (q - offsets[j / group]) * scales[j / group];
    }
    TailStep<NT>(w, x, ldx, k, len, a0, a1);
  }
  for (int t = 0; t < NT; ++t) out[t] = GemmReduce8(_mm256_add_ps(a0[t], a1[t]));
}

// Runs KERNEL<NT> (NT = 1..4) for `tokens` tokens, a pass per 4.
#define FMOE_TILED(KERNEL, tokens, x, ldx, out, ldo, ...)                       \
  do {                                                                          \
    float tile_[kTile];                                                         \
    for (int64_t t0_ = 0; t0_ < (tokens); t0_ += kTile) {                       \
      const int nt_ = static_cast<int>(std::min<int64_t>(kTile, (tokens)-t0_)); \
      const float* xt_ = (x) + t0_ * (ldx);                                     \
      switch (nt_) {                                                            \
        case 1:                                                                 \
          KERNEL<1>(__VA_ARGS__, xt_, (ldx), len, tile_);                       \
          break;                                                                \
        case 2:                                                                 \
          KERNEL<2>(__VA_ARGS__, xt_, (ldx), len, tile_);                       \
          break;                                                                \
        case 3:                                                                 \
          KERNEL<3>(__VA_ARGS__, xt_, (ldx), len, tile_);                       \
          break;                                                                \
        default:                                                                \
          KERNEL<4>(__VA_ARGS__, xt_, (ldx), len, tile_);                       \
          break;                                                                \
      }                                                                         \
      for (int t_ = 0; t_ < nt_; ++t_) (out)[(t0_ + t_) * (ldo)] = tile_[t_];   \
    }                                                                           \
  } while (false)
#endif

// FP8 block (scales per bo x bi block) or per channel (bi = len: one scale per row).
// MXFP4 rows (gpt-oss): row i is len / 2 bytes, byte k holding elements 2k (low nibble) and
// 2k + 1 (high nibble) as FP4 e2m1, each block of 32 times 2^(scale byte - 127). Decoded a row at
// a time into the buffer (exact in float32), then dotted by the vectorised float loop.
struct Mxfp4Rows {
  const uint8_t* w;
  const uint8_t* scale;
  int64_t len;  // Elements per row (a multiple of 32).
  bool FusedDots(int64_t, const float*, int64_t, int64_t, float*, int64_t, float*) const {
    return false;
  }
  const float* Row(int64_t i, float* buf) const {
    static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    const uint8_t* row = w + i * (len / 2);
    const uint8_t* scales = scale + i * (len / 32);
    for (int64_t b = 0; b < len / 32; ++b) {
      const float s = std::ldexp(1.0f, static_cast<int>(scales[b]) - 127);
      for (int64_t k = 0; k < 16; ++k) {
        const uint8_t byte = row[b * 16 + k];
        buf[b * 32 + 2 * k] = kValues[byte & 15] * s;
        buf[b * 32 + 2 * k + 1] = kValues[byte >> 4] * s;
      }
    }
    return buf;
  }
};

struct Fp8Rows {
  const uint8_t* w;
  const void* scale;
  at::ScalarType scale_dtype;
  int64_t len, bo, bi, scale_cols;
  // Row i's dots with `tokens` tokens straight from the stored bytes (buf: scratch of len
  // floats); false where the fused kernel does not apply (the caller dequantizes the row).
  bool FusedDots(int64_t i, const float* x, int64_t ldx, int64_t tokens, float* out, int64_t ldo,
                 float* buf) const {
#if defined(__x86_64__)
    if (!HaveAvx2() || bi % 16 != 0) return false;
    float* scales256 = buf;  // One per column block: len / bi + 1 <= len floats.
    const int64_t blocks = (len + bi - 1) / bi;
    for (int64_t b = 0; b < blocks; ++b) {
      scales256[b] = ScaleAt(scale, scale_dtype, (i / bo) * scale_cols + b) * 0x1p8f;
      if (!std::isfinite(scales256[b]) || scales256[b] == 0.0f) return false;
    }
    const uint8_t* row = w + i * len;
    FMOE_TILED(Fp8DotsAvx2, tokens, x, ldx, out, ldo, row, scales256, bi);
    return true;
#else
    return false;
#endif
  }
  const float* Row(int64_t i, float* buf) const {
    const uint8_t* row = w + i * len;
    const float* table = Fp8Table();
    for (int64_t c0 = 0; c0 < len; c0 += bi) {
      const int64_t n = std::min(bi, len - c0);
      const float s = ScaleAt(scale, scale_dtype, (i / bo) * scale_cols + c0 / bi);
      int64_t k = 0;
#if defined(__x86_64__)
      if (HaveAvx2()) {
        k = n / 8 * 8;
        Fp8RunAvx2(row + c0, s, k, buf + c0);
      }
#endif
      for (; k < n; ++k) buf[c0 + k] = table[row[c0 + k]] * s;
    }
    return buf;
  }
};

// compressed-tensors pack-quantized INT4: a row's words hold 8 columns each; a scale (and a zero
// point) per group of columns, or per column's stored group (g_idx).
struct Int4Rows {
  const int32_t* w;
  const void* scale;
  at::ScalarType scale_dtype;
  const int32_t* zero;   // [ceil(out / 8), groups], packed along the rows; null if symmetric.
  const int32_t* g_idx;  // [len]; null: column / group.
  int64_t len, group, groups;
  float Offset(int64_t i, int64_t g) const {  // 8 + the signed zero point.
    if (zero == nullptr) return 8.0f;
    return static_cast<float>((zero[(i / 8) * groups + g] >> (4 * (i % 8))) & 15);
  }
  bool FusedDots(int64_t i, const float* x, int64_t ldx, int64_t tokens, float* out, int64_t ldo,
                 float* buf) const {
#if defined(__x86_64__)
    if (!HaveAvx2() || g_idx != nullptr || group % 16 != 0) return false;
    float* offsets = buf;  // One per group: 2 x groups <= len floats.
    float* scales = buf + groups;
    for (int64_t g = 0; g < groups; ++g) {
      offsets[g] = Offset(i, g);
      scales[g] = ScaleAt(scale, scale_dtype, i * groups + g);
    }
    const int32_t* row = w + i * (len / 8);
    FMOE_TILED(Int4DotsAvx2, tokens, x, ldx, out, ldo, row, offsets, scales, group);
    return true;
#else
    return false;
#endif
  }
  const float* Row(int64_t i, float* buf) const {
    const int32_t* row = w + i * (len / 8);
    if (g_idx != nullptr || group % 8 != 0) {
      for (int64_t c = 0; c < len; ++c) {
        const int64_t g = g_idx != nullptr ? g_idx[c] : c / group;
        const float q = static_cast<float>((row[c / 8] >> (4 * (c % 8))) & 15);
        buf[c] = (q - Offset(i, g)) * ScaleAt(scale, scale_dtype, i * groups + g);
      }
      return buf;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * group, n = std::min(group, len - c0);
      const float o = Offset(i, g), s = ScaleAt(scale, scale_dtype, i * groups + g);
#if defined(__x86_64__)
      if (HaveAvx2()) {
        Int4RunAvx2(row + c0 / 8, n / 8, o, s, buf + c0);
        continue;
      }
#endif
      for (int64_t c = c0; c < c0 + n; ++c) {
        buf[c] = (static_cast<float>((row[c / 8] >> (4 * (c % 8))) & 15) - o) * s;
      }
    }
    return buf;
  }
};

// Rows [i0, i0 + n) of a projection as the GEMM reads them: a float expert's in place, a
// quantized expert's decoded into `buf` (n x len floats), exactly as its dequantization gives them.
struct RowsView {
  const void* w;
  GemmType type;
};
template <typename W>
RowsView BlockOf(const PlainRows<W>& rows, int64_t i0, int64_t /*n*/, float* /*buf*/) {
  return {rows.base + i0 * rows.len,
          std::is_same_v<W, float> ? GemmType::kFloat32 : GemmType::kBFloat16};
}
template <typename Rows>
RowsView BlockOf(const Rows& rows, int64_t i0, int64_t n, float* buf) {
  for (int64_t r = 0; r < n; ++r) {
    float* dst = buf + r * rows.len;
    const float* row = rows.Row(i0 + r, dst);
    if (row != dst) std::memcpy(dst, row, sizeof(float) * static_cast<size_t>(rows.len));
  }
  return {buf, GemmType::kFloat32};
}

// out[t * ldo + r] = row i0 + r of `rows` . x[t] for r < n and every token: fused from the
// stored bytes for a decode-sized call (up to one tile of tokens, each weight decoded once), else
// the host GEMM over the rows read in place or decoded into `buf` (n x len floats). Both give the
// GEMM's bits. `x_pairs`: x split for bfloat16 rows (GemmSplitX), or null.
template <typename Rows>
void Projection(const Rows& rows, int64_t i0, int64_t n, const float* x, int64_t tokens,
                int64_t len, float* out, int64_t ldo, float* buf, const float* x_pairs = nullptr) {
  if (tokens <= kTile) {
    int64_t r = 0;
    while (r < n && rows.FusedDots(i0 + r, x, len, tokens, out + r, ldo, buf)) ++r;
    i0 += r;
    n -= r;
    out += r;
    if (n == 0) return;
  }
  const RowsView v = BlockOf(rows, i0, n, buf);
  GemmProblem p;
  p.x = x;
  p.ldx = len;
  p.x_pairs = x_pairs;
  p.w = v.w;
  p.w_type = v.type;
  p.ldw = len;
  p.y = out;
  p.ldy = ldo;
  p.m = tokens;
  p.n = n;
  p.k = len;
  GemmColumns(p, 0, n);
}

// Rows per parallel task: whole GEMM tiles, about kChunkRows.
int64_t ChunkRows() {
  const int64_t tile = GemmColumnTile();
  return std::max<int64_t>(1, kChunkRows / tile) * tile;
}

// The projections' biases (float32, or nullptr) and gpt-oss's clamp (limit > 0).
struct KernelActivation {
  const float* b1 = nullptr;
  const float* b3 = nullptr;
  const float* b2 = nullptr;
  float limit = 0.0f;
};

template <typename Rows>
void SwiGluKernel(const float* x, const Rows& w1, const Rows& w3, const Rows& w2, int64_t tokens,
                  int64_t hidden, int64_t inter, float* act, float* y,
                  const KernelActivation& a = {}) {
  const int64_t chunk = ChunkRows();
  // bfloat16 rows: x and act split for the GEMM once here, not once per chunk.
  constexpr bool kPairs = std::is_same_v<Rows, PlainRows<uint16_t>>;
  std::vector<float> x_pairs, act_pairs;
  if constexpr (kPairs) {
    x_pairs.resize(static_cast<size_t>(tokens * GemmSplitLength(hidden)));
    GemmSplitX(x, hidden, tokens, hidden, x_pairs.data());
  }
  // Scratch for the fused kernels' scales (a row's length) or a chunk's decoded rows.
  const auto scratch = [&](int64_t len) {
    return static_cast<size_t>(std::is_same_v<Rows, PlainRows<float>> ||
                                       std::is_same_v<Rows, PlainRows<uint16_t>>
                                   ? len
                                   : chunk * len);
  };
  // act[t, i] = silu(w1[i] . x[t]) * (w3[i] . x[t]), or gpt-oss's clamped form (expert_source.h)
  at::parallel_for(0, (inter + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(static_cast<size_t>(tokens * chunk)), u(g.size());
    std::vector<float> buf(scratch(hidden));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i0 = c * chunk, n = std::min(chunk, inter - i0);
      Projection(w1, i0, n, x, tokens, hidden, g.data(), n, buf.data(),
                 kPairs ? x_pairs.data() : nullptr);
      Projection(w3, i0, n, x, tokens, hidden, u.data(), n, buf.data(),
                 kPairs ? x_pairs.data() : nullptr);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = i0 + r;
          const float b1 = a.b1 != nullptr ? a.b1[i] : 0.0f;
          const float b3 = a.b3 != nullptr ? a.b3[i] : 0.0f;
          float gate = g[t * n + r] + b1, up = u[t * n + r] + b3;
          if (a.limit > 0.0f) {
            gate = std::min(gate, a.limit);
            up = std::clamp(up, -a.limit, a.limit);
            act[t * inter + i] = (up + 1.0f) * (gate / (1.0f + std::exp(-1.702f * gate)));
          } else {
            act[t * inter + i] = gate / (1.0f + std::exp(-gate)) * up;
          }
        }
      }
    }
  });
  if constexpr (kPairs) {
    act_pairs.resize(static_cast<size_t>(tokens * GemmSplitLength(inter)));
    GemmSplitX(act, inter, tokens, inter, act_pairs.data());
  }
  // y[t, j] = w2[j] . act[t] (+ b2[j])
  at::parallel_for(0, (hidden + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(scratch(inter));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j0 = c * chunk, n = std::min(chunk, hidden - j0);
      Projection(w2, j0, n, act, tokens, inter, y + j0, hidden, buf.data(),
                 kPairs ? act_pairs.data() : nullptr);
      if (a.b2 != nullptr) {
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t r = 0; r < n; ++r) y[t * hidden + j0 + r] += a.b2[j0 + r];
        }
      }
    }
  });
}

std::string Shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

}  // namespace

bool CpuSwiGluVectorised() { return HaveAvx2(); }

namespace {

// A quantized projection's row source for the kernel; nullopt for a format it does not read
// (GPTQ and AWQ store the weight transposed: they are dequantized whole first).
std::optional<Fp8Rows> Fp8RowsOf(const QuantSpec& spec, const at::Tensor& w,
                                 const ProjectionParts& p) {
  if (spec.method != QuantMethod::kFp8Block && spec.method != QuantMethod::kFp8Channel) {
    return std::nullopt;
  }
  const int64_t len = w.size(1);
  const bool block = spec.method == QuantMethod::kFp8Block;
  return Fp8Rows{static_cast<const uint8_t*>(w.data_ptr()),
                 p.scale.data_ptr(),
                 p.scale.scalar_type(),
                 len,
                 block ? int64_t{spec.block_out} : 1,
                 block ? int64_t{spec.block_in} : len,
                 p.scale.size(1)};
}

std::optional<Mxfp4Rows> Mxfp4RowsOf(const QuantSpec& spec, const at::Tensor& w,
                                     const ProjectionParts& p) {
  if (spec.method != QuantMethod::kMxfp4) return std::nullopt;
  return Mxfp4Rows{static_cast<const uint8_t*>(w.data_ptr()),
                   static_cast<const uint8_t*>(p.scale.data_ptr()), w.size(1) * 2};
}

std::optional<Int4Rows> Int4RowsOf(const QuantSpec& spec, const at::Tensor& w,
                                   const ProjectionParts& p) {
  if (spec.method != QuantMethod::kInt4Packed) return std::nullopt;
  const int64_t len = w.size(1) * 8;
  return Int4Rows{static_cast<const int32_t*>(w.data_ptr()),
                  p.scale.data_ptr(),
                  p.scale.scalar_type(),
                  p.zero.defined() ? static_cast<const int32_t*>(p.zero.data_ptr()) : nullptr,
                  p.g_idx.defined() ? static_cast<const int32_t*>(p.g_idx.data_ptr()) : nullptr,
                  len,
                  int64_t{spec.group_size},
                  p.scale.size(1)};
}

bool AllContiguous(const ExpertWeights& w) {
  for (const at::Tensor* t : w.Tensors()) {
    if (!t->is_contiguous()) return false;
  }
  return true;
}

}  // namespace

Result<at::Tensor> CpuSwiGlu(const at::Tensor& x, const ExpertWeights& w,
                             const ExpertActivation& activation) {
  if (!x.defined() || !w.w1.defined() || !w.w2.defined() || !w.w3.defined()) {
    return InvalidArgument("cpu expert: undefined input or weights");
  }
  // The biases in float32 (kept alive here) and the clamp, for the kernel.
  std::array<at::Tensor, 3> biases;
  KernelActivation kact;
  kact.limit = static_cast<float>(activation.swiglu_limit);
  for (size_t p = 0; p < 3; ++p) {
    const at::Tensor& b = w.q[p].bias;
    if (!b.defined()) continue;
    if (!b.is_cpu() || b.dim() != 1) {
      return InvalidArgument("cpu expert: a bias must be a vector in host memory");
    }
    biases[p] = b.to(at::kFloat).contiguous();
  }
  // Once the shapes are known good: each bias as long as its projection's rows.
  auto check_biases = [&](int64_t inter, int64_t hidden) -> Status {
    for (auto [p, len] :
         {std::pair{size_t{0}, inter}, std::pair{size_t{2}, inter}, std::pair{size_t{1}, hidden}}) {
      if (biases[p].defined() && biases[p].size(0) != len) {
        return InvalidArgument("cpu expert: a bias of " + std::to_string(biases[p].size(0)) +
                               " values for a projection of " + std::to_string(len) + " rows");
      }
    }
    return Status::Ok();
  };
  if (biases[0].defined()) kact.b1 = biases[0].data_ptr<float>();
  if (biases[2].defined()) kact.b3 = biases[2].data_ptr<float>();
  if (biases[1].defined()) kact.b2 = biases[1].data_ptr<float>();
  for (const at::Tensor* t : w.Tensors()) {
    if (!t->is_cpu())
      return InvalidArgument("cpu expert: input and weights must be in host memory");
  }
  if (!x.is_cpu()) return InvalidArgument("cpu expert: input and weights must be in host memory");
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) {
    return InvalidArgument("cpu expert: input must be float32 or bfloat16");
  }
  if (w.quantized()) {
    for (auto [weight, parts] :
         {std::pair{&w.w1, &w.q[0]}, std::pair{&w.w2, &w.q[1]}, std::pair{&w.w3, &w.q[2]}}) {
      FMOE_RETURN_IF_ERROR(CheckProjection(w.quant, *weight, *parts).WithContext("cpu expert"));
    }
    if (!AllContiguous(w)) return InvalidArgument("cpu expert: weights must be contiguous");
    const auto [inter, hidden_in] = ProjectionShape(w.quant, w.w1);
    const auto [hidden_out, inter_in] = ProjectionShape(w.quant, w.w2);
    if (x.dim() != 2 || x.size(1) != hidden_in || hidden_out != hidden_in || inter_in != inter ||
        ProjectionShape(w.quant, w.w3) != std::make_pair(inter, hidden_in)) {
      return InvalidArgument("cpu expert: shapes do not match: x " + Shape(x) + ", " +
                             w.quant.Describe() + " w1 [" + std::to_string(inter) + ", " +
                             std::to_string(hidden_in) + "], w2 [" + std::to_string(hidden_out) +
                             ", " + std::to_string(inter_in) + "]");
    }
    const int64_t tokens = x.size(0), hidden = hidden_in;
    FMOE_RETURN_IF_ERROR(check_biases(inter, hidden));
    try {
      const at::Tensor xf = x.to(at::kFloat).contiguous();
      at::Tensor act = at::empty({tokens, inter}, xf.options());
      at::Tensor y = at::empty({tokens, hidden}, xf.options());
      if (tokens == 0) return y.to(x.scalar_type());
      auto run = [&](const auto& r1, const auto& r3, const auto& r2) {
        SwiGluKernel(xf.data_ptr<float>(), r1, r3, r2, tokens, hidden, inter, act.data_ptr<float>(),
                     y.data_ptr<float>(), kact);
      };
      if (auto r1 = Fp8RowsOf(w.quant, w.w1, w.q[0])) {
        run(*r1, *Fp8RowsOf(w.quant, w.w3, w.q[2]), *Fp8RowsOf(w.quant, w.w2, w.q[1]));
      } else if (auto i1 = Int4RowsOf(w.quant, w.w1, w.q[0])) {
        run(*i1, *Int4RowsOf(w.quant, w.w3, w.q[2]), *Int4RowsOf(w.quant, w.w2, w.q[1]));
      } else if (auto m1 = Mxfp4RowsOf(w.quant, w.w1, w.q[0])) {
        run(*m1, *Mxfp4RowsOf(w.quant, w.w3, w.q[2]), *Mxfp4RowsOf(w.quant, w.w2, w.q[1]));
      } else {
        // GPTQ and AWQ keep the weight transposed: dequantized whole, then the float kernel.
        FMOE_ASSIGN_OR_RETURN(const ExpertWeights f, DequantizeExpert(w, at::kFloat));
        const int64_t ld_h = hidden, ld_i = inter;
        run(PlainRows<float>{f.w1.data_ptr<float>(), ld_h},
            PlainRows<float>{f.w3.data_ptr<float>(), ld_h},
            PlainRows<float>{f.w2.data_ptr<float>(), ld_i});
      }
      return y.to(x.scalar_type());
    } catch (const c10::Error& e) {
      return Internal(std::string("cpu expert: ") + e.what_without_backtrace());
    }
  }
  const at::ScalarType dt = w.w1.scalar_type();
  if ((dt != at::kFloat && dt != at::kBFloat16) || w.w2.scalar_type() != dt ||
      w.w3.scalar_type() != dt) {
    return InvalidArgument("cpu expert: weights must all be float32 or all bfloat16");
  }
  if (x.dim() != 2 || w.w1.dim() != 2 || w.w3.dim() != 2 || w.w2.dim() != 2) {
    return InvalidArgument("cpu expert: input and weights must be matrices");
  }
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = w.w1.size(0);
  if (w.w1.size(1) != hidden || !w.w3.sizes().equals(w.w1.sizes()) || w.w2.size(0) != hidden ||
      w.w2.size(1) != inter) {
    return InvalidArgument("cpu expert: shapes do not match: x " + Shape(x) + ", w1 " +
                           Shape(w.w1) + ", w3 " + Shape(w.w3) + ", w2 " + Shape(w.w2));
  }
  if (!w.w1.is_contiguous() || !w.w2.is_contiguous() || !w.w3.is_contiguous()) {
    return InvalidArgument("cpu expert: weights must be contiguous");
  }
  FMOE_RETURN_IF_ERROR(check_biases(inter, hidden));
  try {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    at::Tensor act = at::empty({tokens, inter}, xf.options());
    at::Tensor y = at::empty({tokens, hidden}, xf.options());
    if (tokens > 0) {
      if (dt == at::kFloat) {
        SwiGluKernel(xf.data_ptr<float>(), PlainRows<float>{w.w1.data_ptr<float>(), hidden},
                     PlainRows<float>{w.w3.data_ptr<float>(), hidden},
                     PlainRows<float>{w.w2.data_ptr<float>(), inter}, tokens, hidden, inter,
                     act.data_ptr<float>(), y.data_ptr<float>(), kact);
      } else {
        auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); };
        SwiGluKernel(xf.data_ptr<float>(), PlainRows<uint16_t>{bits(w.w1), hidden},
                     PlainRows<uint16_t>{bits(w.w3), hidden},
                     PlainRows<uint16_t>{bits(w.w2), inter}, tokens, hidden, inter,
                     act.data_ptr<float>(), y.data_ptr<float>(), kact);
      }
    }
    return y.to(x.scalar_type());
  } catch (const c10::Error& e) {
    return Internal(std::string("cpu expert: ") + e.what_without_backtrace());
  }
}

}  // namespace fmoe
