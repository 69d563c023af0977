#include "gpu_worker/model/blocks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numbers>
#include <optional>
#include <string_view>
#include <vector>

#include "gpu_worker/kernels/cpu_attention.h"
#include "gpu_worker/kernels/cpu_gemm.h"

namespace fmoe {

namespace {

std::optional<GemmType> GemmTypeOf(at::ScalarType t) {
  if (t == at::kFloat) return GemmType::kFloat32;
  if (t == at::kBFloat16) return GemmType::kBFloat16;
  return std::nullopt;
}

// x w^T by the host kernel (cpu_gemm.h) when it takes these tensors: float32 or bfloat16 on the
// CPU, w's rows contiguous. The columns are split over the intra-op threads in whole tiles; a
// product too small to be worth waking a thread for runs on the caller's.
std::optional<at::Tensor> HostGemm(const at::Tensor& x, const at::Tensor& w) {
  const std::optional<GemmType> xt = GemmTypeOf(x.scalar_type());
  const std::optional<GemmType> wt = GemmTypeOf(w.scalar_type());
  if (!xt || !wt || !w.is_cpu() || x.dim() != 2 || w.dim() != 2 || w.size(1) != x.size(1) ||
      w.stride(1) != 1) {
    return std::nullopt;
  }
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  GemmProblem p;
  p.w = w.data_ptr();
  p.w_type = *wt;
  p.ldw = w.stride(0);
  p.y = out.data_ptr();
  p.y_type = *xt;
  p.ldy = out.size(1);
  p.m = x.size(0);
  p.n = w.size(0);
  p.k = x.size(1);
  // bfloat16 weights: x split once here for every thread's columns (GemmSplitX), from bfloat16 x
  // directly, into a buffer this thread keeps for its next products when it holds up to 4 MiB
  // (a decode step's), else (a long prefill's) into one of its own, freed after. float32
  // weights: x as float32.
  const bool pairs = p.w_type == GemmType::kBFloat16;
  const bool direct = pairs && *xt == GemmType::kBFloat16 && x.stride(1) == 1;
  at::Tensor xf;
  if (!direct) {
    xf = x.to(at::kFloat).contiguous();
    p.x = xf.data_ptr<float>();
    p.ldx = xf.size(1);
  }
  constexpr size_t kKeptSplitFloats = size_t{1} << 20;
  thread_local std::vector<float> kept;
  std::vector<float> once;
  if (pairs) {
    const auto need = static_cast<size_t>(p.m * GemmSplitLength(p.k));
    std::vector<float>& split = need <= kKeptSplitFloats ? kept : once;
    if (split.size() < need) split.resize(need);
    if (direct) {
      GemmSplitX(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), p.m,
                 p.k, split.data());
    } else {
      GemmSplitX(p.x, p.ldx, p.m, p.k, split.data());
    }
    p.x_pairs = split.data();
  }
  const int64_t tile = GemmColumnTile();
  const int64_t tiles = (p.n + tile - 1) / tile;
  // 32 K multiply-adds a thread at least: a decode step's projections of a small model split over
  // the cores too, whose weights come from L3 or memory faster on two cores than on one (the tiny
  // model's float32 decode: 1.56 -> 1.06 ms a token on 2 cores, bench/RESULTS.md).
  constexpr int64_t kMinMacsPerThread = int64_t{1} << 15;
  const int64_t grain =
      std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, p.m * p.k * tile));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    GemmColumns(p, t0 * tile, std::min(p.n, t1 * tile));
  });
  return out;
}

}  // namespace

at::Tensor BlockLinear(const at::Tensor& x, const at::Tensor& w, int64_t rows,
                       const at::Tensor& bias) {
  const int64_t m = x.size(0);
  at::Tensor out;
  std::optional<at::Tensor> host;
  if (rows > 0 && x.is_cpu() && m > 0 && (host = HostGemm(x, w))) {
    out = std::move(*host);
  } else if (rows <= 0 || !x.is_cpu() || m == 0) {
    out = at::linear(x, w);
  } else {
    out = at::empty({m, w.size(0)}, x.options());
    const at::Tensor wt = w.t();
    const int64_t full = m - m % rows;
    for (int64_t r = 0; r < full; r += rows) {
      at::Tensor dst = out.narrow(0, r, rows);
      at::mm_out(dst, x.narrow(0, r, rows), wt);
    }
    if (full < m) {
      at::Tensor padded = at::zeros({rows, x.size(1)}, x.options());
      padded.narrow(0, 0, m - full).copy_(x.narrow(0, full, m - full));
      out.narrow(0, full, m - full).copy_(at::mm(padded, wt).narrow(0, 0, m - full));
    }
  }
  if (bias.defined()) out.add_(bias);
  return out;
}

