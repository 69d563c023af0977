#include "gpu_worker/experts/cpu_expert.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "gpu_worker/model/blocks.h"

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
