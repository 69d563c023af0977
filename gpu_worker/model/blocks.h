// The model runtime's building blocks, one function each, shared by every architecture
// (which a family uses is set by its file in common/model/families/, through ModelInfo's flags):
// the batch-invariant linear map, RMSNorm and LayerNorm, rotary embeddings (plain, YaRN, LongRoPE),
// grouped-query attention with its variants (q/k/v biases, q/k RMSNorm per head or over the whole
// projection, q/k/v clipping, a sliding window per layer, gpt-oss's attention sinks), DeepSeek's
// multi-head latent attention with its decoupled (YaRN) RoPE, and the SwiGLU MLP that dense layers,
// shared experts and routed experts compute. Each follows the Hugging Face transformers
// implementation of the families it serves, operation for operation.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/model/model_config.h"

namespace fmoe {

// y = x w^T (+ b), batch-invariant on the CPU when `rows` > 0: row i of y depends on row i of x
// only, never on how many rows surround it (model.h: batch invariance). float32 and bfloat16 run
// the host kernel (gpu_worker/kernels/cpu_gemm.h: invariant by its fixed accumulation order, each
// weight read once per block of rows); other dtypes run LibTorch's product over fixed blocks of
// `rows` rows. x: [M, K] contiguous, w: [N, K]; `rows` <= 0 or a non-CPU tensor: one LibTorch
// product. `bias` may be undefined.
at::Tensor BlockLinear(const at::Tensor& x, const at::Tensor& w, int64_t rows,
                       const at::Tensor& bias = {});

// transformers' RMSNorm (Mixtral, Qwen, OLMoE): float32 variance over the last dimension, the
// normalised values cast back to x's dtype, then scaled by the weight.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// A decoder norm: transformers' nn.LayerNorm over the last dimension with `bias` when
// info.layer_norm (Phi-3.5-MoE), else RmsNorm (bias undefined); eps is info.rms_norm_eps.
at::Tensor DecoderNorm(const ModelInfo& info, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& bias);

// A SwiGLU MLP: down(silu(gate x) * up x). Dense layers, shared experts and routed experts.
struct MlpWeights {
  at::Tensor gate, up, down;  // [inter, h], [inter, h], [h, inter]
};
at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down, int64_t row_block);
// A routed expert's MLP: SwiGlu with the projections' biases (undefined: none) and, with
// limit > 0, gpt-oss's clamp: gate = min(gate x + b, limit), up = clamp(up x + b, -limit, limit),
// down((up + 1) * gate * sigmoid(1.702 gate)) + b (transformers' GptOssExperts).
at::Tensor ExpertGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                     const at::Tensor& down, const at::Tensor& gate_bias, const at::Tensor& up_bias,
                     const at::Tensor& down_bias, double limit, int64_t row_block);

// The MoE block's bookkeeping. On the CPU, for float32 or bfloat16 contiguous matrices, these
// run plain loops instead of LibTorch's operators (an index tensor, a gather, the weights' tensor
// and its cast, a product, a scatter, a sum per slot): a decode step of a small model is mostly
// such operators. Each gives the bits of the LibTorch expression it names, which runs elsewhere.
// x.index_select(0, rows); rows index x's first dimension.
at::Tensor SelectRows(const at::Tensor& x, std::span<const int64_t> rows);
// slots.index_copy_(0, slot_rows, y * weights.to(slots.dtype()).unsqueeze(1)): row j of y,
// weighted by weights[j], becomes row slot_rows[j] of slots ([N, h], y [slot_rows.size(), h]).
void PlaceWeightedRows(const at::Tensor& y, std::span<const int64_t> slot_rows,
                       std::span<const float> weights, at::Tensor& slots);
// zeros([rows, h]) + s[:, 0] + s[:, 1] + ... + s[:, top_k - 1], s = slots.view({rows, top_k, h}),
// each sum rounded to the dtype as LibTorch's rounds it.
at::Tensor SumSlots(const at::Tensor& slots, int64_t rows, int64_t top_k);

struct AttentionWeights {
  at::Tensor wq, wk, wv, wo;  // [H*hd, h], [KV*hd, h], [KV*hd, h], [h, H*hd]
  at::Tensor bq, bk, bv, bo;  // Biases, or undefined.
  at::Tensor q_norm, k_norm;  // [hd] per head or [H*hd] / [KV*hd] whole, or undefined.
  at::Tensor sinks;           // gpt-oss: a logit per query head [H], or undefined.
  int64_t window = 0;         // This layer's sliding window (0: full attention).
};

// One sequence's part of a ragged batch: rows [row, row + tokens) of the batch's hidden state,
// at positions [position, position + tokens), with the layer's two tensors of the paged KV pool
// (kv_pool.h: [pool rows, KV, hd] keys and values; MLA: [pool rows, 1, kv_lora_rank] latents and
// [pool rows, 1, qk_rope_head_dim] rotary keys) and the pool rows of positions [first, position
// + tokens): attention writes the new tokens' entries there and reads those positions (every
// span of one call is in the same layer's pool tensors: one copy writes the batch's new entries,
// one gather reads its positions).
struct AttentionSpan {
  int64_t row = 0;
  int64_t tokens = 0;
  int64_t position = 0;
  at::Tensor* k_pool = nullptr;
  at::Tensor* v_pool = nullptr;
  at::Tensor slots;  // kLong [position + tokens - first]; entry j is position first + j.
  // The first position read: 0, or for a sliding-window layer the first its first new query
  // sees.
  int64_t first = 0;
};