namespace {

// RmsNorm of contiguous float32 or bfloat16 rows on the CPU in one pass per row instead of seven
// LibTorch operators: the same arithmetic (the sum of squares in float32, in a fixed order per
// row, so batch-invariant; the normalised value rounded to the dtype before the weight, as the
// expression below rounds it). nullopt where it does not apply.
template <typename T>
void RmsNormRows(const T* x, const T* w, T* out, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      const float v = static_cast<float>(xr[i]);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const T normalized = static_cast<T>(static_cast<float>(xr[i]) * inv);
      o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normalized));
    }
  }
}

std::optional<at::Tensor> HostRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType dt = x.scalar_type();
  if (!x.is_cpu() || !weight.is_cpu() || x.dim() < 1 || !x.is_contiguous() ||
      !weight.is_contiguous() || weight.scalar_type() != dt || weight.dim() != 1 ||
      weight.size(0) != x.size(-1) || (dt != at::kFloat && dt != at::kBFloat16)) {
    return std::nullopt;
  }
  const int64_t d = x.size(-1);
  at::Tensor out = at::empty_like(x);
  if (d == 0 || x.numel() == 0) return out;
  const int64_t rows = x.numel() / d;
  const float e = static_cast<float>(eps);
  if (dt == at::kFloat) {
    RmsNormRows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, d, e);
  } else {
    RmsNormRows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), rows, d, e);
  }
  return out;
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (std::optional<at::Tensor> host = HostRmsNorm(x, weight, eps)) return std::move(*host);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

at::Tensor DecoderNorm(const ModelInfo& info, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias) {
  if (!info.layer_norm) return RmsNorm(x, weight, info.rms_norm_eps);
  return at::layer_norm(x, {x.size(-1)}, weight, bias, info.rms_norm_eps);
}

at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down, int64_t row_block) {
  at::Tensor act = at::silu(BlockLinear(x, gate, row_block)) * BlockLinear(x, up, row_block);
  return BlockLinear(act, down, row_block);
}

at::Tensor ExpertGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                     const at::Tensor& down, const at::Tensor& gate_bias, const at::Tensor& up_bias,
                     const at::Tensor& down_bias, double limit, int64_t row_block) {
  at::Tensor g = BlockLinear(x, gate, row_block, gate_bias);
  at::Tensor u = BlockLinear(x, up, row_block, up_bias);
  at::Tensor act;
  if (limit > 0) {
    g = g.clamp_max(limit);
    u = u.clamp(-limit, limit);
    act = (u + 1) * (g * at::sigmoid(g * 1.702));
  } else {
    act = at::silu(g) * u;
  }
  return BlockLinear(act, down, row_block, down_bias);
}

namespace {

// A float32 or bfloat16 contiguous matrix in host memory: what the bookkeeping loops take.
bool HostMatrix(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.dim() == 2 && t.is_contiguous() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// Whether every index is in [0, n).
bool AllBelow(std::span<const int64_t> rows, int64_t n) {
  return std::all_of(rows.begin(), rows.end(), [n](int64_t r) { return r >= 0 && r < n; });
}

template <typename T>
void PlaceWeightedRowsOf(const T* y, int64_t h, std::span<const int64_t> slot_rows,
                         std::span<const float> weights, T* slots) {
  for (size_t j = 0; j < slot_rows.size(); ++j) {
    // The weight rounded to T as .to() rounds it; the product in float32, rounded to T.
    const auto w = static_cast<float>(static_cast<T>(weights[j]));
    const T* src = y + static_cast<int64_t>(j) * h;
    T* dst = slots + slot_rows[j] * h;
    for (int64_t i = 0; i < h; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]) * w);
  }
}

template <typename T>
void SumSlotsOf(const T* slots, int64_t rows, int64_t top_k, int64_t h, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = slots + r * top_k * h;
    T* o = out + r * h;
    for (int64_t i = 0; i < h; ++i) {
      auto acc = static_cast<T>(0.0f);
      for (int64_t s = 0; s < top_k; ++s) {
        acc = static_cast<T>(static_cast<float>(acc) + static_cast<float>(in[s * h + i]));
      }
      o[i] = acc;
    }
  }
}

}  // namespace

at::Tensor SelectRows(const at::Tensor& x, std::span<const int64_t> rows) {
  const auto n = static_cast<int64_t>(rows.size());
  if (!HostMatrix(x) || !AllBelow(rows, x.size(0))) {
    return x.index_select(
        0, at::tensor(std::vector<int64_t>(rows.begin(), rows.end()), at::dtype(at::kLong))
               .to(x.device()));
  }
  at::Tensor out = at::empty({n, x.size(1)}, x.options());
  const size_t bytes = static_cast<size_t>(x.size(1)) * x.element_size();
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + static_cast<size_t>(i) * bytes,
                src + static_cast<size_t>(rows[static_cast<size_t>(i)]) * bytes, bytes);
  }
  return out;
}

