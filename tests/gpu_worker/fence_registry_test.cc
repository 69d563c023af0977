#include "gpu_worker/cache/transfer/fence_registry.h"

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

struct Registry {
  std::vector<int> destroyed;
  FenceRegistry<int> fences{[this](int ev) { destroyed.push_back(ev); }};
};

// The bug this registry fixes: the expert cache names the newest fence in every copy it submits
// until the next fence; a copy that started must not destroy it, or the next copy finds it gone
// and waits for the whole compute stream.
TEST(FenceRegistry, TheNewestFenceOutlivesTheCopiesThatUsedIt) {
  Registry r;
  r.fences.Add(1, 101);
  ASSERT_TRUE(r.fences.Acquire(1));
  int waited = 0;
  EXPECT_TRUE(r.fences.Use(1, [&](int ev) { waited = ev; }));
  EXPECT_EQ(waited, 101);
  EXPECT_TRUE(r.destroyed.empty()) << "the newest fence was destroyed by its first user";
  ASSERT_TRUE(r.fences.Acquire(1)) << "a later copy naming the newest fence found it gone";
  EXPECT_TRUE(r.fences.Use(1, [&](int ev) { waited = ev; }));
  EXPECT_EQ(r.fences.size(), 1u);
}

TEST(FenceRegistry, OlderFencesGoWhenNoPendingCopyNamesThem) {
  Registry r;
  r.fences.Add(1, 101);
  ASSERT_TRUE(r.fences.Acquire(1));  // A copy submitted, not started.
  r.fences.Add(2, 102);              // Fence 1 is pending: kept.
  EXPECT_TRUE(r.destroyed.empty());
  EXPECT_TRUE(r.fences.Use(1, [](int) {}));  // Its last user starts: fence 1 goes.
  EXPECT_EQ(r.destroyed, std::vector<int>{101});
  EXPECT_FALSE(r.fences.Acquire(1));
  r.fences.Add(3, 103);  // Fence 2, unused and no longer the newest, goes.
  EXPECT_EQ(r.destroyed, (std::vector<int>{101, 102}));
  EXPECT_EQ(r.fences.size(), 1u);
}

TEST(FenceRegistry, ACancelledCopyReleasesItsFence) {
  Registry r;
  r.fences.Add(1, 101);
  ASSERT_TRUE(r.fences.Acquire(1));
  ASSERT_TRUE(r.fences.Acquire(1));
  r.fences.Add(2, 102);
  r.fences.Release(1);
  EXPECT_TRUE(r.destroyed.empty()) << "one copy still names fence 1";
  r.fences.Release(1);
  EXPECT_EQ(r.destroyed, std::vector<int>{101});
  r.fences.Release(7);  // Unknown: nothing happens.
  EXPECT_FALSE(r.fences.Use(7, [](int) { ADD_FAILURE() << "waited on a fence that is gone"; }));
}

TEST(FenceRegistry, EveryFenceIsDestroyedOnce) {
  std::vector<int> destroyed;
  {
    FenceRegistry<int> fences([&](int ev) { destroyed.push_back(ev); });
    fences.Add(1, 101);
    fences.Acquire(1);
    fences.Add(2, 102);
    fences.Add(3, 103);
  }
  std::sort(destroyed.begin(), destroyed.end());
  EXPECT_EQ(destroyed, (std::vector<int>{101, 102, 103}));
}

}  // namespace
}  // namespace fmoe
