#include "gpu_worker/cache/hybrid_split.h"

#include <gtest/gtest.h>

#include <vector>

namespace fmoe {
namespace {

TEST(HostTimeModel, EstimatesFromTheNearestMeasuredBucket) {
  HostTimeModel m;
  EXPECT_FALSE(m.Estimate(1).has_value());
  m.Record(1, 1000);
  EXPECT_DOUBLE_EQ(*m.Estimate(1), 1000.0);
  // No larger bucket: the 1-token time scaled by the tokens.
  EXPECT_DOUBLE_EQ(*m.Estimate(8), 8000.0);
  m.Record(16, 5000);
  // 4 tokens: bucket 3 unseen, the nearest larger one (16-31 tokens) answers.
  EXPECT_DOUBLE_EQ(*m.Estimate(4), 5000.0);
  EXPECT_DOUBLE_EQ(*m.Estimate(20), 5000.0);
  // A moving average: a new sample moves it by a fifth.
  m.Record(1, 2000);
  EXPECT_DOUBLE_EQ(*m.Estimate(1), 1200.0);
  m.Record(0, 5);   // Ignored.
  m.Record(1, -3);  // Ignored.
  EXPECT_EQ(m.samples(), 3u);
}

TEST(SplitMissing, LoadsEverythingWithoutALinkFigure) {
  HostTimeModel host;
  host.Record(1, 10);
  const std::vector<MissingExpert> missing = {{1, 1}, {2, 1}};
  EXPECT_EQ(SplitMissing(missing, 0.0, 0.0, host), (std::vector<bool>{false, false}));
}

TEST(SplitMissing, MeasuresTheHostOnceOnTheLightestExpert) {
  const std::vector<MissingExpert> missing = {{1, 5}, {2, 1}, {3, 3}};
  HostTimeModel host;
  EXPECT_EQ(SplitMissing(missing, 100.0, 0.0, host), (std::vector<bool>{false, true, false}));
}

TEST(SplitMissing, ProbesABucketTheHostHasNotRun) {
  HostTimeModel host;
  host.Record(8, 400);  // Prefill-sized runs measured, one-token runs not.
  // The 1-token expert is probed on the host (its estimate, 400, counts against the host); the
  // 8-token one: link at 100 vs host at 800 -> link; the 2-token one probes nothing (one probe
  // per layer) and goes by its estimate: link at 200 vs host at 800 -> link.
  const std::vector<MissingExpert> missing = {{1, 8}, {2, 1}, {3, 2}};
  EXPECT_EQ(SplitMissing(missing, 100.0, 0.0, host), (std::vector<bool>{false, true, false}));
  host.Record(1, 50);
  host.Record(2, 60);
  // Every bucket measured: no probe; 8 tokens -> link (100 < 400); 2 tokens: link 200 vs host
  // 60 -> host; 1 token: link 200 vs host 110 -> host.
  EXPECT_EQ(SplitMissing(missing, 100.0, 0.0, host), (std::vector<bool>{false, true, true}));
}

TEST(SplitMissing, ReprobesABucketLongLoadedInstead) {
  HostTimeModel host;
  host.Record(1, 1e9);  // One slow sample.
  const std::vector<MissingExpert> one = {{1, 1}};
  for (uint32_t i = 0; i < HostTimeModel::kReprobeAfter; ++i) {
    ASSERT_EQ(SplitMissing(one, 100.0, 0.0, host), std::vector<bool>{false}) << i;
  }
  EXPECT_TRUE(host.Due(1));
  EXPECT_EQ(SplitMissing(one, 100.0, 0.0, host), std::vector<bool>{true});
  host.Record(1, 10);  // The re-measure: the average moves and the count restarts.
  EXPECT_FALSE(host.Due(1));
}

TEST(SplitMissing, SendsEachExpertWhereItFinishesFirst) {
  HostTimeModel host;
  host.Record(1, 150);  // One token: 150 ns on the host.
  host.Record(8, 1000);
  // Loads take 100 ns each. Heaviest first: the 8-token expert is loaded (100 < 1000); the
  // 1-token ones: link at 200 vs host at 150 -> host; link 200 vs host 300 -> link; link 300 vs
  // host 300 -> tie to the link; link 400 vs host 300 -> host.
  const std::vector<MissingExpert> missing = {{1, 1}, {2, 8}, {3, 1}, {4, 1}, {5, 1}};
  EXPECT_EQ(SplitMissing(missing, 100.0, 0.0, host),
            (std::vector<bool>{true, false, false, false, true}));
  // A link busy for 1000 ns with the layer's loads already on it: even the 8-token expert runs
  // on the host (done at 1000 vs 1100); then link 1100 vs host 1150 -> link; link 1200 vs host
  // 1150 -> host; link 1200 vs host 1300 -> link; link 1300 vs host 1300 -> link.
  EXPECT_EQ(SplitMissing(missing, 100.0, 1000.0, host),
            (std::vector<bool>{false, true, true, false, false}));
  // A host slower than any queue of loads gets nothing.
  HostTimeModel slow;
  slow.Record(1, 1e9);
  slow.Record(8, 1e9);
  EXPECT_EQ(SplitMissing(missing, 100.0, 0.0, slow), std::vector<bool>(5, false));
}

}  // namespace
}  // namespace fmoe
