#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "gpu_worker/experts/dequantize_cuda.h"

namespace fmoe {
namespace {

__device__ float Fp8E4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) {
    v = __int_as_float(0x7fc00000);  // NaN
  } else if (e == 0) {
    v = static_cast<float>(m) * (1.0f / 512.0f);
  } else {
    v = static_cast<float>(8 + m) * exp2f(static_cast<float>(e - 10));
  }
  return (b & 0x80) ? -v : v;
}

__device__ float Load(const void* p, DequantDType dtype, int64_t i) {
  switch (dtype) {
    case DequantDType::kF32:
      return static_cast<const float*>(p)[i];
    case DequantDType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DequantDType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
  return 0.0f;
}

__device__ void Store(void* p, DequantDType dtype, int64_t i, float v) {
  switch (dtype) {
    case DequantDType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DequantDType::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case DequantDType::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
  }
}

__device__ int Nibble(int32_t word, int k) { return (word >> (4 * k)) & 15; }

// AWQ packs columns [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7.
__device__ int AwqNibble(int column) {
  constexpr int kPosition[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  return kPosition[column];
}

// One output element per thread, grid-stride.
__global__ void DequantizeKernel(DequantArgs a) {
  const int64_t total = a.out * a.in;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.in, c = i % a.in;
    float v = 0.0f;
    switch (a.format) {
      case DequantFormat::kFp8Block: {
        const float q = Fp8E4m3(static_cast<const uint8_t*>(a.weight)[i]);
        v = q * Load(a.scale, a.scale_dtype, (r / a.block_out) * a.scale_cols + c / a.block_in);
        break;
      }
      case DequantFormat::kFp8Channel:
        v = Fp8E4m3(static_cast<const uint8_t*>(a.weight)[i]) * Load(a.scale, a.scale_dtype, r);
        break;
      case DequantFormat::kInt4Packed: {
        const int32_t* w = static_cast<const int32_t*>(a.weight);
        const int64_t g = a.g_idx != nullptr ? a.g_idx[c] : c / a.group_size;
        const float q = static_cast<float>(Nibble(w[r * (a.in / 8) + c / 8], c % 8) - 8);
        const float z = a.zero != nullptr
                            ? static_cast<float>(Nibble(a.zero[(r / 8) * a.groups + g], r % 8) - 8)
                            : 0.0f;
        v = (q - z) * Load(a.scale, a.scale_dtype, r * a.groups + g);
        break;
      }
      case DequantFormat::kGptq: {
        const int32_t* w = static_cast<const int32_t*>(a.weight);
        const int64_t g = a.g_idx != nullptr ? a.g_idx[c] : c / a.group_size;
        const int q = Nibble(w[(c / 8) * a.out + r], c % 8);
        const int z = Nibble(a.zero[g * (a.out / 8) + r / 8], r % 8) + (a.gptq_v2 ? 0 : 1);
        v = static_cast<float>(q - z) * Load(a.scale, a.scale_dtype, g * a.out + r);
        break;
      }
      case DequantFormat::kAwq: {
        const int32_t* w = static_cast<const int32_t*>(a.weight);
        const int64_t g = c / a.group_size;
        const int q = Nibble(w[c * (a.out / 8) + r / 8], AwqNibble(r % 8));
        const int z = Nibble(a.zero[g * (a.out / 8) + r / 8], AwqNibble(r % 8));
        v = static_cast<float>(q - z) * Load(a.scale, a.scale_dtype, g * a.out + r);
        break;
      }
    }
    Store(a.dst, a.dst_dtype, i, v);
  }
}

}  // namespace

bool CudaDequantizeCompiled() { return true; }

Status CudaDequantize(const DequantArgs& args) {
  const int64_t total = args.out * args.in;
  if (total == 0) return Status::Ok();
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 16);
  DequantizeKernel<<<static_cast<unsigned>(blocks), kThreads>>>(args);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return Internal(std::string("dequantize: CUDA kernel launch: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace fmoe
