// The skip of the gpu-labelled LibTorch tests: FMOE_SKIP_WITHOUT_GPU() at the top of a test case
// skips it, saying "skipped: no GPU (why)", unless cuda:0 exists and this LibTorch can use it.
// ctest counts such a run as Skipped (fmoe_add_test's SKIP_REGULAR_EXPRESSION for LABEL gpu).
#pragma once

#include <string>

#include <ATen/Context.h>
#include <gtest/gtest.h>

#include "gpu_worker/model/cuda_util.h"

namespace fmoe {

// Empty when cuda:0 can run tensors; otherwise why not.
inline std::string WhyNoGpu() {
  Result<int> count = CudaDeviceCount();
  if (!count.ok()) return "no GPU (" + count.status().message() + ")";
  if (*count == 0) return "no GPU (the CUDA runtime sees no device)";
  if (!at::hasCUDA()) return "no GPU (this LibTorch has no CUDA; a GPU is present)";
  return "";
}

}  // namespace fmoe

#define FMOE_SKIP_WITHOUT_GPU()                                   \
  if (const std::string why = ::fmoe::WhyNoGpu(); !why.empty()) { \
    GTEST_SKIP() << "skipped: " << why;                           \
  }
