#include "gpu_worker/experts/dequantize_cuda.h"

namespace fmoe {

bool CudaDequantizeCompiled() { return false; }

Status CudaDequantize(const DequantArgs&) {
  return FailedPrecondition("dequantize: this build has no CUDA kernels (FMOE_CUDA=OFF)");
}

}  // namespace fmoe