void PlaceWeightedRows(const at::Tensor& y, std::span<const int64_t> slot_rows,
                       std::span<const float> weights, at::Tensor& slots) {
  if (HostMatrix(y) && HostMatrix(slots) && y.scalar_type() == slots.scalar_type() &&
      y.size(0) == static_cast<int64_t>(slot_rows.size()) && y.size(1) == slots.size(1) &&
      weights.size() == slot_rows.size() && AllBelow(slot_rows, slots.size(0))) {
    if (y.scalar_type() == at::kFloat) {
      PlaceWeightedRowsOf(y.data_ptr<float>(), y.size(1), slot_rows, weights,
                          slots.data_ptr<float>());
    } else {
      PlaceWeightedRowsOf(y.data_ptr<at::BFloat16>(), y.size(1), slot_rows, weights,
                          slots.data_ptr<at::BFloat16>());
    }
    return;
  }
  const at::Tensor w =
      at::tensor(std::vector<float>(weights.begin(), weights.end()), at::dtype(at::kFloat))
          .to(slots.device(), slots.scalar_type())
          .unsqueeze(1);
  slots.index_copy_(
      0,
      at::tensor(std::vector<int64_t>(slot_rows.begin(), slot_rows.end()), at::dtype(at::kLong))
          .to(slots.device()),
      y * w);
}

at::Tensor SumSlots(const at::Tensor& slots, int64_t rows, int64_t top_k) {
  const int64_t h = slots.size(-1);
  if (HostMatrix(slots) && slots.size(0) == rows * top_k) {
    at::Tensor out = at::empty({rows, h}, slots.options());
    if (slots.scalar_type() == at::kFloat) {
      SumSlotsOf(slots.data_ptr<float>(), rows, top_k, h, out.data_ptr<float>());
    } else {
      SumSlotsOf(slots.data_ptr<at::BFloat16>(), rows, top_k, h, out.data_ptr<at::BFloat16>());
    }
    return out;
  }
  at::Tensor per_row = slots.view({rows, top_k, h});
  at::Tensor out = at::zeros({rows, h}, slots.options());
  for (int64_t s = 0; s < top_k; ++s) out = out + per_row.select(1, s);
  return out;
}

namespace {

// rotate_half(x) = cat(-x2, x1) over the last dimension.
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// RoPE of rows [t, heads, hd] in one pass on the host, with the arithmetic of the LibTorch
// expression (RotateExpression): each product rounded to T, then their sum rounded to T (in float32
// for bfloat16, as LibTorch's CPU kernels compute it), rotate_half's negation exact; dims [rd, hd)
// copied. cos and sin [t, rd], row stride rd.
template <typename T>
void RotateRows(const T* x, const T* cos, const T* sin, T* out, int64_t t, int64_t heads,
                int64_t hd, int64_t rd) {
  const int64_t half = rd / 2;
  for (int64_t r = 0; r < t; ++r) {
    const T* c = cos + r * rd;
    const T* s = sin + r * rd;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + (r * heads + h) * hd;
      T* o = out + (r * heads + h) * hd;
      for (int64_t i = 0; i < rd; ++i) {
        const float other =
            i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
        const T a = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
        const T b =
            static_cast<T>(static_cast<float>(static_cast<T>(other)) * static_cast<float>(s[i]));
        o[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
      }
      for (int64_t i = rd; i < hd; ++i) o[i] = xr[i];
    }
  }
}

// Rotate on the host where it applies: x [t, heads, hd] contiguous, cos and sin [t, 1, rd]
// contiguous, all float32 or all bfloat16 on the CPU, rd even and at most hd. nullopt elsewhere.
std::optional<at::Tensor> HostRotate(const at::Tensor& x, const at::Tensor& cos,
                                     const at::Tensor& sin) {
  const at::ScalarType dt = x.scalar_type();
  if ((dt != at::kFloat && dt != at::kBFloat16) || !x.is_cpu() || !cos.is_cpu() || !sin.is_cpu() ||
      cos.scalar_type() != dt || sin.scalar_type() != dt || x.dim() != 3 || cos.dim() != 3 ||
      sin.sizes() != cos.sizes() || cos.size(0) != x.size(0) || cos.size(1) != 1 ||
      cos.size(2) > x.size(2) || cos.size(2) % 2 != 0 || !x.is_contiguous() ||
      !cos.is_contiguous() || !sin.is_contiguous()) {
    return std::nullopt;
  }
  at::Tensor out = at::empty_like(x);
  const int64_t t = x.size(0), heads = x.size(1), hd = x.size(2), rd = cos.size(2);
  if (dt == at::kFloat) {
    RotateRows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
               out.data_ptr<float>(), t, heads, hd, rd);
  } else {
    RotateRows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
               sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), t, heads, hd, rd);
  }
  return out;
}

}  // namespace

