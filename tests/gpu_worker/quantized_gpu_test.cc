// The CUDA dequantization kernel (gpu_worker/experts/dequantize_cuda.h) on cuda:0 against the
// reference dequantization of tests/fixtures/quant-kernels (every format and variant), in
// float32, bfloat16 and float16. (cached_experts_gpu_test runs quantized fixtures through the
// CUDA link and this kernel.) Label gpu: "skipped: no GPU" without one.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/checkpoint.h"
#include "gpu_worker/experts/dequantize_cuda.h"
#include "gpu_worker/experts/quantized.h"
#include "gpu_worker/model/tensor_loader.h"
#include "tests/gpu_worker/gpu_skip.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;

const std::string kDir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/quant-kernels";

TEST(QuantizedGpu, TheKernelDequantizesEveryFormatAsItsReference) {
  FMOE_SKIP_WITHOUT_GPU();
  ASSERT_TRUE(CudaDequantizeCompiled()) << "a GPU machine's build compiles the kernel";
  const fs::path dir = fs::temp_directory_path() / ("fmoe-qgpu-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(kDir + "/kernels.safetensors", dir / "model.safetensors");
  auto ckpt = Checkpoint::Open(dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::ifstream in(kDir + "/cases.json");
  const nlohmann::json cases = nlohmann::json::parse(in);
  const at::Device cuda(at::kCUDA, 0);
  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    QuantSpec spec;
    ASSERT_TRUE(ParseQuantizationConfig(c["quantization_config"], &spec).ok());
    const int64_t out = c["out"], in_cols = c["in"];
    TensorLoader loader(**ckpt, at::kFloat, at::kCPU, {});
    loader.set_quant(spec);
    at::Tensor weight;
    ProjectionParts parts;
    ASSERT_TRUE(loader.LoadQuantized(name + ".", out, in_cols, &weight, &parts).ok());
    auto ref = loader.Load(name + ".dequantized", {out, in_cols});
    ASSERT_TRUE(ref.ok());
    weight = weight.to(cuda);
    for (at::Tensor* t : {&parts.scale, &parts.zero, &parts.g_idx}) {
      if (t->defined()) *t = t->to(cuda);
    }
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      auto w = DequantizeProjection(spec, weight, parts, dtype);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      ASSERT_TRUE(w->is_cuda());
      EXPECT_TRUE(at::equal(w->cpu(), ref->to(dtype))) << c10::toString(dtype);
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fmoe
