#include "gpu_worker/experts/cpu_expert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fmoe {

namespace {

constexpr int kTile = 4;        // Tokens per pass over a weight row.
constexpr int64_t kGrain = 32;  // Output rows per parallel task.

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {  // bfloat16 -> float32: the high half of the float's bits.
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// out[t] = dot(row, x + t * ldx) for t < nt, over len elements: two partial sums per token
// (even and odd blocks of 8), then the tail, always in this order.
template <typename W>
void DotsPortable(const W* row, const float* x, int64_t ldx, int nt, int64_t len, float* out) {
  for (int t = 0; t < nt; ++t) {
    const float* xt = x + t * ldx;
    float acc[16] = {};
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
      for (int i = 0; i < 16; ++i) acc[i] += Widen(row[k + i]) * xt[k + i];
    }
    float sum = 0.0f;
    for (float a : acc) sum += a;
    for (; k < len; ++k) sum += Widen(row[k]) * xt[k];
    out[t] = sum;
  }
}

#if defined(__x86_64__)
#define FMOE_AVX2 __attribute__((target("avx2,fma")))

FMOE_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
FMOE_AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
FMOE_AVX2 inline float Sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// As DotsPortable for NT tokens: each weight element is loaded once and used NT times. A token's
// sums take the same steps whatever NT is.
template <typename W, int NT>
FMOE_AVX2 void DotsAvx2(const W* row, const float* x, int64_t ldx, int64_t len, float* out) {
  __m256 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    const __m256 w0 = Load8(row + k), w1 = Load8(row + k + 8);
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + k), a0[t]);
      a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + k + 8), a1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float sum = Sum8(_mm256_add_ps(a0[t], a1[t]));
    for (int64_t j = k; j < len; ++j) sum += Widen(row[j]) * x[t * ldx + j];
    out[t] = sum;
  }
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}
#else
bool HaveAvx2() { return false; }
#endif

// out[t * ldo] = dot(row, x[t]) for every token, kTile tokens per pass over the row.
template <typename W>
void RowDots(const W* row, const float* x, int64_t ldx, int64_t tokens, int64_t len, float* out,
             int64_t ldo) {
  float tile[kTile];
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int nt = static_cast<int>(std::min<int64_t>(kTile, tokens - t0));
    const float* xt = x + t0 * ldx;
#if defined(__x86_64__)
    if (HaveAvx2()) {
      switch (nt) {
        case 1:
          DotsAvx2<W, 1>(row, xt, ldx, len, tile);
          break;
        case 2:
          DotsAvx2<W, 2>(row, xt, ldx, len, tile);
          break;
        case 3:
          DotsAvx2<W, 3>(row, xt, ldx, len, tile);
          break;
        default:
          DotsAvx2<W, 4>(row, xt, ldx, len, tile);
          break;
      }
    } else {
      DotsPortable(row, xt, ldx, nt, len, tile);
    }
#else
    DotsPortable(row, xt, ldx, nt, len, tile);
#endif
    for (int t = 0; t < nt; ++t) out[(t0 + t) * ldo] = tile[t];
  }
}

template <typename W>
void SwiGluKernel(const float* x, const W* w1, const W* w3, const W* w2, int64_t tokens,
                  int64_t hidden, int64_t inter, float* act, float* y) {
  // act[t, i] = silu(w1[i] . x[t]) * (w3[i] . x[t])
  at::parallel_for(0, inter, kGrain, [&](int64_t begin, int64_t end) {
    float g[kTile * 8], u[kTile * 8];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t t0 = 0; t0 < tokens; t0 += kTile * 8) {
        const int64_t nt = std::min<int64_t>(kTile * 8, tokens - t0);
        RowDots(w1 + i * hidden, x + t0 * hidden, hidden, nt, hidden, g, 1);
        RowDots(w3 + i * hidden, x + t0 * hidden, hidden, nt, hidden, u, 1);
        for (int64_t t = 0; t < nt; ++t) {
          act[(t0 + t) * inter + i] = g[t] / (1.0f + std::exp(-g[t])) * u[t];
        }
      }
    }
  });
  // y[t, j] = w2[j] . act[t]
  at::parallel_for(0, hidden, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      RowDots(w2 + j * inter, act, inter, tokens, inter, y + j, hidden);
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

Result<at::Tensor> CpuSwiGlu(const at::Tensor& x, const ExpertWeights& w) {
  if (!x.defined() || !w.w1.defined() || !w.w2.defined() || !w.w3.defined()) {
    return InvalidArgument("cpu expert: undefined input or weights");
  }
  if (!x.is_cpu() || !w.w1.is_cpu() || !w.w2.is_cpu() || !w.w3.is_cpu()) {
    return InvalidArgument("cpu expert: input and weights must be in host memory");
  }
  const at::ScalarType dt = w.w1.scalar_type();
  if ((dt != at::kFloat && dt != at::kBFloat16) || w.w2.scalar_type() != dt ||
      w.w3.scalar_type() != dt) {
    return InvalidArgument("cpu expert: weights must all be float32 or all bfloat16");
  }
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) {
    return InvalidArgument("cpu expert: input must be float32 or bfloat16");
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
  try {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    at::Tensor act = at::empty({tokens, inter}, xf.options());
    at::Tensor y = at::empty({tokens, hidden}, xf.options());
    if (tokens > 0) {
      if (dt == at::kFloat) {
        SwiGluKernel(xf.data_ptr<float>(), w.w1.data_ptr<float>(), w.w3.data_ptr<float>(),
                     w.w2.data_ptr<float>(), tokens, hidden, inter, act.data_ptr<float>(),
                     y.data_ptr<float>());
      } else {
        auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); };
        SwiGluKernel(xf.data_ptr<float>(), bits(w.w1), bits(w.w3), bits(w.w2), tokens, hidden,
                     inter, act.data_ptr<float>(), y.data_ptr<float>());
      }
    }
    return y.to(x.scalar_type());
  } catch (const c10::Error& e) {
    return Internal(std::string("cpu expert: ") + e.what_without_backtrace());
  }
}

}  // namespace fmoe
