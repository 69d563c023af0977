#include "gpu_worker/model/cuda_util.h"

namespace fmoe {

bool CudaCompiled() { return false; }

Result<int> CudaDeviceCount() {
  return Unavailable("this build has no CUDA support (configure with FMOE_CUDA=ON and nvcc)");
}

Result<std::string> CudaDeviceDescription(int) { return CudaDeviceCount().status(); }

}  // namespace fmoe
