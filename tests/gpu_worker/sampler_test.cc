#include "gpu_worker/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

SamplingParams Params(float temperature, float top_p = 1.0f, int32_t top_k = 0, uint64_t seed = 7) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.seed = seed;
  return p;
}

TEST(Sampler, GreedyTakesHighestLowestIdOnTies) {
  Sampler s(Params(0.0f));
  EXPECT_EQ(s.Sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>{3.0f}), 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(s.Sample(std::vector<float>{nan, -5.0f, nan}), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  Sampler s(Params(1.5f, 1.0f, 1));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s.Sample(std::vector<float>{0.0f, 0.5f, 0.4f}), 1);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDiffers) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(i * 1.7));
  auto run = [&](uint64_t seed) {
    Sampler s(Params(1.0f, 1.0f, 0, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(logits));
    return out;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  // logits log(1), log(2), log(3), log(4): probabilities 0.1 .. 0.4.
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  Sampler s(Params(1.0f));
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(counts[t] / double(n), 0.1 * (t + 1), 0.01) << t;
}

TEST(Sampler, TemperatureSharpens) {
  std::vector<float> logits = {0.0f, 1.0f};
  Sampler cold(Params(0.1f)), hot(Params(10.0f));
  int cold_ones = 0, hot_ones = 0;
  for (int i = 0; i < 2000; ++i) {
    cold_ones += cold.Sample(logits);
    hot_ones += hot.Sample(logits);
  }
  EXPECT_GT(cold_ones, 1990);
  EXPECT_LT(hot_ones, 1200);
}

TEST(Sampler, TopKKeepsOnlyTheKHighest) {
  std::vector<float> logits = {5.0f, 4.9f, 4.8f, 0.0f, 4.95f};
  Sampler s(Params(5.0f, 1.0f, 2));
  for (int i = 0; i < 500; ++i) {
    int32_t t = s.Sample(logits);
    EXPECT_TRUE(t == 0 || t == 4) << t;
  }
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}; 0.8 keeps {0, 1} too (0.8 is
  // reached exactly); 0.81 adds token 2.
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  for (auto [top_p, allowed] : std::vector<std::pair<float, int>>{{0.75f, 2}, {0.81f, 3}}) {
    Sampler s(Params(1.0f, top_p));
    std::map<int32_t, int> counts;
    for (int i = 0; i < 3000; ++i) ++counts[s.Sample(logits)];
    EXPECT_EQ(static_cast<int>(counts.size()), allowed) << top_p;
    EXPECT_EQ(counts.count(3), 0u);
  }
  Sampler tiny(Params(1.0f, 0.01f));
  for (int i = 0; i < 100; ++i) EXPECT_EQ(tiny.Sample(logits), 0);
}

TEST(Sampler, ValidatesParameters) {
  EXPECT_TRUE(ValidateSampling(Params(0.7f, 0.9f, 40), 100).ok());
  struct Case {
    SamplingParams p;
    const char* message;
  } cases[] = {
      {Params(-1.0f), "sampling.temperature: -1 is not >= 0"},
      {Params(std::numeric_limits<float>::infinity()), "sampling.temperature: inf is not >= 0"},
      {Params(1.0f, 0.0f), "sampling.top_p: 0 is not in (0, 1]"},
      {Params(1.0f, 1.5f), "sampling.top_p: 1.5 is not in (0, 1]"},
      {Params(1.0f, 1.0f, -3), "sampling.top_k: -3 is negative"},
  };
  for (const auto& c : cases) {
    Status s = ValidateSampling(c.p, 100);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(s.message(), c.message);
  }
  SamplingParams p;
  p.max_tokens = 0;
  EXPECT_EQ(ValidateSampling(p, 100).message(), "sampling.max_tokens: must be at least 1");
  p.max_tokens = 4;
  p.stop_token_ids = {3, 100};
  EXPECT_EQ(ValidateSampling(p, 100).message(),
            "sampling.stop_token_ids: 100 is not a token id (vocab 100)");
}

}  // namespace
}  // namespace fmoe
