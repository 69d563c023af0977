// The replay's CPU path: the CPU time model and the per-layer split between the link and the CPU,
// on hand-computed layers.
#include "bench/fmoe_bench/replay_hybrid.h"

#include <algorithm>
#include <random>

#include <gtest/gtest.h>

namespace fmoe::bench {
namespace {

constexpr int64_t kMs = 1'000'000;

TEST(CpuModelTest, OffByDefault) {
  CpuModel m;
  EXPECT_FALSE(m.enabled());
  EXPECT_EQ(m.Describe(10 * kMs), "off");
}

TEST(CpuModelTest, FactorIsFlatToTheKneeThenLinearInTheTokens) {
  CpuModel m;
  m.factor = 0.5;
  m.knee_tokens = 16;
  ASSERT_TRUE(m.enabled());
  EXPECT_EQ(m.ExpertNs(1, 10 * kMs), 5 * kMs);  // c x one load.
  EXPECT_EQ(m.ExpertNs(0, 10 * kMs), 5 * kMs);
  EXPECT_EQ(m.ExpertNs(16, 10 * kMs), 5 * kMs);
  EXPECT_EQ(m.ExpertNs(32, 10 * kMs), 10 * kMs);
  EXPECT_EQ(m.ExpertNs(128, 10 * kMs), 40 * kMs);
  m.factor = 1.0;
  EXPECT_EQ(m.ExpertNs(1, 10 * kMs), 10 * kMs);
}

TEST(CpuModelTest, MeasuredCurveIsPiecewiseLinearAndWinsOverTheFactor) {
  auto curve = ParseCpuExpertTimes("1:5000,4:5600,32:12600");
  ASSERT_TRUE(curve.ok()) << curve.status().message();
  CpuModel m;
  m.curve = *curve;
  m.factor = 9;  // Ignored: the curve is set.
  EXPECT_EQ(m.ExpertNs(1, 10 * kMs), 5 * kMs);
  EXPECT_EQ(m.ExpertNs(2, 10 * kMs), 5'200'000);    // 5000 + 600 / 3 us.
  EXPECT_EQ(m.ExpertNs(18, 10 * kMs), 9'100'000);   // Half way from 4 to 32.
  EXPECT_EQ(m.ExpertNs(60, 10 * kMs), 19'600'000);  // The last slope, 250 us per token.
  EXPECT_NE(m.Describe(10 * kMs).find("5.000 ms at 1 tokens"), std::string::npos);
}

TEST(CpuModelTest, RefusesBadTimesByName) {
  EXPECT_FALSE(ParseCpuExpertTimes("").ok());
  EXPECT_FALSE(ParseCpuExpertTimes("1:5000,x").ok());
  auto r = ParseCpuExpertTimes("4:5000,2:6000");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ascend"), std::string::npos);
  r = ParseCpuExpertTimes("1:0");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("> 0"), std::string::npos);
  CpuModel m;
  m.factor = -1;
  EXPECT_FALSE(ValidateCpuModel(m).ok());
  m.factor = 0.5;
  m.knee_tokens = 0.5;
  EXPECT_FALSE(ValidateCpuModel(m).ok());
}

// A decode layer at batch 1 with two misses of one token each: one load takes 10 ms.
TEST(SplitLayerTest, TwoMissesBothGoToTheCpuWhenItIsMuchFaster) {
  // Link only: 20 ms. One on the CPU: max(10, 4) = 10. Both: 8.
  std::vector<MissingExpert> m = {{3, 10 * kMs, 4 * kMs}, {7, 10 * kMs, 4 * kMs}};
  LayerSplit s = SplitLayer(m, 0, 0);
  EXPECT_EQ(s.cpu, (std::vector<uint32_t>{3, 7}));
  EXPECT_EQ(s.link_done_ns, 0);
  EXPECT_EQ(s.cpu_done_ns, 8 * kMs);
  EXPECT_EQ(s.cpu_busy_ns, 8 * kMs);
  EXPECT_EQ(s.ready_ns(), 8 * kMs);
}

TEST(SplitLayerTest, AtHalfALoadOneMissGoesToEachSide) {
  // c = 0.5: one on the CPU gives max(10, 5) = 10, both max(0, 10) = 10: the tie keeps the
  // fewer on the CPU (a loaded expert stays cached); the lower expert goes on equal costs.
  std::vector<MissingExpert> m = {{7, 10 * kMs, 5 * kMs}, {3, 10 * kMs, 5 * kMs}};
  LayerSplit s = SplitLayer(m, 0, 0);
  EXPECT_EQ(s.cpu, (std::vector<uint32_t>{3}));
  EXPECT_EQ(s.link_done_ns, 10 * kMs);
  EXPECT_EQ(s.cpu_done_ns, 5 * kMs);
  EXPECT_EQ(s.ready_ns(), 10 * kMs);
}

TEST(SplitLayerTest, TheLinkWinsWhenTheCpuIsSlowerThanAllTheLoads) {
  // c = 2.5: one on the CPU would take 25 ms, both loads 20.
  std::vector<MissingExpert> m = {{1, 10 * kMs, 25 * kMs}, {2, 10 * kMs, 25 * kMs}};
  LayerSplit s = SplitLayer(m, 0, 0);
  EXPECT_TRUE(s.cpu.empty());
  EXPECT_EQ(s.link_done_ns, 20 * kMs);
  EXPECT_EQ(s.cpu_done_ns, 0);
  EXPECT_EQ(s.ready_ns(), 20 * kMs);
  EXPECT_TRUE(SplitLayer({}, 5 * kMs, 5 * kMs).cpu.empty());
  EXPECT_EQ(SplitLayer({}, 5 * kMs, 5 * kMs).ready_ns(), 0);
}

TEST(SplitLayerTest, AQueueOnEitherSideMovesTheSplit) {
  std::vector<MissingExpert> m = {{1, 10 * kMs, 12 * kMs}, {2, 10 * kMs, 12 * kMs}};
  // Idle: link only 20, one on the CPU max(10, 12) = 12, both 24.
  EXPECT_EQ(SplitLayer(m, 0, 0).cpu.size(), 1u);
  EXPECT_EQ(SplitLayer(m, 0, 0).ready_ns(), 12 * kMs);
  // The link busy for 15 ms more: 35, max(25, 12) = 25, max(0, 24) = 24: both on the CPU.
  LayerSplit busy_link = SplitLayer(m, 15 * kMs, 0);
  EXPECT_EQ(busy_link.cpu.size(), 2u);
  EXPECT_EQ(busy_link.ready_ns(), 24 * kMs);
  // The CPU busy for 30 ms: 20, max(10, 42), max(0, 54): everything over the link.
  LayerSplit busy_cpu = SplitLayer(m, 0, 30 * kMs);
  EXPECT_TRUE(busy_cpu.cpu.empty());
  EXPECT_EQ(busy_cpu.ready_ns(), 20 * kMs);
}

TEST(SplitLayerTest, APrefetchAlmostDoneStaysOnTheLink) {
  // Expert 4's prefetch has 2 ms left; expert 9 needs a whole load. The CPU takes 6 ms each.
  // Link only: 12; 9 on the CPU: max(2, 6) = 6; 4 on the CPU instead: max(10, 6) = 10.
  std::vector<MissingExpert> m = {{4, 2 * kMs, 6 * kMs}, {9, 10 * kMs, 6 * kMs}};
  LayerSplit s = SplitLayer(m, 0, 0);
  EXPECT_EQ(s.cpu, (std::vector<uint32_t>{9}));
  EXPECT_EQ(s.link_done_ns, 2 * kMs);
  EXPECT_EQ(s.ready_ns(), 6 * kMs);
}

TEST(SplitLayerTest, APrefillExpertWithManyTokensPicksTheLink) {
  // c = 0.5, one load 10 ms: a decode token's expert takes 5 ms on the CPU, a prefill expert of
  // 128 tokens 40 ms. The decode misses split; the prefill misses all load.
  CpuModel cpu;
  cpu.factor = 0.5;
  const int64_t load = 10 * kMs;
  std::vector<MissingExpert> decode, prefill;
  for (uint32_t e = 0; e < 3; ++e) {
    decode.push_back({e, load, cpu.ExpertNs(1, load)});
    prefill.push_back({e, load, cpu.ExpertNs(128, load)});
  }
  // Decode: 30 link only; 1 on the CPU max(20, 5); 2: max(10, 10) = 10; 3: 15.
  LayerSplit d = SplitLayer(decode, 0, 0);
  EXPECT_EQ(d.cpu.size(), 2u);
  EXPECT_EQ(d.ready_ns(), 10 * kMs);
  LayerSplit p = SplitLayer(prefill, 0, 0);
  EXPECT_TRUE(p.cpu.empty());
  EXPECT_EQ(p.ready_ns(), 30 * kMs);
  // A mixed batch: the expert with fewest tokens goes to the CPU first.
  std::vector<MissingExpert> mixed = {{0, load, cpu.ExpertNs(128, load)},
                                      {1, load, cpu.ExpertNs(1, load)},
                                      {2, load, cpu.ExpertNs(64, load)}};
  LayerSplit x = SplitLayer(mixed, 0, 0);
  EXPECT_EQ(x.cpu, (std::vector<uint32_t>{1}));  // max(20, 5) against 30, max(10, 25), 65.
  EXPECT_EQ(x.ready_ns(), 20 * kMs);
}

// Every subset of the misses, brute force: the soonest the layer can have them all.
int64_t BestByBruteForce(const std::vector<MissingExpert>& m, int64_t link_free, int64_t cpu_free) {
  int64_t best = -1;
  for (uint32_t mask = 0; mask < (1u << m.size()); ++mask) {
    int64_t link = 0, cpu = 0;
    bool any_link = false, any_cpu = false;
    for (size_t i = 0; i < m.size(); ++i) {
      if (mask & (1u << i)) {
        cpu += m[i].cpu_ns;
        any_cpu = true;
      } else {
        link += m[i].link_ns;
        any_link = true;
      }
    }
    const int64_t t = std::max(any_link ? link_free + link : 0, any_cpu ? cpu_free + cpu : 0);
    if (best < 0 || t < best) best = t;
  }
  return best;
}

TEST(SplitLayerTest, NeverLaterThanTheLinkAloneAndOptimalOnEqualExperts) {
  std::mt19937 rng(18);
  std::uniform_int_distribution<int> count(0, 8), cost(1, 40), queue(0, 30);
  for (int round = 0; round < 2000; ++round) {
    std::vector<MissingExpert> m(count(rng));
    int64_t link_total = 0;
    for (size_t i = 0; i < m.size(); ++i) {
      m[i] = {static_cast<uint32_t>(i), cost(rng) * kMs, cost(rng) * kMs};
      link_total += m[i].link_ns;
    }
    const int64_t link_free = queue(rng) * kMs, cpu_free = queue(rng) * kMs;
    const LayerSplit s = SplitLayer(m, link_free, cpu_free);
    const int64_t link_only = m.empty() ? 0 : link_free + link_total;
    ASSERT_LE(s.ready_ns(), link_only) << "round " << round;
    ASSERT_GE(s.ready_ns(), BestByBruteForce(m, link_free, cpu_free)) << "round " << round;
    ASSERT_TRUE(std::is_sorted(s.cpu.begin(), s.cpu.end()));
    // Equal experts (a decode layer at batch 1, nothing in flight): the split is the best one.
    for (MissingExpert& e : m) e = {e.expert, 10 * kMs, m.empty() ? 0 : m[0].cpu_ns};
    ASSERT_EQ(SplitLayer(m, link_free, cpu_free).ready_ns(),
              BestByBruteForce(m, link_free, cpu_free))
        << "round " << round;
  }
}

}  // namespace
}  // namespace fmoe::bench
