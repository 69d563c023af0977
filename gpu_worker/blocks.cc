#include "gpu_worker/blocks.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace fmoe {

at::Tensor BlockLinear(const at::Tensor& x, const at::Tensor& w, int64_t rows,
                       const at::Tensor& bias) {
  const int64_t m = x.size(0);
  at::Tensor out;
  if (rows <= 0 || !x.is_cpu() || m == 0) {
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

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down, int64_t row_block) {
  at::Tensor act = at::silu(BlockLinear(x, gate, row_block)) * BlockLinear(x, up, row_block);
  return BlockLinear(act, down, row_block);
}

namespace {

// rotate_half(x) = cat(-x2, x1) over the last dimension.
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

at::Tensor Attention(const ModelInfo& info, const AttentionWeights& w, const at::Tensor& hn,
                     std::span<const AttentionSpan> spans, const RotaryTables& rope,
                     int64_t row_block) {
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
  const int64_t window = info.sliding_window.value_or(0);
  at::Tensor attn = at::empty({rows, n_heads * hd}, hn.options());
  for (const AttentionSpan& s : spans) {
    const int64_t t = s.tokens, p0 = s.position, len = p0 + t;
    at::Tensor cos = rope.cos.narrow(0, p0, t).unsqueeze(1);  // [t, 1, hd]
    at::Tensor sin = rope.sin.narrow(0, p0, t).unsqueeze(1);
    at::Tensor qi = q.narrow(0, s.row, t).view({t, n_heads, hd});
    at::Tensor ki = k.narrow(0, s.row, t).view({t, n_kv, hd});
    at::Tensor vi = v.narrow(0, s.row, t).view({t, n_kv, hd});
    qi = qi * cos + RotateHalf(qi) * sin;
    ki = ki * cos + RotateHalf(ki) * sin;
    s.k_cache->narrow(1, p0, t).copy_(ki.permute({1, 0, 2}));
    s.v_cache->narrow(1, p0, t).copy_(vi.permute({1, 0, 2}));
    at::Tensor keys = s.k_cache->narrow(1, 0, len);  // [KV, len, hd]
    at::Tensor values = s.v_cache->narrow(1, 0, len);
    // Query head qh uses KV head qh / group: [t, KV, group, hd] -> [KV, group * t, hd].
    at::Tensor qg =
        qi.reshape({t, n_kv, group, hd}).permute({1, 2, 0, 3}).reshape({n_kv, group * t, hd});
    at::Tensor scores = at::matmul(qg, keys.transpose(1, 2)) * scale;  // [KV, group*t, len]
    if (t > 1 || (window > 0 && len > window)) {
      // Row r of a group is new token r % t at position p = p0 + r % t: it sees keys k with
      // k <= p and, with a sliding window, p - k < window.
      at::Tensor ones =
          at::ones({t, len}, at::TensorOptions().dtype(at::kBool).device(hn.device()));
      at::Tensor mask = ones.triu(p0 + 1);
      if (window > 0 && len > window) mask = mask.logical_or(ones.tril(p0 - window));
      scores = scores.masked_fill(mask.repeat({group, 1}), -std::numeric_limits<float>::infinity());
    }
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(hn.scalar_type());
    at::Tensor o = at::matmul(probs, values);  // [KV, group*t, hd]
    attn.narrow(0, s.row, t)
        .copy_(o.reshape({n_kv, group, t, hd}).permute({2, 0, 1, 3}).reshape({t, n_heads * hd}));
  }
  return BlockLinear(attn, w.wo, row_block, w.bo);
}

}  // namespace fmoe
