#include "gpu_worker/experts/cpu_expert.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <string>
#include <utility>

#include "gpu_worker/experts/quantized.h"
#include "gpu_worker/model/blocks.h"
#include "tests/testing/model_fixture.h"

namespace fmoe {
namespace {

// An odd shape: rows and lengths that are not multiples of the kernel's 16-element blocks, the
// 4-token tile or the 32-row grain.
constexpr int64_t kHidden = 72, kInter = 53;

ExpertWeights MakeExpert(at::ScalarType dt) {
  at::manual_seed(7);
  ExpertWeights w;
  w.w1 = (at::randn({kInter, kHidden}) * 0.2).to(dt);
  w.w2 = (at::randn({kHidden, kInter}) * 0.2).to(dt);
  w.w3 = (at::randn({kInter, kHidden}) * 0.2).to(dt);
  return w;
}

TEST(CpuExpert, MatchesSwiGluInFloat32) {
  const ExpertWeights w = MakeExpert(at::kFloat);
  for (int64_t tokens : {1, 3, 4, 5, 33}) {
    at::Tensor x = at::randn({tokens, kHidden});
    Result<at::Tensor> y = CpuSwiGlu(x, w);
    ASSERT_TRUE(y.ok()) << y.status().ToString();
    at::Tensor ref = SwiGlu(x, w.w1, w.w3, w.w2, /*row_block=*/0);
    EXPECT_EQ(y->sizes(), ref.sizes());
    EXPECT_TRUE(at::allclose(*y, ref, 1e-5, 1e-5))
        << "tokens=" << tokens << " max diff " << (*y - ref).abs().max().item<float>();
  }
}

// gpt-oss's experts: the projections' biases and the clamped SwiGLU, as the model's ExpertGlu
// computes them; large weights so that the clamp acts on part of the values.
TEST(CpuExpert, BiasesAndTheClampMatchExpertGlu) {
  ExpertWeights w = MakeExpert(at::kFloat);
  w.w1 = w.w1 * 8;
  w.w3 = w.w3 * 8;
  w.q[0].bias = at::randn({kInter});
  w.q[2].bias = at::randn({kInter});
  w.q[1].bias = at::randn({kHidden});
  const ExpertActivation act{7.0};
  for (int64_t tokens : {1, 4, 9}) {
    at::Tensor x = at::randn({tokens, kHidden});
    Result<at::Tensor> y = CpuSwiGlu(x, w, act);
    ASSERT_TRUE(y.ok()) << y.status().ToString();
    at::Tensor ref = ExpertGlu(x, w.w1, w.w3, w.w2, w.q[0].bias, w.q[2].bias, w.q[1].bias,
                               act.swiglu_limit, /*row_block=*/0);
    EXPECT_TRUE(at::allclose(*y, ref, 1e-4, 1e-4))
        << "tokens=" << tokens << " max diff " << (*y - ref).abs().max().item<float>();
    const at::Tensor gate = at::linear(x, w.w1, w.q[0].bias);
    EXPECT_GT((gate > 7.0).sum().item<int64_t>(), 0) << "the clamp never acts";
    // Without the clamp the result differs: the test would see a kernel that ignores it.
    at::Tensor plain = ExpertGlu(x, w.w1, w.w3, w.w2, w.q[0].bias, w.q[2].bias, w.q[1].bias, 0.0,
                                 /*row_block=*/0);
    EXPECT_FALSE(at::allclose(plain, ref, 1e-3, 1e-3));
  }
  // A bias of the wrong length is refused, not read past.
  w.q[1].bias = at::randn({kHidden - 1});
  Result<at::Tensor> bad = CpuSwiGlu(at::randn({2, kHidden}), w, act);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("a bias of 71 values for a projection of 72 rows"),
            std::string::npos)
      << bad.status().message();
}

TEST(CpuExpert, MatchesSwiGluInBfloat16) {
  const ExpertWeights w = MakeExpert(at::kBFloat16);
  at::Tensor x = at::randn({6, kHidden}).to(at::kBFloat16);
  Result<at::Tensor> y = CpuSwiGlu(x, w);
  ASSERT_TRUE(y.ok()) << y.status().ToString();
  EXPECT_EQ(y->scalar_type(), at::kBFloat16);
  // The reference in float32 over the same bfloat16 values; the kernel accumulates in float32
  // and rounds once at the end.
  at::Tensor ref =
      SwiGlu(x.to(at::kFloat), w.w1.to(at::kFloat), w.w3.to(at::kFloat), w.w2.to(at::kFloat), 0);
  EXPECT_TRUE(at::allclose(y->to(at::kFloat), ref, 1e-2, 1e-2))
      << (y->to(at::kFloat) - ref).abs().max().item<float>();
}

// A token's output does not depend on the other tokens of the call, bit for bit.
TEST(CpuExpert, IsBatchInvariant) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const ExpertWeights w = MakeExpert(dt);
    at::Tensor x = at::randn({9, kHidden}).to(dt);
    Result<at::Tensor> all = CpuSwiGlu(x, w);
    ASSERT_TRUE(all.ok());
    for (int64_t t = 0; t < 9; ++t) {
      Result<at::Tensor> one = CpuSwiGlu(x.narrow(0, t, 1), w);
      ASSERT_TRUE(one.ok());
      EXPECT_TRUE(at::equal(*one, all->narrow(0, t, 1))) << "token " << t << " dtype " << dt;
    }
  }
}