at::Tensor RotateExpression(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rd = cos.size(-1), hd = x.size(-1);
  if (rd == hd) return x * cos + RotateHalf(x) * sin;
  at::Tensor r = x.narrow(-1, 0, rd);
  return at::cat({r * cos + RotateHalf(r) * sin, x.narrow(-1, rd, hd - rd)}, -1);
}

// RoPE on the first cos.size(-1) dims of each head (rotate_half style); the rest of the head, if
// any, passes through (transformers' partial rotary: GLM-4.5, MiniMax-M2). On the host in one
// pass where HostRotate applies (the same bits), else LibTorch's expression.
at::Tensor RotaryEmbedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (std::optional<at::Tensor> host = HostRotate(x, cos, sin)) return std::move(*host);
  return RotateExpression(x, cos, sin);
}

namespace {

// The decode rows (one new token) of a batch's spans through the host kernel (cpu_attention.h),
// which reads their positions in place from the pool: float32 or bfloat16 on the CPU, q and the
// pool of one dtype. Writes their rows of `attn` and marks them in `on_host`; false, touching
// nothing, where the kernel does not apply. A decode row's sliding window is its span (its first
// position is the first it sees), so no mask is needed.
bool HostDecodeAttention(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& hn,
                         const at::Tensor& sinks, std::span<const AttentionSpan> spans,
                         const std::vector<at::Tensor>& queries, double scale, at::Tensor* attn,
                         std::vector<bool>* on_host) {
  // FMOE_CPU_DECODE_ATTENTION=0 keeps decode rows on LibTorch's expression (to compare them).
  static const bool enabled = [] {
    const char* env = std::getenv("FMOE_CPU_DECODE_ATTENTION");
    return env == nullptr || std::string_view(env) != "0";
  }();
  const std::optional<GemmType> type = GemmTypeOf(hn.scalar_type());
  if (!enabled || !type || !hn.is_cpu() || !k_pool.is_cpu() ||
      k_pool.scalar_type() != hn.scalar_type() || v_pool.scalar_type() != hn.scalar_type() ||
      !k_pool.is_contiguous() || !v_pool.is_contiguous() || k_pool.dim() != 3 ||
      !attn->is_contiguous()) {
    return false;
  }
  const int64_t n_kv = k_pool.size(1), hd = k_pool.size(2);
  const int64_t heads = attn->size(1) / hd;
  struct Row {
    DecodeAttentionProblem p;
    at::Tensor q;
  };
  std::vector<Row> rows;
  const at::Tensor sink_logits = sinks.defined() ? sinks.to(at::kFloat).contiguous() : sinks;
  for (size_t i = 0; i < spans.size(); ++i) {
    const AttentionSpan& s = spans[i];
    if (s.tokens != 1 || !s.slots.is_cpu() || s.slots.scalar_type() != at::kLong ||
        !s.slots.is_contiguous() || queries[i].scalar_type() != hn.scalar_type()) {
      continue;
    }
    Row r;
    r.q = queries[i].contiguous();
    r.p.q = r.q.data_ptr();
    r.p.k_pool = k_pool.data_ptr();
    r.p.v_pool = v_pool.data_ptr();
    r.p.pool_ld = n_kv * hd;
    r.p.rows = s.slots.data_ptr<int64_t>();
    r.p.positions = s.slots.size(0);
    r.p.heads = heads;
    r.p.kv_heads = n_kv;
    r.p.head_dim = hd;
    r.p.scale = static_cast<float>(scale);
    r.p.sinks = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
    r.p.type = *type;
    r.p.out = static_cast<char*>(attn->data_ptr()) + s.row * attn->stride(0) * attn->element_size();
    rows.push_back(std::move(r));
    (*on_host)[i] = true;
  }
  if (rows.empty()) return true;
  // A task per (row, range of KV heads): a row's KV heads together (its pool rows read whole,
  // once), in as many ranges as the threads need when the rows are fewer than the threads; a
  // step too small to be worth waking a thread for runs on the caller's (macs: a task's
  // multiply-adds, on average). Any split gives the same bits.
  const auto n_rows = static_cast<int64_t>(rows.size());
  const int64_t parts = std::clamp<int64_t>((at::get_num_threads() + n_rows - 1) / n_rows, 1, n_kv);
  const int64_t tasks = n_rows * parts;
  int64_t positions = 0;
  for (const Row& r : rows) positions += r.p.positions;
  const int64_t macs = 2 * heads * hd * positions / tasks;
  constexpr int64_t kMinMacsPerThread = int64_t{1} << 16;
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, macs));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t part = t % parts;
      DecodeAttentionHeads(rows[static_cast<size_t>(t / parts)].p, part * n_kv / parts,
                           (part + 1) * n_kv / parts);
    }
  });
  return true;
}

}  // namespace

