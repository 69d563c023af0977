#include "common/model/routing.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

struct Routed {
  std::vector<float> probs;
  std::vector<int32_t> experts;
  std::vector<float> weights;
};

Routed Route(const RoutingSpec& spec, const std::vector<float>& logits) {
  Routed r{std::vector<float>(spec.num_experts), std::vector<int32_t>(spec.top_k),
           std::vector<float>(spec.top_k)};
  Status s = RouteToken(spec, logits, r.probs, r.experts, r.weights);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

TEST(Routing, SoftmaxTopKRenormalised) {
  // Mixtral: softmax over all experts, the two largest, renormalised.
  const RoutingSpec spec{RouterScoring::kSoftmax, 4, 2, true};
  const std::vector<float> logits = {1.0f, 3.0f, 0.0f, 2.0f};
  Routed r = Route(spec, logits);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(r.probs[e], std::exp(logits[e]) / z, 1e-7);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 3}));  // Descending weight.
  const double p1 = std::exp(3.0) / z, p3 = std::exp(2.0) / z;
  EXPECT_NEAR(r.weights[0], p1 / (p1 + p3), 1e-7);
  EXPECT_NEAR(r.weights[1], p3 / (p1 + p3), 1e-7);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0, 1e-7);
}

TEST(Routing, WithoutRenormalisationTheWeightsAreTheProbabilities) {
  // Qwen1.5-MoE and OLMoE (norm_topk_prob false): the top-k probabilities as they are.
  const RoutingSpec spec{RouterScoring::kSoftmax, 6, 3, false};
  Routed r = Route(spec, {0.5f, -1.0f, 2.0f, 2.5f, 0.0f, 1.5f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{3, 2, 5}));
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(r.weights[s], r.probs[r.experts[s]]);
  EXPECT_LT(r.weights[0] + r.weights[1] + r.weights[2], 1.0f);
}

