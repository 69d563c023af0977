// cuda:N as a rank resolves it (gpu_worker/device.h), and LibTorch computing there. Label gpu: on
// a machine without a usable GPU every test says "skipped: no GPU" and why (ctest: Skipped).
#include "gpu_worker/device.h"

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "gpu_worker/cuda_util.h"

namespace fmoe {
namespace {

// Empty when cuda:0 can run tensors; otherwise why not.
std::string WhyNoGpu() {
  Result<int> count = CudaDeviceCount();
  if (!count.ok()) return "no GPU (" + count.status().message() + ")";
  if (*count == 0) return "no GPU (the CUDA runtime sees no device)";
  if (!at::hasCUDA()) return "this LibTorch has no CUDA (a GPU is present)";
  return "";
}

#define FMOE_SKIP_WITHOUT_GPU()                           \
  if (const std::string why = WhyNoGpu(); !why.empty()) { \
    GTEST_SKIP() << "skipped: " << why;                   \
  }

TEST(ResolveDevice, CudaZeroDescribesTheGpu) {
  FMOE_SKIP_WITHOUT_GPU();
  Result<DeviceInfo> info = ResolveDevice("cuda:0", 0);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->cuda);
  EXPECT_EQ(info->cuda_index, 0);
  EXPECT_NE(info->description.find("sm_"), std::string::npos) << info->description;
}

TEST(ResolveDevice, AMissingGpuIndexIsRefused) {
  FMOE_SKIP_WITHOUT_GPU();
  Result<DeviceInfo> info = ResolveDevice("cuda:4096", 4096);
  ASSERT_FALSE(info.ok());
  EXPECT_NE(info.status().message().find("CUDA device(s)"), std::string::npos)
      << info.status().ToString();
}

TEST(LibTorchOnCuda, AMatmulMatchesTheCpu) {
  FMOE_SKIP_WITHOUT_GPU();
  at::manual_seed(7);
  const at::Tensor a = at::randn({64, 96});
  const at::Tensor b = at::randn({96, 32});
  const at::Tensor on_cpu = at::matmul(a, b);
  const at::Tensor on_gpu = at::matmul(a.to(at::Device(at::kCUDA, 0)), b.to(at::kCUDA)).cpu();
  // Float32 sums in another order: close, not equal.
  EXPECT_TRUE(at::allclose(on_gpu, on_cpu, /*rtol=*/1e-3, /*atol=*/1e-3))
      << (on_gpu - on_cpu).abs().max().item<float>();
}

}  // namespace
}  // namespace fmoe
