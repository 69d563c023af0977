// CUDA runtime queries for device selection. Compiled by nvcc (cuda_util.cu) when FMOE_CUDA is
// on; otherwise cuda_util_none.cc reports that the build has no CUDA. The only CUDA-facing
// file outside the transfer engine. Thread-safe.
#pragma once

#include <string>

#include "common/status.h"

namespace fmoe {

// True when this binary was built with FMOE_CUDA.
bool CudaCompiled();
// Devices visible to the CUDA runtime. Error: kUnavailable with the driver's message.
Result<int> CudaDeviceCount();
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)".
Result<std::string> CudaDeviceDescription(int index);

}  // namespace fmoe
