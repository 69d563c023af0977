// The policy factory against the table of names (common/policy_names.h), and the fmoe policy's
// cache (PredictedUsePolicy in cache_policy.cc): eviction by expected next use from the running
// requests' expert frequencies and the map service's directives, with prefills and batches
// counted as what they are.
#include "gpu_worker/cache/policies/cache_policy.h"
#include "gpu_worker/cache/policies/policy_factory.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/policy_names.h"

namespace fmoe {
namespace {

class Control final : public CacheControl {
 public:
  uint32_t num_layers() const override { return 4; }
  uint32_t num_experts() const override { return 4; }
  uint32_t top_k() const override { return 2; }
  uint32_t slots() const override { return 4; }
  bool Owns(uint32_t, uint32_t) const override { return true; }
  uint32_t current_layer() const override { return layer; }
  void Prefetch(uint32_t l, uint32_t e, double priority) override { prefetched.push_back({l, e}); }
  void ClearPrefetches() override {}
  uint32_t layer = 0;
  std::vector<std::pair<uint32_t, uint32_t>> prefetched;
};

// One iteration of request `id` in which every layer routes its single token to `a` and `b`.
void Iterate(CachePolicy& p, Control& c, uint64_t id, uint32_t iteration, uint32_t a, uint32_t b) {
  const SequenceInfo seq{id, iteration, 1};
  p.OnIterationStart({&seq, 1});
  for (uint32_t l = 0; l < 4; ++l) {
    c.layer = l;
    std::vector<uint32_t> experts = {std::min(a, b), std::max(a, b)};
    std::vector<uint32_t> tokens = {1, 1};
    std::vector<uint32_t> counts(4, 0);
    counts[a] = counts[b] = 1;
    p.OnLayerStart(LayerRouting{l, experts, tokens, counts});
    for (uint32_t e : experts) p.OnUse(l, e, true);
    p.OnLayerEnd(l);
  }
  p.OnIterationEnd();
}

TEST(MakePolicyTest, BuildsEveryNameOfTheTable) {
  PolicyOptions options;
  options.future = {{0, {0, 1}}, {1, {2, 3}}};  // The oracle replays a recorded future.
  for (const PolicyName& p : kPolicyNames) {
    auto policy = MakePolicy(p.name, options);
    ASSERT_TRUE(policy.ok()) << p.name << ": " << policy.status().message();
    EXPECT_EQ((*policy)->name(), p.name);
    EXPECT_FALSE(p.description.empty()) << p.name;
    Control c;
    (*policy)->Attach(&c);
  }
}

TEST(MakePolicyTest, AnUnknownNameIsRefusedListingTheTable) {
  auto policy = MakePolicy("belady", PolicyOptions{});
  ASSERT_FALSE(policy.ok());
  EXPECT_EQ(policy.status().code(), ErrorCode::kInvalidArgument);
  const std::string message = policy.status().message();
  EXPECT_NE(message.find("unknown policy \"belady\""), std::string::npos) << message;
  for (const PolicyName& p : kPolicyNames) {
    EXPECT_NE(message.find(std::string(p.name)), std::string::npos) << p.name << ": " << message;
  }
  EXPECT_NE(message.find(PolicyNameList(/*servable_only=*/false)), std::string::npos) << message;
}

TEST(MakePolicyTest, TheTableNamesEachPolicyOnceAndOnlyTheOracleIsReplayOnly) {
  std::vector<std::string_view> names;
  for (const PolicyName& p : kPolicyNames) {
    EXPECT_EQ(std::count(names.begin(), names.end(), p.name), 0) << p.name;
    names.push_back(p.name);
    EXPECT_EQ(p.servable, p.name != "oracle") << p.name;
    EXPECT_EQ(FindPolicyName(p.name), &p);
  }
  EXPECT_EQ(FindPolicyName("belady"), nullptr);
  EXPECT_EQ(PolicyNameList(/*servable_only=*/true).find("oracle"), std::string::npos);
  EXPECT_NE(PolicyHelp(/*servable_only=*/false).find("oracle"), std::string::npos);
}

TEST(FmoePolicyTest, KeepsWhatTheRunningRequestUsesOftenOverWhatItUsedOnceRecently) {
  Control c;
  auto p = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  (*p)->Attach(&c);
  // Request 1 uses experts 0 and 1 for five iterations, then 2 and 3 once.
  for (uint32_t i = 0; i < 5; ++i) Iterate(**p, c, 1, i, 0, 1);
  Iterate(**p, c, 1, 5, 2, 3);
  const SequenceInfo seq{1, 6, 1};
  (**p).OnIterationStart({&seq, 1});
  c.layer = 0;
  // LRU would evict expert 0 of layer 1 (used longer ago) before expert 2; fmoe keeps the
  // request's frequent one.
  EXPECT_GT((*p)->EvictionScore(1, 0), (*p)->EvictionScore(1, 2));
  EXPECT_GT((*p)->EvictionScore(1, 1), (*p)->EvictionScore(1, 3));
  // Both beat an expert the request never used.
  EXPECT_GT((*p)->EvictionScore(1, 2), (*p)->EvictionScore(1, 3) - 1e9);
}

TEST(FmoePolicyTest, ADirectiveForALaterLayerOfThisIterationProtectsAndPrefetches) {
  Control c;
  auto p = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  (*p)->Attach(&c);
  for (uint32_t i = 0; i < 3; ++i) Iterate(**p, c, 7, i, 0, 1);
  const SequenceInfo seq{7, 3, 1};
  (**p).OnIterationStart({&seq, 1});
  c.layer = 0;
  // Experts 2 and 3 of layer 3 were never used: equal scores, until a directive names 3.
  EXPECT_DOUBLE_EQ((*p)->EvictionScore(3, 2), (*p)->EvictionScore(3, 3));
  PrefetchDirective d;
  d.request_id = 7;
  d.iteration = 3;
  d.target_layer = 3;
  d.score = 0.9f;
  d.entries = {{3, 0.45f, 0.15f}};
  (*p)->OnDirective(d);
  EXPECT_GT((*p)->EvictionScore(3, 3), (*p)->EvictionScore(3, 2));
  ASSERT_EQ(c.prefetched.size(), 1u);
  EXPECT_EQ(c.prefetched[0], std::make_pair(3u, 3u));
  // The prediction is for this iteration only.
  (*p)->OnIterationEnd();
  const SequenceInfo next{7, 4, 1};
  (**p).OnIterationStart({&next, 1});
  EXPECT_DOUBLE_EQ((*p)->EvictionScore(3, 2), (*p)->EvictionScore(3, 3));
}

TEST(FmoePolicyTest, ARequestsFrequenciesLeaveWithIt) {
  Control c;
  auto p = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  (*p)->Attach(&c);
  for (uint32_t i = 0; i < 4; ++i) Iterate(**p, c, 1, i, 0, 1);
  const double during = (*p)->EvictionScore(2, 0);
  (*p)->OnRequestEnd(1);
  // A new request: request 1's own counts are gone, only the prior over every request remains,
  // and the new request's frequencies outweigh it after a few iterations.
  for (uint32_t i = 0; i < 4; ++i) Iterate(**p, c, 2, i, 2, 3);
  const SequenceInfo seq{2, 4, 1};
  (**p).OnIterationStart({&seq, 1});
  EXPECT_LT((*p)->EvictionScore(2, 0), during);
  EXPECT_GT((*p)->EvictionScore(2, 2), (*p)->EvictionScore(2, 0));
}

TEST(FmoePolicyTest, WhatTheLastIterationUsedComesBackAtTheMeasuredRepeatRate) {
  Control c;
  auto p = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  (*p)->Attach(&c);
  // Experts 0 and 1 for 15 iterations, then 2 and 3 for 5: nearly every use repeats the
  // previous iteration's experts. Expert 0 is the more frequent in this request; expert 2 was
  // used last time, and the repeat rate (about 0.95) says it comes back first.
  for (uint32_t i = 0; i < 15; ++i) Iterate(**p, c, 1, i, 0, 1);
  for (uint32_t i = 15; i < 20; ++i) Iterate(**p, c, 1, i, 2, 3);
  const SequenceInfo seq{1, 20, 1};
  (**p).OnIterationStart({&seq, 1});
  c.layer = 0;
  EXPECT_GT((*p)->EvictionScore(1, 2), (*p)->EvictionScore(1, 0));
  EXPECT_GT((*p)->EvictionScore(3, 3), (*p)->EvictionScore(3, 1));
}

// Starts an iteration of `seqs` and runs its layers 0..`layers`-1, sequence s using `uses[s]` at
// each of them (with `tokens` of the sequence routed to each).
void StartBatch(CachePolicy& p, Control& c, const std::vector<SequenceInfo>& seqs,
                const std::vector<std::vector<uint32_t>>& uses, uint32_t layers) {
  p.OnIterationStart(seqs);
  for (uint32_t l = 0; l < layers; ++l) {
    c.layer = l;
    std::vector<uint32_t> counts(seqs.size() * 4, 0);
    std::vector<uint32_t> experts, tokens;
    for (uint32_t j = 0; j < 4; ++j) {
      uint32_t sum = 0;
      for (size_t s = 0; s < seqs.size(); ++s) {
        if (std::find(uses[s].begin(), uses[s].end(), j) == uses[s].end()) continue;
        counts[s * 4 + j] = seqs[s].tokens;
        sum += seqs[s].tokens;
      }
      if (sum == 0) continue;
      experts.push_back(j);
      tokens.push_back(sum);
    }
    p.OnLayerStart(LayerRouting{l, experts, tokens, counts});
    for (uint32_t e : experts) p.OnUse(l, e, true);
    if (l + 1 < layers) p.OnLayerEnd(l);
  }
}

// Request 1: a prefill of 8 tokens using every expert, then decode steps using experts 0 and 1.
void PrefillThenDecode(CachePolicy& p, Control& c, uint64_t id, uint32_t steps) {
  StartBatch(p, c, {{id, 0, 8}}, {{0, 1, 2, 3}}, 4);
  p.OnLayerEnd(3);
  p.OnIterationEnd();
  for (uint32_t i = 1; i <= steps; ++i) Iterate(p, c, id, i, 0, 1);
  p.OnRequestEnd(id);
}

TEST(FmoePolicyTest, APromptKeepsMoreOfItsLaterLayersThanADecodeStepWould) {
  // Scan resistance: a prefill of many tokens uses most of every layer, so while it runs, an
  // expert of a later layer is more likely needed soon than while a decode step runs.
  Control c;
  auto prefill = MakePolicy("fmoe", PolicyOptions{});
  auto decode = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(prefill.ok() && decode.ok());
  for (auto* p : {&**prefill, &**decode}) {
    p->Attach(&c);
    PrefillThenDecode(*p, c, 1, 6);
  }
  StartBatch(**prefill, c, {{2, 0, 8}}, {{0, 1, 2, 3}}, 2);
  const double kept_in_prefill = (*prefill)->EvictionScore(3, 2);
  StartBatch(**decode, c, {{2, 0, 1}}, {{0, 1}}, 2);
  const double kept_in_decode = (*decode)->EvictionScore(3, 2);
  EXPECT_GT(kept_in_prefill, kept_in_decode);
}

TEST(FmoePolicyTest, AnIterationThatUsesMoreThanPredictedExpectsItsLaterLayersToFollow) {
  Control c;
  auto wide = MakePolicy("fmoe", PolicyOptions{});
  auto narrow = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(wide.ok() && narrow.ok());
  for (auto* p : {&**wide, &**narrow}) {
    p->Attach(&c);
    PrefillThenDecode(*p, c, 1, 6);
  }
  // The same 8-token prefill; one uses every expert of layers 0 and 1, the other only 0 and 1.
  StartBatch(**wide, c, {{2, 0, 8}}, {{0, 1, 2, 3}}, 2);
  StartBatch(**narrow, c, {{2, 0, 8}}, {{0, 1}}, 2);
  EXPECT_GT((*wide)->EvictionScore(3, 2), (*narrow)->EvictionScore(3, 2));
  EXPECT_GT((*wide)->EvictionScore(2, 3), (*narrow)->EvictionScore(2, 3));
}

TEST(FmoePolicyTest, TheBatchsDirectivesCombineAndARequestsNewerOneReplacesItsOwn) {
  Control c;
  auto p = MakePolicy("fmoe", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  (*p)->Attach(&c);
  for (uint32_t i = 0; i < 3; ++i) Iterate(**p, c, 1, i, 0, 1);
  StartBatch(**p, c, {{1, 3, 1}, {2, 0, 1}}, {{0, 1}, {0, 1}}, 1);
  const auto directive = [](uint64_t request, uint32_t iteration, float p) {
    PrefetchDirective d;
    d.request_id = request;
    d.iteration = iteration;
    d.target_layer = 3;
    d.score = 0.9f;
    d.entries = {{2, p, p / 3}};
    return d;
  };
  (*p)->OnDirective(directive(1, 3, 0.25f));
  const double one = (*p)->EvictionScore(3, 2);
  (*p)->OnDirective(directive(2, 0, 0.25f));
  const double both = (*p)->EvictionScore(3, 2);
  EXPECT_GT(both, one);  // Either request may use it: 1 - (1 - 0.5)^2.
  (*p)->OnDirective(directive(1, 3, 0.05f));
  const double revised = (*p)->EvictionScore(3, 2);
  EXPECT_LT(revised, both);
  EXPECT_GT(revised, (*p)->EvictionScore(3, 3));
}

TEST(FmoePolicyTest, PaperRuleStaysAvailableAsAnAblation) {
  auto p = MakePolicy("fmoe-pfreq", PolicyOptions{});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->name(), "fmoe-pfreq");
  EXPECT_EQ(MakePolicy("fmoe-paper", PolicyOptions{}).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace fmoe
