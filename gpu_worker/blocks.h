// The model runtime's building blocks, one function each, shared by every architecture
// (model_families.h says which a family uses): the batch-invariant linear map, RMSNorm, rotary
// embeddings, grouped-query attention with its variants (q/k/v biases, q/k RMSNorm per head or
// over the whole projection, q/k/v clipping, a sliding window) and the SwiGLU MLP that dense
// layers, shared experts and routed experts compute. Each follows the Hugging Face transformers
// implementation of the families it serves, operation for operation.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/model_config.h"

namespace fmoe {

// y = x w^T (+ b) over fixed blocks of `rows` rows on the CPU: row i of y depends on row i of x
// only, never on how many rows surround it (model.h: batch invariance). x: [M, K] contiguous,
// w: [N, K]; `rows` <= 0 or a non-CPU tensor: one product. `bias` may be undefined.
at::Tensor BlockLinear(const at::Tensor& x, const at::Tensor& w, int64_t rows,
                       const at::Tensor& bias = {});

// transformers' RMSNorm (Mixtral, Qwen, OLMoE): float32 variance over the last dimension, the
// normalised values cast back to x's dtype, then scaled by the weight.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// A SwiGLU MLP: down(silu(gate x) * up x). Dense layers, shared experts and routed experts.
struct MlpWeights {
  at::Tensor gate, up, down;  // [inter, h], [inter, h], [h, inter]
};
at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& down, int64_t row_block);

struct AttentionWeights {
  at::Tensor wq, wk, wv, wo;  // [H*hd, h], [KV*hd, h], [KV*hd, h], [h, H*hd]
  at::Tensor bq, bk, bv, bo;  // Biases, or undefined.
  at::Tensor q_norm, k_norm;  // [hd] per head or [H*hd] / [KV*hd] whole, or undefined.
};

// One sequence's part of a ragged batch: rows [row, row + tokens) of the batch's hidden state,
// at positions [position, position + tokens), with the layer's KV cache tensors
// ([KV, capacity, hd], already large enough).
struct AttentionSpan {
  int64_t row = 0;
  int64_t tokens = 0;
  int64_t position = 0;
  at::Tensor* k_cache = nullptr;
  at::Tensor* v_cache = nullptr;
};

// The rotary tables, [positions, hd] in the compute dtype.
struct RotaryTables {
  at::Tensor cos, sin;
};

// Self-attention of one layer over the normed hidden state `hn` [rows, h]: projections, the
// family's q/k norm and clipping, RoPE, writing each sequence's new keys and values into its
// cache, causal (and windowed) softmax attention per sequence, the output projection.
at::Tensor Attention(const ModelInfo& info, const AttentionWeights& w, const at::Tensor& hn,
                     std::span<const AttentionSpan> spans, const RotaryTables& rope,
                     int64_t row_block);

}  // namespace fmoe
