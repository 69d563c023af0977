#include "common/peer_table.h"

#include <gtest/gtest.h>

namespace fmoe {
namespace {

TEST(PeerTable, PeersExpireAfterTheTimeoutUnlessTouched) {
  ManualClock clock(1000);
  PeerTable<int> table(clock, 300);
  table.Upsert("a", 1);
  table.Upsert("b", 2);
  clock.AdvanceMs(200);
  EXPECT_TRUE(table.Touch("a"));
  EXPECT_FALSE(table.Touch("nobody"));
  clock.AdvanceMs(200);
  EXPECT_TRUE(table.IsAlive("a"));
  EXPECT_FALSE(table.IsAlive("b"));
  auto dead = table.Expire();
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].first, "b");
  EXPECT_EQ(dead[0].second.info, 2);
  EXPECT_EQ(dead[0].second.last_seen_ms, 1000);
  EXPECT_EQ(table.size(), 1u);
  clock.AdvanceMs(301);
  EXPECT_EQ(table.Expire().size(), 1u);
  EXPECT_EQ(table.size(), 0u);
}

TEST(PeerTable, UpsertKeepsFirstSeen) {
  ManualClock clock(5);
  PeerTable<std::string> table(clock, 100);
  table.Upsert("x", "old");
  clock.AdvanceMs(50);
  table.Upsert("x", "new");
  auto* e = table.Find("x");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->info, "new");
  EXPECT_EQ(e->first_seen_ms, 5);
  EXPECT_EQ(e->last_seen_ms, 55);
}

}  // namespace
}  // namespace fmoe
