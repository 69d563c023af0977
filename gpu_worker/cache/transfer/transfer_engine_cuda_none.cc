// NewCudaLink in builds without FMOE_CUDA: the worker's cuda mode reports it at start.
#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe {

Result<std::unique_ptr<TransferEngine>> NewCudaLink(int device_index, const LinkOptions& options) {
  return FailedPrecondition("link: this build has no CUDA (configure with FMOE_CUDA=ON and nvcc)");
}

}  // namespace fmoe
