// Decode attention on the host: one new query row of one sequence against the keys and values of
// the positions it reads, taken in place from the paged KV pool by their pool rows (no gather, no
// per-head matrix products through a BLAS). Grouped-query heads, an attention sink per query head
// (gpt-oss), float32 or bfloat16 (q, pool and output of one type).
// Each output depends only on its own query, keys and values, in one fixed order (scores with the
// GEMM's 16-lane dot product, the softmax sum in 16 lanes and the same tree, values accumulated in
// position order): a sequence's attention is bit-identical alone and inside any batch, and the
// AVX-512, AVX2 and portable code give the same bits. In bfloat16 it rounds where LibTorch's
// expression (matmul -> * scale -> float softmax -> bfloat16 probabilities -> matmul) rounds.
// Stateless and reentrant; callers split the KV heads over their threads.
#pragma once

#include <cstdint>
#include <string_view>

#include "gpu_worker/kernels/cpu_gemm.h"

namespace fmoe {

struct DecodeAttentionProblem {
  const void* q = nullptr;       // [heads, head_dim], rotated; `type`.
  const void* k_pool = nullptr;  // Pool rows of [kv_heads, head_dim] keys, `pool_ld` elements
  const void* v_pool = nullptr;  // apart; values likewise. `type`.
  int64_t pool_ld = 0;
  const int64_t* rows = nullptr;  // The pool row of each position read, in position order.
  int64_t positions = 0;          // >= 1.
  int64_t heads = 0, kv_heads = 0, head_dim = 0;  // heads a multiple of kv_heads.
  float scale = 1.0f;                             // On each score (1 / sqrt(head_dim) usually).
  const float* sinks = nullptr;                   // [heads] gpt-oss's sink logits, or null.
  GemmType type = GemmType::kFloat32;
  void* out = nullptr;  // [heads, head_dim], `type`.
};

// Computes the outputs of the query heads of KV heads [h0, h1). Callers cover [0, kv_heads)
// once, in any split. Scratch comes from a per-thread buffer that is reused from call to call.
void DecodeAttentionHeads(const DecodeAttentionProblem& p, int64_t h0, int64_t h1);

// As DecodeAttentionHeads, on the named code ("avx512", "avx2" or "portable"); false, computing
// nothing, when this CPU does not run it. For tests and benchmarks that compare them.
bool DecodeAttentionHeadsOn(std::string_view isa, const DecodeAttentionProblem& p, int64_t h0,
                            int64_t h1);

// The exponential the kernel's softmax uses (a Cody-Waite reduction and a degree-6 polynomial,
// within 2 ulp of exp for x in [-87, 0]; 0 below -87; x <= 0 only), exposed for its test.
float DecodeAttentionExp(float x);

}  // namespace fmoe
