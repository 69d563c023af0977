#include <cuda_runtime.h>

#include <cstdio>

#include "gpu_worker/model/cuda_util.h"

namespace fmoe {

bool CudaCompiled() { return true; }

Result<int> CudaDeviceCount() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // Clear the sticky error for later calls.
    return Unavailable(std::string("CUDA: ") + cudaGetErrorString(err));
  }
  return count;
}

Result<std::string> CudaDeviceDescription(int index) {
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, index);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Unavailable("CUDA device " + std::to_string(index) + ": " + cudaGetErrorString(err));
  }
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                prop.totalGlobalMem / double(1ull << 30));
  return std::string(buf);
}

}  // namespace fmoe
