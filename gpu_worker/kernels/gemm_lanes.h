// The host GEMM's arithmetic (cpu_gemm.h), for other kernels that must give its bits: bfloat16
// widening and rounding, and its last step (the reduction tree over 16 partial sums: t[l] =
// s[l] + s[l + 8], then + [l + 4], + [l + 2], [0] + [1]), scalar and, held as lo (lanes 0-7) +
// hi (lanes 8-15) = t, in AVX2. cpu_expert.cc's fused FP8 and INT4 decoders end with it, so they
// equal the GEMM over the dequantized rows; cpu_attention.cc's dot products and sums use it.
// Pure functions.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {

inline float GemmWiden(float v) { return v; }
// bfloat16 -> float32: the high half of the float's bits.
inline float GemmWiden(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

// float32 -> bfloat16, rounded to nearest even as LibTorch rounds (NaN stays a quiet NaN).
inline uint16_t GemmRoundToBFloat16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The tree over 16 partial sums.
inline float GemmReduceLanes(const float* s) {
  float t[8], u[4], v[2];
  for (int l = 0; l < 8; ++l) t[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
  for (int l = 0; l < 2; ++l) v[l] = u[l] + u[l + 2];
  return v[0] + v[1];
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float GemmReduce8(__m256 t) {
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
#endif

}  // namespace fmoe