// The rotary tables, [positions, RotaryDim(info)] in the compute dtype (YaRN's attention factor or
// LongRoPE's mscale applied). LongRoPE has two pairs: a sequence whose length after this forward
// (its cached and new tokens) exceeds `long_after` rotates its new queries and keys with the
// long-factor tables, else with the short ones; keys already cached keep their rotation
// (transformers' PhimoeRotaryEmbedding, called with the sequence length of each forward).
struct RotaryTables {
  at::Tensor cos, sin;
  at::Tensor long_cos, long_sin;  // LongRoPE's long factors, or undefined.
  int64_t long_after = 0;         // original_max_position_embeddings; 0 without LongRoPE.
};

// RoPE (rotate_half style) of x [t, heads, hd] by cos and sin [t, 1, rd] on the first rd dims of
// each head, the rest passing through: x * cos + rotate_half(x) * sin. RotaryEmbedding runs it in
// one pass on the host for float32 and bfloat16 (the same bits as the expression, each product
// and the sum rounded to the dtype), RotateExpression always as LibTorch's operators (a GPU, other
// dtypes and layouts take that way too).
at::Tensor RotaryEmbedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor RotateExpression(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// A sequence's queries run in blocks of this many rows, so that a block's scores [heads, rows,
// keys] hold at most `score_budget` elements (at least one row a block): a long prompt's
// prefill never holds its whole [heads, tokens, tokens] score matrix.
int64_t QueryBlockRows(int64_t heads, int64_t keys, int64_t score_budget);

// The dtype attention's score and value products run in, for activations `hn`: on the host
// float32 whatever their dtype (LibTorch's CPU products in bfloat16 or float16 run a scalar loop
// where no vector unit has the type; in float32 they run the BLAS, round once at the end, and hold
// the scores and probabilities unrounded); on a GPU the activations' dtype (its tensor cores).
at::ScalarType ProductDType(const at::Tensor& hn);

// Self-attention of one layer over the normed hidden state `hn` [rows, h]: projections, the
// family's q/k norm and clipping, RoPE, writing each sequence's new keys and values into its
// cache (RoPE on the first RotaryDim(info) dims of each head), causal (and windowed) softmax
// attention per sequence (its queries in blocks:
// QueryBlockRows), the output projection.
at::Tensor Attention(const ModelInfo& info, const AttentionWeights& w, const at::Tensor& hn,
                     std::span<const AttentionSpan> spans, const RotaryTables& rope,
                     int64_t row_block, int64_t score_budget);

// The rotary inverse frequencies [RotaryDim(info) / 2] in float32, as transformers computes them:
// plain RoPE, YaRN's blend of interpolated and extrapolated frequencies (info.yarn), or LongRoPE's
// 1 / (factor_i * theta^(2i / hd)) with its short factors, or its long ones when `long_factors`.
at::Tensor RotaryInverseFrequencies(const ModelInfo& info, bool long_factors = false);
// The factor on the cos and sin tables: YaRN's mscale(factor, mscale) /
// mscale(factor, mscale_all_dim), mscale(s, m) = 0.1 m ln(s) + 1 for s > 1; LongRoPE's
// short_mscale (long_mscale when `long_factors`); 1 for plain RoPE.
double RotaryAttentionFactor(const ModelInfo& info, bool long_factors = false);

// Multi-head latent attention (DeepSeek-V2/V3). kv_b_proj is split per head into its key rows
// (w_uk) and value rows (w_uv), so that attention runs on the cached latents directly: scores
// are (q_nope w_uk) . latent + q_rope . k_rope, the output (probs . latent) w_uv^T. Numerically
// the same map as transformers' expansion into per-head keys and values.
struct MlaWeights {
  at::Tensor wq;                    // [H*(nope+rope), h]; undefined with q LoRA.
  at::Tensor wq_a, q_a_norm, wq_b;  // q LoRA: [rq, h], [rq], [H*(nope+rope), rq].
  at::Tensor wkv_a;                 // kv_a_proj_with_mqa: [r + rope, h].
  at::Tensor kv_a_norm;             // [r]
  at::Tensor w_uk;                  // [H, nope, r]; float32 on the host (the products' dtype)
  at::Tensor w_uv;                  // [H, v, r]; likewise
  at::Tensor wo;                    // [h, H*v]
};

// The softmax scale: (nope + rope)^-1/2, times mscale(factor, mscale_all_dim)^2 with YaRN and
// mscale_all_dim > 0 (DeepSeek's code and transformers' DeepseekV3Attention).
double LatentSoftmaxScale(const ModelInfo& info);

// MLA over the normed hidden state `hn` [rows, h]: the projections, RoPE on the rotary parts
// (de-interleaved first when info.mla->rope_interleave), each sequence's new latents and rotary
// keys appended to its cache, causal softmax attention per sequence (its queries in blocks:
// QueryBlockRows), the output projection.
at::Tensor LatentAttention(const ModelInfo& info, const MlaWeights& w, const at::Tensor& hn,
                           std::span<const AttentionSpan> spans, const RotaryTables& rope,
                           int64_t row_block, int64_t score_budget);

}  // namespace fmoe
