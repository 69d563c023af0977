// The CPU expert kernel (hybrid execution): a routed SwiGLU expert computed on the host
// from its host copy, out = w2(silu(w1 x) * w3 x), for the few tokens routed to it. A decode
// token's expert is a matrix-vector product bound by host memory bandwidth, so the kernel streams
// each weight row once for every token of the call (AVX2/FMA where the CPU has it), splitting the
// output rows over the intra-op threads (at::parallel_for). Weights float32 or bfloat16, read in
// place, or quantized (DESIGN section 12): FP8 (block or channel scales) and compressed-tensors
// INT4 are read from their stored bytes, each weight decoded in registers for a decode-sized call
// (up to 4 tokens; AVX2/FMA/F16C) or a row at a time into a buffer for more tokens, giving the
// bits the dequantized float weights give; GPTQ and AWQ (stored transposed) are dequantized whole
// first. Accumulation in float32. Each token's row is computed on its own in a fixed order, so a
// token's result does not depend on the others in the call (batch-invariant).
// Any thread; reentrant (uses the intra-op pool).
#pragma once

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "gpu_worker/experts/expert_source.h"

namespace fmoe {

// x: [tokens, hidden] on the CPU (float32 or bfloat16); w: CPU, contiguous, float32 or bfloat16,
// w1/w3 [intermediate, hidden], w2 [hidden, intermediate], or quantized with those projection
// shapes; the projections' biases (w.q[i].bias, where defined) added and `act`'s clamp applied.
// Returns [tokens, hidden] in x's dtype.
// kInvalidArgument for shapes, devices or dtypes it does not take.
Result<at::Tensor> CpuSwiGlu(const at::Tensor& x, const ExpertWeights& w,
                             const ExpertActivation& act = {});

// Whether CpuSwiGlu runs its AVX2/FMA code on this CPU (else the portable loops).
bool CpuSwiGluVectorised();

}  // namespace fmoe
