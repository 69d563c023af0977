// Resolves the manifest's device string into a device the worker can run on, checking it
// against this build (CUDA compiled?) and this machine (GPU present?), and configures LibTorch's
// threads. The model runtime and the transfer engine take the result. Call once at start.
#pragma once

#include <string>

#include "common/status.h"

namespace fmoe {

struct DeviceInfo {
  bool cuda = false;
  int cuda_index = -1;
  std::string description;  // "cpu (LibTorch 1.13.1, 2 intra-op threads, emulated link)".
};

// device: "cpu" or "cuda:N". threads > 0 sets LibTorch's intra-op threads (0 keeps its
// default). Errors are kFailedPrecondition and say what is missing.
Result<DeviceInfo> ResolveDevice(const std::string& device, int cuda_index, int threads = 0);

}  // namespace fmoe