TEST(Routing, TiesGoToTheLowerExpert) {
  const RoutingSpec spec{RouterScoring::kSoftmax, 5, 2, true};
  Routed r = Route(spec, {1.0f, 4.0f, 4.0f, 0.0f, 4.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(r.weights[0], 0.5f);
}

TEST(Routing, LargeLogitsStayFinite) {
  // Max-subtracted: exp never overflows.
  const RoutingSpec spec{RouterScoring::kSoftmax, 3, 1, true};
  Routed r = Route(spec, {1000.0f, 999.0f, -1000.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{0}));
  EXPECT_FLOAT_EQ(r.weights[0], 1.0f);
  for (float p : r.probs) EXPECT_TRUE(std::isfinite(p));
  EXPECT_NEAR(r.probs[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
}

TEST(Routing, NanNeverWins) {
  const RoutingSpec spec{RouterScoring::kSoftmax, 3, 1, false};
  std::vector<float> probs(3);
  std::vector<int32_t> experts(1);
  std::vector<float> weights(1);
  // One NaN logit makes every probability NaN (as torch's softmax): the choice is still an
  // expert in range, and deterministic.
  ASSERT_TRUE(RouteToken(spec, std::vector<float>{NAN, 1.0f, 2.0f}, probs, experts, weights).ok());
  EXPECT_GE(experts[0], 0);
  EXPECT_LT(experts[0], 3);
}

TEST(Routing, ManyTokensRouteRowByRow) {
  const RoutingSpec spec{RouterScoring::kSoftmax, 4, 2, true};
  const std::vector<float> logits = {1, 3, 0, 2, /**/ 5, 0, 0, 4, /**/ 0, 0, 1, 0};
  std::vector<float> probs(12), weights(6);
  std::vector<int32_t> experts(6);
  ASSERT_TRUE(RouteTokens(spec, 3, logits, probs, experts, weights).ok());
  EXPECT_EQ(experts, (std::vector<int32_t>{1, 3, 0, 3, 2, 0}));
  for (size_t r = 0; r < 3; ++r) {
    Routed one =
        Route(spec, std::vector<float>(logits.begin() + 4 * r, logits.begin() + 4 * r + 4));
    EXPECT_EQ(one.weights[0], weights[2 * r]);
    EXPECT_EQ(one.weights[1], weights[2 * r + 1]);
  }
}

TEST(Routing, BadSpecsAndSpansAreRefused) {
  std::vector<float> probs(4), weights(2);
  std::vector<int32_t> experts(2);
  const std::vector<float> logits(4, 0.0f);
  Status s =
      RouteToken(RoutingSpec{RouterScoring::kSoftmax, 4, 5, true}, logits, probs, experts, weights);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("top-k 5 is not in [1, 4]"), std::string::npos) << s.message();
  s = RouteToken(RoutingSpec{RouterScoring::kSoftmax, 0, 0, true}, {}, {}, {}, {});
  EXPECT_NE(s.message().find("number of experts is 0"), std::string::npos) << s.message();
  s = RouteToken(RoutingSpec{RouterScoring::kSoftmax, 4, 2, true}, std::vector<float>(3), probs,
                 experts, weights);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  s = RouteTokens(RoutingSpec{RouterScoring::kSoftmax, 4, 2, true}, 2, logits, probs, experts,
                  weights);
  EXPECT_NE(s.message().find("do not hold 2 tokens"), std::string::npos) << s.message();
  EXPECT_EQ(RoutingSpec({RouterScoring::kSoftmax, 8, 2, false}).Describe(),
            "softmax, top-2 of 8, not renormalised");
}

Routed RouteWithBias(const RoutingSpec& spec, const std::vector<float>& logits,
                     const std::vector<float>& bias) {
  Routed r{std::vector<float>(spec.num_experts), std::vector<int32_t>(spec.top_k),
           std::vector<float>(spec.top_k)};
  Status s = RouteToken(spec, logits, r.probs, r.experts, r.weights, bias);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(Routing, GroupLimitedGreedyKeepsTheBestGroupsByTheirMax) {
  // DeepSeek-V2 group_limited_greedy: 8 experts in 4 groups of 2, one group kept, top-2 inside
  // it, not renormalised, scaled by routed_scaling_factor 2. Unlimited, the top-2 would be
  // experts 2 and 4; group 1 ({2, 3}, max 3.0) beats group 2 ({4, 5}, max 2.95).
  RoutingSpec spec{RouterScoring::kSoftmax, 8, 2, false};
  spec.groups = GroupScoring::kMaxScore;
  spec.num_groups = 4;
  spec.topk_groups = 1;
  spec.scaling = 2.0f;
  const std::vector<float> logits = {0.0f, 0.0f, 3.0f, 2.9f, 2.95f, 0.0f, 1.0f, 0.0f};
  Routed r = Route(spec, logits);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  EXPECT_EQ(r.experts, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r.weights[0], 2.0 * std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(r.weights[1], 2.0 * std::exp(2.9) / z, 1e-6);
  for (size_t e = 0; e < 8; ++e) EXPECT_NEAR(r.probs[e], std::exp(logits[e]) / z, 1e-7);
  // Two groups kept: {2, 3} and {4, 5}; expert 4 now beats expert 3.
  spec.topk_groups = 2;
  EXPECT_EQ(Route(spec, logits).experts, (std::vector<int32_t>{2, 4}));
}

TEST(Routing, NoauxTcPicksGroupsByTheirTopTwoSumAndWeighsUncorrectedScores) {
  // DeepSeek-V3 noaux_tc: sigmoid scores plus the correction bias choose; groups are ranked by
  // the sum of their two best choice scores; the weights are the uncorrected sigmoid scores,
  // renormalised, times routed_scaling_factor 2.5.
  RoutingSpec spec{RouterScoring::kSigmoid, 8, 2, true};
  spec.groups = GroupScoring::kTopTwoSum;
  spec.num_groups = 4;
  spec.topk_groups = 2;
  spec.scaling = 2.5f;
  spec.correction_bias = true;
  const std::vector<float> logits = {3.0f, -3.0f, 1.0f, 0.9f, 0.5f, 0.5f, 2.0f, -2.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.2f, 0.0f, 0.0f, 0.0f, -0.5f, 0.0f};
  // Choice scores: g0 {0.953, 0.047} sums 1.0 (but has the best single expert), g1 {0.931,
  // 0.711} 1.642, g2 {0.622, 0.622} 1.245, g3 {0.381, 0.119} 0.5: g1 and g2 stay. Expert 0
  // (the best score) and expert 6 (second best before its bias) are out.
  Routed r = RouteWithBias(spec, logits, bias);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{2, 3}));
  const double s2 = Sigmoid(1.0), s3 = Sigmoid(0.9);
  EXPECT_NEAR(r.weights[0], 2.5 * s2 / (s2 + s3), 1e-6);
  EXPECT_NEAR(r.weights[1], 2.5 * s3 / (s2 + s3), 1e-6);
  // The map's distribution: the uncorrected scores over their sum.
  double total = 0;
  for (float l : logits) total += Sigmoid(l);
  for (size_t e = 0; e < 8; ++e) EXPECT_NEAR(r.probs[e], Sigmoid(logits[e]) / total, 1e-7);
  // Ranked by their best expert instead, group 0 would stay and expert 0 win.
  spec.groups = GroupScoring::kMaxScore;
  EXPECT_EQ(RouteWithBias(spec, logits, bias).experts[0], 0);
}

TEST(Routing, GreedySigmoidWithoutGroupsOrderedByChoiceScore) {
  // The bias reorders the choice (expert 1 overtakes expert 0), not the weights.
  RoutingSpec spec{RouterScoring::kSigmoid, 3, 2, false};
  spec.correction_bias = true;
  Routed r = RouteWithBias(spec, {2.0f, 1.0f, -1.0f}, {0.0f, 0.5f, 0.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 0}));
  EXPECT_NEAR(r.weights[0], Sigmoid(1.0), 1e-7);
  EXPECT_NEAR(r.weights[1], Sigmoid(2.0), 1e-7);
}

TEST(Routing, BadGroupsAreRefused) {
  std::vector<float> probs(6), weights(2);
  std::vector<int32_t> experts(2);
  const std::vector<float> logits(6, 0.0f);
  RoutingSpec spec{RouterScoring::kSoftmax, 6, 2, false};
  spec.groups = GroupScoring::kMaxScore;
  spec.num_groups = 4;
  Status s = RouteToken(spec, logits, probs, experts, weights);
  EXPECT_NE(s.message().find("n_group 4 does not divide the 6 experts"), std::string::npos)
      << s.message();
  spec.num_groups = 3;
  spec.topk_groups = 4;
  s = RouteToken(spec, logits, probs, experts, weights);
  EXPECT_NE(s.message().find("topk_group 4 is not in [1, 3]"), std::string::npos) << s.message();
  spec.topk_groups = 1;
  spec.groups = GroupScoring::kTopTwoSum;
  spec.num_groups = 6;
  s = RouteToken(spec, logits, probs, experts, weights);
  EXPECT_NE(s.message().find("at least 2 experts per group"), std::string::npos) << s.message();
  // A bias the spec does not expect, or a missing one, is a size error.
  spec.groups = GroupScoring::kNone;
  s = RouteToken(spec, logits, probs, experts, weights, logits);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  spec.correction_bias = true;
  s = RouteToken(spec, logits, probs, experts, weights);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  spec.correction_bias = false;
  spec.scaling = 0.0f;
  s = RouteToken(spec, logits, probs, experts, weights);
  EXPECT_NE(s.message().find("routed_scaling_factor"), std::string::npos) << s.message();
}

// Phi-3.5-MoE's sparsemixer at inference, against values worked out by hand (router_jitter_noise
// 0.01: a logit s stays in an expert's softmax while (top - s) / max(|s|, top) <= 0.02).
RoutingSpec SparseMixerSpec(uint32_t experts) {
  RoutingSpec spec{RouterScoring::kSparseMixer, experts, 2, false};
  spec.jitter_eps = 0.01f;
  return spec;
}

TEST(Routing, SparseMixerWeighsEachPickByItsMaskedSoftmax) {
  // First pick: expert 1 (3.0); 2.99 is within 0.01 / 3 of it and stays, 1.0 and -1.0 are masked:
  // softmax(3.0, 2.99)[0] = 1 / (1 + e^-0.01). Second pick: expert 2 (2.99), alone once expert 1
  // is removed (1.99 / 2.99 and 3.99 / 2.99 are far): weight 1. Not renormalised.
  Routed r = Route(SparseMixerSpec(4), {1.0f, 3.0f, 2.99f, -1.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-0.01)), 1e-6);
  EXPECT_FLOAT_EQ(r.weights[1], 1.0f);
  // probs: the plain softmax of the logits.
  double z = 0;
  for (double l : {1.0, 3.0, 2.99, -1.0}) z += std::exp(l);
  EXPECT_NEAR(r.probs[1], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(r.probs[3], std::exp(-1.0) / z, 1e-7);
}

TEST(Routing, SparseMixerKeepsNearLogitsInBothRounds) {
  // 4.0, 3.98 and 3.97 are within 0.02 of the top relatively (0.02 / 4, 0.03 / 4): the first
  // weight is 1 / (1 + e^-0.02 + e^-0.03). The second round (top 3.98, expert 0 removed) keeps
  // 3.97: 1 / (1 + e^-0.01). 0.0 is masked in both.
  Routed r = Route(SparseMixerSpec(4), {4.0f, 3.98f, 3.97f, 0.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-0.02) + std::exp(-0.03)), 1e-6);
  EXPECT_NEAR(r.weights[1], 1.0 / (1.0 + std::exp(-0.01)), 1e-6);
}

TEST(Routing, SparseMixerWithNegativeLogitsDividesByTheirMagnitude) {
  // top -1.0: max(|s|, top) = |s|; -1.01 is 0.01 / 1.01 below, kept; -5.0 is 4 / 5 below, masked.
  Routed r = Route(SparseMixerSpec(3), {-1.0f, -1.01f, -5.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-0.01)), 1e-6);
  EXPECT_FLOAT_EQ(r.weights[1], 1.0f);
}

