// cuda:N as a rank resolves it (gpu_worker/model/device.h), and LibTorch computing there. Label
// gpu: on a machine without a usable GPU every test says "skipped: no GPU" and why (ctest:
// Skipped).
#include "gpu_worker/model/device.h"

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/gpu_worker/gpu_skip.h"

namespace fmoe {
namespace {

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