// The kernels split their work with at::parallel_for, which is an inline template: its OpenMP
// backend splits the range only where the calling file was compiled with OpenMP, and otherwise
// runs everything on one thread, silently. The build gives every LibTorch user OpenMP; this
// fails if it stops doing so (two threads take the two halves whatever the cores).
TEST(CpuExpert, TheIntraOpThreadsSplitTheWork) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::vector<int> chunk_thread(2, -1);
  at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) chunk_thread[i] = at::get_thread_num();
  });
  at::set_num_threads(before);
  EXPECT_NE(chunk_thread[0], chunk_thread[1])
      << "at::parallel_for ran both halves on thread " << chunk_thread[0];
}

TEST(CpuExpert, NoTokensGiveAnEmptyResult) {
  Result<at::Tensor> y = CpuSwiGlu(at::empty({0, kHidden}), MakeExpert(at::kFloat));
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->size(0), 0);
}

TEST(CpuExpert, RefusesBadInputs) {
  const ExpertWeights w = MakeExpert(at::kFloat);
  EXPECT_EQ(CpuSwiGlu(at::randn({2, kHidden + 1}), w).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CpuSwiGlu(at::randn({kHidden}), w).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CpuSwiGlu(at::randn({2, kHidden}).to(at::kDouble), w).status().code(),
            ErrorCode::kInvalidArgument);
  ExpertWeights mixed = w;
  mixed.w2 = w.w2.to(at::kBFloat16);
  EXPECT_EQ(CpuSwiGlu(at::randn({2, kHidden}), mixed).status().code(), ErrorCode::kInvalidArgument);
  ExpertWeights strided = w;
  strided.w2 = w.w2.t().contiguous().t();
  EXPECT_EQ(CpuSwiGlu(at::randn({2, kHidden}), strided).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(CpuSwiGlu(at::Tensor(), w).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace fmoe

namespace fmoe {
namespace {

// A quantized expert of a fixture (tests/fixtures/<name>): the first this rank loaded.
ExpertWeights QuantizedExpert(const std::string& fixture) {
  testing::LoadedModel& m = testing::SharedModel(testing::FixtureDir(fixture));
  EXPECT_TRUE(m.info.quant.quantized()) << fixture;
  return m.table.at(0).at(1);
}

// The kernel reading the stored bytes gives what it gives for the dequantized float weights,
// bit for bit (the same row values, the same sums in the same order), for 1 to 40 tokens: the
// fused decode (up to 4 tokens) and the GEMM over decoded rows give the same bits.
void ExpectNativeEqualsDequantized(const ExpertWeights& w, const std::string& what) {
  auto f = DequantizeExpert(w, at::kFloat);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  for (int64_t tokens : {1, 3, 4, 5, 9, 40}) {
    at::manual_seed(tokens);
    const at::Tensor x = at::randn({tokens, f->w1.size(1)});
    auto native = CpuSwiGlu(x, w);
    auto reference = CpuSwiGlu(x, *f);
    ASSERT_TRUE(native.ok()) << what << ": " << native.status().ToString();
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    EXPECT_TRUE(at::equal(*native, *reference)) << what << ", " << tokens << " tokens";
    EXPECT_TRUE(at::isfinite(*native).all().item<bool>()) << what;
  }
}

TEST(CpuExpert, QuantizedExpertsReadFromTheirStoredBytes) {
  for (const char* fixture : {"deepseek-v3-fp8-ref", "qwen3-moe-fp8-channel-ref",
                              "kimi-k2-int4-ref", "mixtral-gptq-ref", "qwen2-moe-awq-ref"}) {
    ExpectNativeEqualsDequantized(QuantizedExpert(fixture), fixture);
  }
  // FP8 block scales in bfloat16 (as newer Qwen FP8 checkpoints store them).
  ExpertWeights bf = QuantizedExpert("deepseek-v3-fp8-ref");
  for (ProjectionParts& p : bf.q) p.scale = p.scale.to(at::kBFloat16);
  ExpectNativeEqualsDequantized(bf, "fp8 block, bfloat16 scales");
  // Asymmetric INT4 with a stored group per column (act order): the kimi expert's weights with
  // random zero points and a random column order of groups.
  ExpertWeights asym = QuantizedExpert("kimi-k2-int4-ref");
  asym.quant.symmetric = false;
  asym.quant.act_order = true;
  at::manual_seed(7);
  for (auto [weight, parts] : {std::pair{&asym.w1, &asym.q[0]}, std::pair{&asym.w2, &asym.q[1]},
                               std::pair{&asym.w3, &asym.q[2]}}) {
    const auto [out, in] = ProjectionShape(asym.quant, *weight);
    const int64_t groups = parts->scale.size(1);
    parts->zero =
        at::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                    {(out + 7) / 8, groups}, at::kInt);
    parts->g_idx = at::randint(0, groups, {in}, at::kInt);
  }
  ExpectNativeEqualsDequantized(asym, "int4 asymmetric act-order");
}

TEST(CpuExpert, RefusesQuantizedExpertsWithBadParts) {
  ExpertWeights w = QuantizedExpert("deepseek-v3-fp8-ref");
  w.q[1].scale = w.q[1].scale.narrow(0, 0, 1);
  auto r = CpuSwiGlu(at::randn({1, w.w1.size(1)}), w);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("weight_scale_inv"), std::string::npos)
      << r.status().ToString();
}

// An MXFP4 expert (gpt-oss, with biases and the clamp): the host kernel's row decoder against the
// LibTorch dequantization (the device's path) followed by the float product.
TEST(CpuExpert, Mxfp4ExpertMatchesItsDequantizedProduct) {
  constexpr int64_t kH = 64, kI = 96;
  at::manual_seed(3);
  ExpertWeights w;
  w.quant.method = QuantMethod::kMxfp4;
  w.quant.group_size = 32;
  w.w1 = at::randint(0, 256, {kI, kH / 2}, at::kByte);
  w.w3 = at::randint(0, 256, {kI, kH / 2}, at::kByte);
  w.w2 = at::randint(0, 256, {kH, kI / 2}, at::kByte);
  w.q[0].scale = at::randint(120, 128, {kI, kH / 32}, at::kByte);
  w.q[2].scale = at::randint(120, 128, {kI, kH / 32}, at::kByte);
  w.q[1].scale = at::randint(120, 128, {kH, kI / 32}, at::kByte);
  w.q[0].bias = at::randn({kI});
  w.q[2].bias = at::randn({kI});
  w.q[1].bias = at::randn({kH});
  const ExpertActivation act{7.0};
  auto f = DequantizeExpert(w, at::kFloat);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  for (int64_t tokens : {1, 5}) {
    at::Tensor x = at::randn({tokens, kH});
    Result<at::Tensor> y = CpuSwiGlu(x, w, act);
    ASSERT_TRUE(y.ok()) << y.status().ToString();
    at::Tensor ref = ExpertGlu(x, f->w1, f->w3, f->w2, f->q[0].bias, f->q[2].bias, f->q[1].bias,
                               act.swiglu_limit, /*row_block=*/0);
    EXPECT_TRUE(at::allclose(*y, ref, 1e-4, 1e-4))
        << "tokens=" << tokens << " max diff " << (*y - ref).abs().max().item<float>();
  }
  // A scale tensor of the wrong shape is refused.
  w.q[1].scale = at::randint(120, 128, {kH, kI / 32 + 1}, at::kByte);
  EXPECT_FALSE(CpuSwiGlu(at::randn({1, kH}), w, act).ok());
}

}  // namespace
}  // namespace fmoe
