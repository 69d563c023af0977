// The replay's time model: layer compute against the iteration's tokens, one expert's load, the
// presets and the flag parser.
#include "bench/fmoe_bench/replay_time.h"

#include <gtest/gtest.h>

namespace fmoe::bench {
namespace {

TimeModel Model(std::vector<LayerTimePoint> layer) {
  TimeModel m;
  m.name = "test";
  m.layer = std::move(layer);
  m.expert_mb = 1.0;
  m.link_gbps = 1.0;
  m.link_latency_us = 0;
  return m;
}

TEST(TimeModelTest, LayerTimeIsPiecewiseLinearInTheTokens) {
  const TimeModel m = Model({{1, 1.0}, {11, 2.0}, {111, 12.0}});
  EXPECT_EQ(m.LayerNs(1), 1'000'000);
  EXPECT_EQ(m.LayerNs(0), 1'000'000);  // No fewer than one token.
  EXPECT_EQ(m.LayerNs(6), 1'500'000);
  EXPECT_EQ(m.LayerNs(11), 2'000'000);
  EXPECT_EQ(m.LayerNs(61), 7'000'000);
  EXPECT_EQ(m.LayerNs(111), 12'000'000);
  EXPECT_EQ(m.LayerNs(211), 22'000'000);  // Beyond the last point: the last slope.
}

TEST(TimeModelTest, OnePointIsFlatAndTheFirstPointHoldsBelowIt) {
  EXPECT_EQ(Model({{1, 0.5}}).LayerNs(1000), 500'000);
  EXPECT_EQ(Model({{8, 2.0}, {16, 4.0}}).LayerNs(1), 2'000'000);
}

TEST(TimeModelTest, LoadIsLatencyPlusBytesOverBandwidth) {
  TimeModel m = Model({{1, 1.0}});
  m.expert_mb = 64;
  m.link_gbps = 16;
  m.link_latency_us = 10;
  EXPECT_EQ(m.LoadNs(), 4'010'000);
}

TEST(TimeModelTest, PresetsCarryTheirMeasuredAndPublishedFigures) {
  auto dev = TimeModelPreset("dev-vm");
  ASSERT_TRUE(dev.ok());
  EXPECT_TRUE(ValidateTimeModel(*dev).ok());
  EXPECT_EQ(dev->LayerNs(1), 521'000);      // runtime_bench: 4.17 ms over 8 layers.
  EXPECT_EQ(dev->LayerNs(8), 1'218'000);    // 9.74 ms at batch 8.
  EXPECT_EQ(dev->LayerNs(128), 5'302'000);  // 128 tokens at 3,018 tok/s.
  EXPECT_NEAR(static_cast<double>(dev->LoadNs()), 1.3207e6, 1e3);  // 0.30 GB/s + 10 us.
  auto paper = TimeModelPreset("fmoe-paper");
  ASSERT_TRUE(paper.ok());
  EXPECT_TRUE(ValidateTimeModel(*paper).ok());
  EXPECT_EQ(paper->LayerNs(1), 842'000);
  EXPECT_EQ(paper->LayerNs(38), 842'000);
  EXPECT_GT(paper->LayerNs(500), paper->LayerNs(100));
  EXPECT_NEAR(static_cast<double>(paper->LoadNs()) / static_cast<double>(paper->LayerNs(1)), 13.1,
              0.05);
  EXPECT_NE(dev->Describe().find("1.321 ms"), std::string::npos) << dev->Describe();
  // Hybrid execution's default CPU model: the host kernel's measured curve for the dev VM's
  // expert, rising with the tokens; none for the paper's unmeasured host.
  ASSERT_GE(dev->cpu_expert.size(), 2u);
  EXPECT_EQ(dev->cpu_expert_mb, dev->expert_mb);
  for (size_t i = 1; i < dev->cpu_expert.size(); ++i) {
    EXPECT_GT(dev->cpu_expert[i].ms, dev->cpu_expert[i - 1].ms);
  }
  EXPECT_TRUE(paper->cpu_expert.empty());
  TimeModel bad = *dev;
  bad.cpu_expert[1].tokens = 1;
  EXPECT_NE(ValidateTimeModel(bad).message().find("CPU expert time 2"), std::string::npos);
  bad = *dev;
  bad.cpu_expert_mb = 0;
  EXPECT_FALSE(ValidateTimeModel(bad).ok());
  EXPECT_EQ(TimeModelPreset("h100").status().code(), ErrorCode::kInvalidArgument);
}

TEST(TimeModelTest, ParsesLayerTimesAndRefusesBadOnes) {
  auto p = ParseLayerTimes("1:0.5,8:1.25,128:5");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->size(), 3u);
  EXPECT_EQ((*p)[1].tokens, 8);
  EXPECT_EQ((*p)[1].ms, 1.25);
  for (const char* bad : {"", "1", "1:0.5,8", "a:1", "1:0", "8:1,4:2", "0:1", "1:-1", "1:1,1:2"}) {
    EXPECT_EQ(ParseLayerTimes(bad).status().code(), ErrorCode::kInvalidArgument) << bad;
  }
}

TEST(TimeModelTest, ValidationNamesTheBadField) {
  TimeModel m = Model({{1, 1.0}});
  m.link_gbps = 0;
  Status s = ValidateTimeModel(m);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("GB/s"), std::string::npos);
  m = Model({});
  EXPECT_FALSE(ValidateTimeModel(m).ok());
  m = Model({{1, 1.0}});
  m.link_latency_us = -1;
  EXPECT_FALSE(ValidateTimeModel(m).ok());
}

}  // namespace
}  // namespace fmoe::bench
