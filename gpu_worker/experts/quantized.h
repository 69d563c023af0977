// Quantized weights' dequantization (DESIGN section 12), with LibTorch operations that run on
// whichever device holds the stored tensors: a routed expert's projections just before its
// product (its native bytes stay in the store, on the link and in the cache), and the dense
// weights once at load. The math is each format's reference dequantization:
//   FP8 block    w = fp8(weight) x weight_scale_inv[r / bo, c / bi]
//   FP8 channel  w = fp8(weight) x weight_scale[r]
//   INT4 (compressed-tensors pack-quantized)
//                w = (q - z) x weight_scale[r, g(c)], q the nibble c % 8 of weight_packed[r, c / 8]
//                less 8, z the same of weight_zero_point packed along the rows (0 if symmetric),
//                g(c) = weight_g_idx[c] when stored, else c / group_size
//   GPTQ         w[r, c] = (q - z) x scales[g(c), r], q the nibble c % 8 of qweight[c / 8, r],
//                z the nibble r % 8 of qzeros[g(c), r / 8] (+ 1 in the v1 layout), g(c) = g_idx[c]
//                when stored, else c / group_size
//   AWQ          as GPTQ with qweight [c, r / 8] and qzeros [c / g, r / 8] packed in AWQ's order
//                (column r % 8 in nibble [0, 4, 1, 5, 2, 6, 3, 7][r % 8]), no offset
// computed in float32, then cast to the compute dtype. Any thread.
#pragma once

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

#include "common/model/quant.h"
#include "common/status.h"
#include "gpu_worker/experts/expert_source.h"

namespace fmoe {

// The LibTorch dtype a stored quantized tensor is held in (F8_E4M3 as bytes: kByte).
// kInvalidArgument for a dtype no format stores.
Result<at::ScalarType> StoredTorchDType(DType dtype);

// The [out, in] shape of a projection from its stored weight tensor.
std::pair<int64_t, int64_t> ProjectionShape(const QuantSpec& spec, const at::Tensor& weight);

// Whether the stored tensors have the format's shapes and dtypes (kInvalidArgument naming the
// tensor otherwise).
Status CheckProjection(const QuantSpec& spec, const at::Tensor& weight,
                       const ProjectionParts& parts);

// One projection's [out, in] float weight in `dtype`, on the stored tensors' device.
// kInvalidArgument when the tensors do not have the format's shapes and dtypes; LibTorch errors
// become kInternal (kResourceExhausted when out of memory).
Result<at::Tensor> DequantizeProjection(const QuantSpec& spec, const at::Tensor& weight,
                                        const ProjectionParts& parts, at::ScalarType dtype);

// The expert with float weights w1, w2, w3 in `dtype` (a float expert is returned as is).
Result<ExpertWeights> DequantizeExpert(const ExpertWeights& w, at::ScalarType dtype);

}  // namespace fmoe
