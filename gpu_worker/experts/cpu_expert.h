// The CPU expert kernel (hybrid execution): a routed SwiGLU expert computed on the host
// from its host copy, out = w2(silu(w1 x) * w3 x), for the tokens routed to it. Its products run
// on the host GEMM (gpu_worker/kernels/cpu_gemm.h) over chunks of output rows split across the
// intra-op threads (at::parallel_for): a decode token streams each weight once, a prefill-sized
// miss reads each weight once per block of tokens. Weights float32 or bfloat16, read in place, or
// quantized (DESIGN section 12): FP8 (block or channel scales) and compressed-tensors INT4 are read
// from their stored bytes, each weight decoded in registers for a decode-sized call (up to 4
// tokens; AVX2/FMA/F16C, in the GEMM's order) or a chunk of rows at a time into a buffer for the
// GEMM, giving the bits the dequantized float weights give; MXFP4 is decoded by rows; GPTQ and AWQ
// (stored transposed) are dequantized whole first. Accumulation in float32 in the GEMM's fixed
// order, so a token's result does not depend on the others in the call (batch-invariant) and
// equals what the runtime's own float products give for the same weights.
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
