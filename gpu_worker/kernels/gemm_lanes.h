// The host GEMM's last step (cpu_gemm.h), for other kernels that must give its bits: the 16
// partial sums of one output, held as lo (lanes 0-7) + hi (lanes 8-15) = t, reduced in the
// GEMM's fixed tree (t[l] + t[l + 4], then + [l + 2], then [0] + [1]). cpu_expert.cc's fused
// FP8 and INT4 decoders end with it, so they equal the GEMM over the dequantized rows.
// Pure functions, x86-64 with AVX2 only.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace fmoe {

__attribute__((target("avx2,fma"))) inline float GemmReduce8(__m256 t) {
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

}  // namespace fmoe
#endif
