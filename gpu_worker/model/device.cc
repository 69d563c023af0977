#include "gpu_worker/model/device.h"

#include <torch/torch.h>
#include <torch/version.h>

#include "gpu_worker/model/cuda_util.h"

namespace fmoe {

Result<DeviceInfo> ResolveDevice(const std::string& device, int cuda_index, int threads) {
  if (threads > 0) at::set_num_threads(threads);
  DeviceInfo info;
  const std::string torch_version = TORCH_VERSION;
  if (device == "cpu") {
    info.description = "cpu (LibTorch " + torch_version + ", " +
                       std::to_string(at::get_num_threads()) + " intra-op threads, emulated link)";
    return info;
  }
  if (!CudaCompiled()) {
    return FailedPrecondition(device +
                              " requested, but this build has no CUDA support "
                              "(configure with FMOE_CUDA=ON and a CUDA build of LibTorch)");
  }
  if (!torch::cuda::is_available()) {
    return FailedPrecondition(device + " requested, but LibTorch " + torch_version +
                              " was built without CUDA or sees no GPU");
  }
  FMOE_ASSIGN_OR_RETURN(int count, CudaDeviceCount());
  if (cuda_index < 0 || cuda_index >= count) {
    return FailedPrecondition(device + " requested, but this machine has " + std::to_string(count) +
                              " CUDA device(s)");
  }
  FMOE_ASSIGN_OR_RETURN(std::string name, CudaDeviceDescription(cuda_index));
  info.cuda = true;
  info.cuda_index = cuda_index;
  info.description = device + ": " + name + " (LibTorch " + torch_version + ")";
  return info;
}

}  // namespace fmoe