int64_t QueryBlockRows(int64_t heads, int64_t keys, int64_t score_budget) {
  return std::max<int64_t>(1, score_budget / std::max<int64_t>(1, heads * keys));
}

at::ScalarType ProductDType(const at::Tensor& hn) {
  return hn.device().is_cpu() ? at::kFloat : hn.scalar_type();
}

at::Tensor Attention(const ModelInfo& info, const AttentionWeights& w, const at::Tensor& hn,
                     std::span<const AttentionSpan> spans, const RotaryTables& rope,
                     int64_t row_block, int64_t score_budget) {
  const int64_t n_heads = info.num_attention_heads, n_kv = info.num_key_value_heads;
  const int64_t hd = info.head_dim, group = n_heads / n_kv, rows = hn.size(0);
  at::Tensor q = BlockLinear(hn, w.wq, row_block, w.bq);
  at::Tensor k = BlockLinear(hn, w.wk, row_block, w.bk);
  at::Tensor v = BlockLinear(hn, w.wv, row_block, w.bv);
  switch (info.qk_norm) {
    case QkNorm::kNone:
      break;
    case QkNorm::kPerHead:  // Qwen3-MoE: over each head, before RoPE.
      q = RmsNorm(q.view({rows, n_heads, hd}), w.q_norm, info.rms_norm_eps)
              .view({rows, n_heads * hd});
      k = RmsNorm(k.view({rows, n_kv, hd}), w.k_norm, info.rms_norm_eps).view({rows, n_kv * hd});
      break;
    case QkNorm::kWhole:  // OLMoE: over the whole projection, before clipping and RoPE.
      q = RmsNorm(q, w.q_norm, info.rms_norm_eps);
      k = RmsNorm(k, w.k_norm, info.rms_norm_eps);
      break;
  }
  if (info.clip_qkv) {
    const double c = *info.clip_qkv;
    q = q.clamp(-c, c);
    k = k.clamp(-c, c);
    v = v.clamp(-c, c);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int64_t window = w.window;
  // gpt-oss's sinks: query row r of KV head kv's group (r / b its head in the group) gets the
  // sink logit of head kv * group + r / b as one more column before the softmax.
  at::Tensor sinks;
  if (w.sinks.defined()) sinks = w.sinks.to(at::kFloat).view({n_kv, group, 1, 1});
  at::Tensor attn = at::empty({rows, n_heads * hd}, hn.options());
  // Every sequence's new keys and values rotated and written to the pool in one copy, then every
  // position the batch reads gathered in one (slot j of a span holds position first + j).
  std::vector<at::Tensor> queries(spans.size()), new_k(spans.size()), new_v(spans.size());
  std::vector<at::Tensor> new_slots(spans.size()), read_slots(spans.size());
  std::vector<int64_t> read_at(spans.size() + 1, 0);
  // A batch of several spans that cover its rows in order and share a rotary table is rotated in
  // one pass (each row's cos and sin gathered by its position): the same elementwise arithmetic,
  // a fixed number of operators instead of a dozen per sequence.
  auto long_rope = [&](const AttentionSpan& s) {
    return rope.long_after > 0 && s.position + s.tokens > rope.long_after;
  };
  bool one_pass = spans.size() > 1;
  for (size_t i = 0, row = 0; one_pass && i < spans.size(); ++i) {
    one_pass =
        spans[i].row == static_cast<int64_t>(row) && long_rope(spans[i]) == long_rope(spans[0]);
    row += static_cast<size_t>(spans[i].tokens);
    if (i + 1 == spans.size()) one_pass = one_pass && static_cast<int64_t>(row) == rows;
  }
  at::Tensor q_rot, k_rot;
  if (one_pass) {
    std::vector<int64_t> positions;
    positions.reserve(static_cast<size_t>(rows));
    for (const AttentionSpan& s : spans) {
      for (int64_t r = 0; r < s.tokens; ++r) positions.push_back(s.position + r);
    }
    const at::Tensor at_rows =
        at::tensor(positions, at::TensorOptions().dtype(at::kLong)).to(hn.device());
    const bool lr = long_rope(spans[0]);
    const at::Tensor cos = (lr ? rope.long_cos : rope.cos).index_select(0, at_rows).unsqueeze(1);
    const at::Tensor sin = (lr ? rope.long_sin : rope.sin).index_select(0, at_rows).unsqueeze(1);
    q_rot = RotaryEmbedding(q.view({rows, n_heads, hd}), cos, sin);
    k_rot = RotaryEmbedding(k.view({rows, n_kv, hd}), cos, sin);
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    const AttentionSpan& s = spans[i];
    const int64_t t = s.tokens, p0 = s.position;
    if (one_pass) {
      queries[i] = q_rot.narrow(0, s.row, t);
      new_k[i] = k_rot.narrow(0, s.row, t);
    } else {
      const bool lr = long_rope(s);
      at::Tensor cos = (lr ? rope.long_cos : rope.cos).narrow(0, p0, t).unsqueeze(1);
      at::Tensor sin = (lr ? rope.long_sin : rope.sin).narrow(0, p0, t).unsqueeze(1);
      queries[i] = RotaryEmbedding(q.narrow(0, s.row, t).view({t, n_heads, hd}), cos, sin);
      new_k[i] = RotaryEmbedding(k.narrow(0, s.row, t).view({t, n_kv, hd}), cos, sin);
    }
    new_v[i] = v.narrow(0, s.row, t).view({t, n_kv, hd});
    new_slots[i] = s.slots.narrow(0, p0 - s.first, t);
    read_slots[i] = s.slots;
  }
  at::Tensor gathered_k, gathered_v;
  std::vector<bool> on_host(spans.size(), false);
  if (!spans.empty()) {
    at::Tensor* k_pool = spans[0].k_pool;
    at::Tensor* v_pool = spans[0].v_pool;
    at::Tensor slots = new_slots.size() == 1 ? new_slots[0] : at::cat(new_slots);
    if (one_pass) {
      k_pool->index_copy_(0, slots, k_rot);
      v_pool->index_copy_(0, slots, v.view({rows, n_kv, hd}));
    } else {
      k_pool->index_copy_(0, slots, new_k.size() == 1 ? new_k[0] : at::cat(new_k));
      v_pool->index_copy_(0, slots, new_v.size() == 1 ? new_v[0] : at::cat(new_v));
    }
    // Decode rows run in the host kernel, reading the pool in place; the other spans' positions
    // are gathered in one copy.
    const bool host =
        HostDecodeAttention(*k_pool, *v_pool, hn, w.sinks, spans, queries, scale, &attn, &on_host);
    std::vector<at::Tensor> reads;
    for (size_t i = 0; i < spans.size(); ++i) {
      if (host && on_host[i]) {
        read_at[i + 1] = read_at[i];
        continue;
      }
      reads.push_back(read_slots[i]);
      read_at[i + 1] = read_at[i] + read_slots[i].size(0);
    }
    if (!reads.empty()) {
      at::Tensor rows = reads.size() == 1 ? reads[0] : at::cat(reads);
      gathered_k = k_pool->index_select(0, rows);  // [positions read, KV, hd]
      gathered_v = v_pool->index_select(0, rows);
    }
  }
  const at::ScalarType product = ProductDType(hn);
  for (size_t i = 0; i < spans.size(); ++i) {
    if (on_host[i]) continue;
    const AttentionSpan& s = spans[i];
    const int64_t t = s.tokens, p0 = s.position, len = p0 + t;
    at::Tensor qi = queries[i];
    const int64_t first = s.first, held = len - first;
    // This sequence's positions: [KV, held, hd], in the products' dtype.
    at::Tensor keys = gathered_k.narrow(0, read_at[i], held).permute({1, 0, 2}).to(product);
    at::Tensor values = gathered_v.narrow(0, read_at[i], held).permute({1, 0, 2}).to(product);
    const bool masked = t > 1 || (window > 0 && len > window);
    const int64_t block = QueryBlockRows(n_heads, held, score_budget);
    for (int64_t r0 = 0; r0 < t; r0 += block) {
      const int64_t b = std::min(block, t - r0);
      // Query head qh uses KV head qh / group: [b, KV, group, hd] -> [KV, group * b, hd].
      at::Tensor qg = qi.narrow(0, r0, b)
                          .reshape({b, n_kv, group, hd})
                          .permute({1, 2, 0, 3})
                          .reshape({n_kv, group * b, hd})
                          .to(product);
      at::Tensor scores = at::matmul(qg, keys.transpose(1, 2)) * scale;  // [KV, group*b, held]
      if (masked) {
        // Row r of a group is new token r0 + r % b at position p = p0 + r0 + r % b: it sees the
        // key of position k = first + j (entry j) with k <= p and, with a sliding window,
        // p - k < window.
        const int64_t p = p0 + r0 - first;
        at::Tensor ones =
            at::ones({b, held}, at::TensorOptions().dtype(at::kBool).device(hn.device()));
        at::Tensor mask = ones.triu(p + 1);
        if (window > 0 && len > window) mask = mask.logical_or(ones.tril(p - window));
        scores =
            scores.masked_fill(mask.repeat({group, 1}), -std::numeric_limits<float>::infinity());
      }
      at::Tensor probs;
      if (sinks.defined()) {
        at::Tensor sink_col = sinks.expand({n_kv, group, b, 1}).reshape({n_kv, group * b, 1});
        at::Tensor joined = at::cat({scores.to(at::kFloat), sink_col}, -1);
        probs = at::softmax(joined, -1).narrow(-1, 0, held).to(product);
      } else {
        probs = at::softmax(scores, -1, at::kFloat).to(product);
      }
      at::Tensor o = at::matmul(probs, values);  // [KV, group*b, hd]
      attn.narrow(0, s.row + r0, b)
          .copy_(o.reshape({n_kv, group, b, hd}).permute({2, 0, 1, 3}).reshape({b, n_heads * hd}));
    }
  }
  return BlockLinear(attn, w.wo, row_block, w.bo);
}

namespace {

// mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1 (YaRN).
double YarnMscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

// The eps of MLA's own RMSNorms (q_a_layernorm, kv_a_layernorm): transformers' and DeepSeek's
// RMSNorm default, not the config's rms_norm_eps.
constexpr double kLatentNormEps = 1e-6;

// [.., d] stored as pairs (2i, 2i+1) -> halves (i, i + d/2), as
// transformers' apply_rotary_pos_emb_interleave.
at::Tensor Deinterleave(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  const int64_t d = shape.back();
  std::vector<int64_t> pairs = shape;
  pairs.back() = d / 2;
  pairs.push_back(2);
  return x.reshape(pairs).transpose(-1, -2).reshape(shape);
}

}  // namespace

at::Tensor RotaryInverseFrequencies(const ModelInfo& info, bool long_factors) {
  const int64_t dim = RotaryDim(info);
  const double base = info.rope_theta;
  at::Tensor exponents =
      at::arange(int64_t{0}, dim, int64_t{2}, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  if (info.longrope) {
    // transformers' _compute_longrope_parameters: the factors as a float32 tensor.
    const std::vector<double>& f =
        long_factors ? info.longrope->long_factor : info.longrope->short_factor;
    at::Tensor factors = at::tensor(f, at::kDouble).to(at::kFloat);
    return 1.0 / (factors * at::pow(base, exponents));
  }
  if (!info.yarn) return 1.0 / at::pow(base, exponents);
  const YarnSpec& y = *info.yarn;
  at::Tensor pos_freqs = at::pow(base, exponents);
  at::Tensor extrapolation = 1.0 / pos_freqs;
  at::Tensor interpolation = 1.0 / (y.factor * pos_freqs);
  // The dimension range whose rotations during the original context fall between beta_fast and
  // beta_slow turns: interpolated below it, extrapolated above, a linear ramp between.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(y.original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(base));
  };
  // transformers rounds the ends to whole dims unless rope_scaling says truncate: false.
  const double fast = correction_dim(y.beta_fast), slow = correction_dim(y.beta_slow);
  const double low = std::max(y.truncate ? std::floor(fast) : fast, 0.0);
  double high = std::min(y.truncate ? std::ceil(slow) : slow, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  at::Tensor ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0.0, 1.0);
  at::Tensor extrapolation_factor = 1.0 - ramp;
  return interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

double RotaryAttentionFactor(const ModelInfo& info, bool long_factors) {
  if (info.longrope) return long_factors ? info.longrope->long_mscale : info.longrope->short_mscale;
  if (!info.yarn) return 1.0;
  const YarnSpec& y = *info.yarn;
  return YarnMscale(y.factor, y.mscale) / YarnMscale(y.factor, y.mscale_all_dim);
}

double LatentSoftmaxScale(const ModelInfo& info) {
  const MlaSpec& a = *info.mla;
  double scale = 1.0 / std::sqrt(static_cast<double>(a.qk_nope_head_dim + a.qk_rope_head_dim));
  if (info.yarn && info.yarn->mscale_all_dim > 0) {
    const double m = YarnMscale(info.yarn->factor, info.yarn->mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

at::Tensor LatentAttention(const ModelInfo& info, const MlaWeights& w, const at::Tensor& hn,
                           std::span<const AttentionSpan> spans, const RotaryTables& rope,
                           int64_t row_block, int64_t score_budget) {
  const MlaSpec& a = *info.mla;
  const int64_t n_heads = info.num_attention_heads, rows = hn.size(0);
  const int64_t nope = a.qk_nope_head_dim, rot = a.qk_rope_head_dim, r = a.kv_lora_rank;
  const int64_t vd = a.v_head_dim;
  at::Tensor q =
      w.wq.defined()
          ? BlockLinear(hn, w.wq, row_block)
          : BlockLinear(RmsNorm(BlockLinear(hn, w.wq_a, row_block), w.q_a_norm, kLatentNormEps),
                        w.wq_b, row_block);
  at::Tensor kv = BlockLinear(hn, w.wkv_a, row_block);  // [rows, r + rope]
  at::Tensor latent = RmsNorm(kv.narrow(1, 0, r), w.kv_a_norm, kLatentNormEps);
  at::Tensor k_rot = kv.narrow(1, r, rot);
  q = q.view({rows, n_heads, nope + rot});
  at::Tensor q_nope = q.narrow(2, 0, nope);
  at::Tensor q_rot = q.narrow(2, nope, rot);
  if (a.rope_interleave) {
    q_rot = Deinterleave(q_rot);
    k_rot = Deinterleave(k_rot);
  }
  const double scale = LatentSoftmaxScale(info);
  at::Tensor attn = at::empty({rows, n_heads * vd}, hn.options());
  // Every sequence's new latents and rotary keys written to the pool in one copy, then every
  // position the batch reads gathered in one (MLA reads every position: first is 0).
  std::vector<at::Tensor> queries(spans.size()), new_latent(spans.size()), new_rot(spans.size());
  std::vector<at::Tensor> new_slots(spans.size()), read_slots(spans.size());
  std::vector<int64_t> read_at(spans.size() + 1, 0);
  for (size_t i = 0; i < spans.size(); ++i) {
    const AttentionSpan& s = spans[i];
    const int64_t t = s.tokens, p0 = s.position;
    at::Tensor cos = rope.cos.narrow(0, p0, t);  // [t, rope]
    at::Tensor sin = rope.sin.narrow(0, p0, t);
    at::Tensor qr = q_rot.narrow(0, s.row, t);  // [t, H, rope]
    queries[i] = qr * cos.unsqueeze(1) + RotateHalf(qr) * sin.unsqueeze(1);
    at::Tensor kr = k_rot.narrow(0, s.row, t);  // [t, rope]
    new_rot[i] = (kr * cos + RotateHalf(kr) * sin).unsqueeze(1);
    new_latent[i] = latent.narrow(0, s.row, t).unsqueeze(1);
    new_slots[i] = s.slots.narrow(0, p0 - s.first, t);
    read_slots[i] = s.slots;
  }
  at::Tensor gathered_latents, gathered_rot;
  if (!spans.empty()) {
    at::Tensor slots = at::cat(new_slots);
    spans[0].k_pool->index_copy_(0, slots, at::cat(new_latent));
    spans[0].v_pool->index_copy_(0, slots, at::cat(new_rot));
    at::Tensor reads = at::cat(read_slots);
    gathered_latents = spans[0].k_pool->index_select(0, reads).select(1, 0);  // [read, r]
    gathered_rot = spans[0].v_pool->index_select(0, reads).select(1, 0);      // [read, rope]
  }
  // The products' dtype (ProductDType); the absorbed projections are kept in it (MlaWeights).
  const at::ScalarType product = ProductDType(hn);
  const at::Tensor w_uk = w.w_uk.to(product);
  const at::Tensor w_uv_t = w.w_uv.transpose(1, 2).to(product);
  for (size_t i = 0; i < spans.size(); ++i) {
    const AttentionSpan& s = spans[i];
    const int64_t t = s.tokens, p0 = s.position, len = p0 + t;
    at::Tensor qr = queries[i].to(product);
    at::Tensor latents = gathered_latents.narrow(0, read_at[i], len).to(product);  // [len, r]
    at::Tensor rot_keys = gathered_rot.narrow(0, read_at[i], len).to(product);     // [len, rope]
    const int64_t block = QueryBlockRows(n_heads, len, score_budget);
    for (int64_t r0 = 0; r0 < t; r0 += block) {
      const int64_t b = std::min(block, t - r0);
      // Queries into latent space per head: [H, b, nope] x [H, nope, r] -> [H, b, r].
      at::Tensor q_lat =
          at::matmul(q_nope.narrow(0, s.row + r0, b).permute({1, 0, 2}).to(product), w_uk);
      at::Tensor scores =
          at::matmul(q_lat, latents.t()) + at::matmul(qr.narrow(0, r0, b).permute({1, 0, 2}),
                                                      rot_keys.t());  // [H, b, len]
      scores = scores * scale;
      if (t > 1) {  // New token r0 + i at position p0 + r0 + i sees keys up to it.
        at::Tensor mask =
            at::ones({b, len}, at::TensorOptions().dtype(at::kBool).device(hn.device()))
                .triu(p0 + r0 + 1);
        scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
      }
      at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(product);
      // [H, b, len] x [len, r] -> [H, b, r]; x [H, r, v] -> [H, b, v].
      at::Tensor o = at::matmul(at::matmul(probs, latents), w_uv_t);
      attn.narrow(0, s.row + r0, b).copy_(o.permute({1, 0, 2}).reshape({b, n_heads * vd}));
    }
  }
  return BlockLinear(attn, w.wo, row_block);
}

}  // namespace fmoe