TEST(Routing, SparseMixerFarApartGivesWeightOneEach) {
  Routed r = Route(SparseMixerSpec(4), {0.5f, 2.0f, -0.3f, 1.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(r.weights[0], 1.0f);
  EXPECT_FLOAT_EQ(r.weights[1], 1.0f);
  // A zero threshold keeps only the top logit (and its equals) in each round.
  RoutingSpec exact = SparseMixerSpec(4);
  exact.jitter_eps = 0.0f;
  r = Route(exact, {4.0f, 3.98f, 4.0f, 0.0f});
  EXPECT_EQ(r.experts, (std::vector<int32_t>{0, 2}));  // Ties: the lower index first.
  EXPECT_FLOAT_EQ(r.weights[0], 0.5f);                 // 4.0 and 4.0 share the first softmax.
  EXPECT_FLOAT_EQ(r.weights[1], 1.0f);
}

TEST(Routing, SparseMixerSpecsAreChecked) {
  RoutingSpec spec = SparseMixerSpec(4);
  spec.top_k = 3;
  EXPECT_NE(spec.Validate().message().find("sparsemixer routes to 2 experts, not 3"),
            std::string::npos);
  spec = SparseMixerSpec(4);
  spec.normalize_topk = true;
  EXPECT_EQ(spec.Validate().code(), ErrorCode::kInvalidArgument);
  spec = SparseMixerSpec(4);
  spec.jitter_eps = -1.0f;
  EXPECT_NE(spec.Validate().message().find("router_jitter_noise"), std::string::npos);
  EXPECT_EQ(SparseMixerSpec(16).Describe(),
            "sparsemixer (router_jitter_noise 0.010000), top-2 of 16, not renormalised");
}

// gpt-oss: the top-2 of the logits, weighted by a softmax over those two alone; the maps record
// the softmax over all.
TEST(Routing, SoftmaxOverTheChosenLogits) {
  RoutingSpec spec{RouterScoring::kSoftmaxTopK, 4, 2, false};
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 1.5f};
  Routed r = Route(spec, logits);
  EXPECT_EQ(r.experts, (std::vector<int32_t>{2, 3}));
  const double e2 = std::exp(2.0), e3 = std::exp(1.5);
  EXPECT_NEAR(r.weights[0], e2 / (e2 + e3), 1e-7);
  EXPECT_NEAR(r.weights[1], e3 / (e2 + e3), 1e-7);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(r.probs[e], std::exp(logits[e]) / z, 1e-7);
  EXPECT_NE(spec.Describe().find("softmax over the chosen"), std::string::npos);
  // Huge logits stay finite (max-subtracted), and the spec takes no groups, bias or scaling.
  Routed big = Route(spec, {1e30f, 0.0f, 1e30f, -1e30f});
  EXPECT_NEAR(big.weights[0], 0.5, 1e-7);
  spec.scaling = 2.0f;
  EXPECT_FALSE(spec.Validate().ok());
  spec.scaling = 1.0f;
  spec.correction_bias = true;
  EXPECT_FALSE(spec.Validate().ok());
}

}  // namespace
}  // namespace fmoe
