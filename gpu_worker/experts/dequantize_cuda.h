// The CUDA dequantization kernel (DESIGN section 12): one quantized projection's stored tensors,
// on a CUDA device, into its [out, in] weight in float32, bfloat16 or float16, with the math of
// quantized.h (the same values, rounded once to the output dtype). Torch-free: the caller
// (quantized.cc) passes device pointers it has checked against the format's shapes and dtypes.
// Runs on the legacy default stream, which LibTorch's work on that device is ordered with.
// Without FMOE_CUDA the stand-in reports kFailedPrecondition.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace fmoe {

enum class DequantDType : uint8_t { kF32, kBF16, kF16 };

// The formats of common/model/quant.h's QuantMethod (nvcc compiles this header as C++17, which
// quant.h is not).
enum class DequantFormat : uint8_t { kFp8Block, kFp8Channel, kInt4Packed, kGptq, kAwq };

struct DequantArgs {
  DequantFormat format = DequantFormat::kFp8Block;
  int64_t block_out = 0, block_in = 0;  // kFp8Block.
  int64_t group_size = 0;               // 4-bit formats.
  bool gptq_v2 = false;                 // kGptq: zero points stored as is.
  int64_t out = 0, in = 0;
  const void* weight = nullptr;  // FP8 bytes, or int32 words in the format's layout.
  const void* scale = nullptr;
  DequantDType scale_dtype = DequantDType::kF32;
  int64_t scale_cols = 0;          // The scale tensor's second dimension.
  const int32_t* zero = nullptr;   // Packed zero points, or null.
  const int32_t* g_idx = nullptr;  // Each input column's group, or null.
  int64_t groups = 0;              // 4-bit formats: the number of groups.
  void* dst = nullptr;             // [out, in], contiguous.
  DequantDType dst_dtype = DequantDType::kF32;
};

// Whether this build has the kernel.
bool CudaDequantizeCompiled();
// kInternal naming the CUDA error when the launch fails.
Status CudaDequantize(const DequantArgs& args);

}  // namespace fmoe
