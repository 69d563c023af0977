// The policy replay: the simulated link's order and timing, and RunReplay's figures on traces
// whose right answers are known.
#include "bench/fmoe_bench/replay_core.h"

#include <algorithm>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "bench/fmoe_bench/sim_link.h"
#include "common/clock.h"
#include "tests/bench/replay_fixtures.h"

namespace fmoe::bench {
namespace {

constexpr int64_t kMs = 1'000'000;

TransferTask Task(uint64_t id, bool on_demand, double priority = 0) {
  TransferTask t;
  t.id = id;
  t.bytes = 100;
  t.on_demand = on_demand;
  t.priority = priority;
  return t;
}

TEST(SimLinkTest, OnDemandFirstThenPrefetchesByPriorityEachTakingItsTime) {
  ManualClock clock(0);
  SimLink link(clock, 10 * kMs);
  link.Submit(Task(1, false, 0.1));
  link.Submit(Task(2, false, 0.9));
  link.Submit(Task(3, true));
  std::vector<TransferDone> done;
  // Task 1 started at once; task 3 (on demand) parked it at t=0 and runs first.
  ASSERT_EQ(link.Wait(&done, std::chrono::milliseconds(0)), 1u);
  EXPECT_EQ(done[0].id, 3u);
  EXPECT_EQ(done[0].end_ns, 10 * kMs);
  EXPECT_EQ(clock.NowNs(), 10 * kMs);
  done.clear();
  ASSERT_EQ(link.Wait(&done, std::chrono::milliseconds(0)), 1u);
  EXPECT_EQ(done[0].id, 2u);  // Higher priority than the parked task 1.
  EXPECT_EQ(done[0].end_ns, 20 * kMs);
  done.clear();
  ASSERT_EQ(link.Wait(&done, std::chrono::milliseconds(0)), 1u);
  EXPECT_EQ(done[0].id, 1u);
  EXPECT_EQ(done[0].start_ns, 0);
  EXPECT_EQ(done[0].end_ns, 30 * kMs);
  EXPECT_EQ(link.stats().preemptions, 1u);
  EXPECT_EQ(link.stats().busy_ns, 30 * kMs);
  done.clear();
  EXPECT_EQ(link.Wait(&done, std::chrono::milliseconds(0)), 0u);  // Nothing in flight.
}

TEST(SimLinkTest, ParkedPrefetchKeepsItsProgressAndCancelReportsPartialBytes) {
  ManualClock clock(0);
  SimLink link(clock, 10 * kMs);
  link.Submit(Task(1, false, 1.0));
  clock.AdvanceNs(4 * kMs);
  link.Submit(Task(2, true));  // Parks task 1 with 4 ms done.
  std::vector<TransferDone> done;
  link.Wait(&done, std::chrono::milliseconds(0));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].end_ns, 14 * kMs);
  done.clear();
  clock.AdvanceNs(3 * kMs);  // t = 17: task 1 has 7 of 10 ms.
  link.Cancel(1);
  ASSERT_EQ(link.Poll(&done), 1u);
  EXPECT_TRUE(done[0].cancelled);
  EXPECT_EQ(done[0].bytes_copied, 70u);
  EXPECT_EQ(link.stats().tasks_cancelled, 1u);
}

TEST(SimLinkTest, PromotedPrefetchOvertakesTheOthers) {
  ManualClock clock(0);
  SimLink link(clock, 10 * kMs);
  link.Submit(Task(1, false, 0.9));
  link.Submit(Task(2, false, 0.1));
  link.Promote(2);  // Parks task 1 at t=0.
  std::vector<TransferDone> done;
  link.Wait(&done, std::chrono::milliseconds(0));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, 2u);
}

ReplayConfig Config(const std::string& policy, double budget) {
  ReplayConfig c;
  c.policy = policy;
  c.budget = budget;
  c.online = true;
  c.layer_ns = 1 * kMs;
  c.load_ns = 5 * kMs;
  return c;
}

TEST(ReplayTest, EveryMissStallsForAWholeLoadWithoutPrefetching) {
  // One layer, four experts, one slot: 0, 1, 0, 1, ... misses every time after the first.
  std::vector<std::vector<std::vector<uint16_t>>> its;
  for (int i = 0; i < 6; ++i) its.push_back({{static_cast<uint16_t>(i % 2)}});
  Trace trace = MakeTrace(1, 4, 1, {its}, {}, 0, "iteration");
  TraceRequests requests = GroupByRequest(trace);
  ReplayConfig c = Config("lru", 0.25);
  c.distance = 1;
  auto r = RunReplay(requests, {}, {0}, c, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, 6u);
  EXPECT_EQ(r->hits, 1u);  // Expert 0 was preloaded.
  EXPECT_EQ(r->misses, 5u);
  EXPECT_EQ(r->on_demand_loads, 5u);
  EXPECT_DOUBLE_EQ(r->stall_ns, 5.0 * 5 * kMs);
  EXPECT_DOUBLE_EQ(r->total_ns, 5.0 * 5 * kMs + 6.0 * kMs);
}

// Random routing of 4 requests x 12 iterations over 6 layers of 8 experts, top-2.
Trace RandomTrace(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::vector<std::vector<uint16_t>>>> reqs(4);
  for (auto& req : reqs) {
    for (int i = 0; i < 12; ++i) {
      std::vector<std::vector<uint16_t>> layers;
      for (int l = 0; l < 6; ++l) {
        uint16_t a = static_cast<uint16_t>(rng() % 8), b = static_cast<uint16_t>(rng() % 7);
        if (b >= a) ++b;
        layers.push_back({std::min(a, b), std::max(a, b)});
      }
      req.push_back(layers);
    }
  }
  return MakeTrace(6, 8, 2, reqs, {}, 0, "iteration");
}

TEST(ReplayTest, AFullBudgetNeverMissesAndTheOracleBeatsLru) {
  Trace trace = RandomTrace(7);
  TraceRequests requests = GroupByRequest(trace);
  for (const char* policy : {"lru", "lfu", "on-demand", "moe-infinity", "fmoe", "oracle"}) {
    auto r = RunReplay(requests, {}, {0, 1, 2, 3}, Config(policy, 1.0), nullptr);
    ASSERT_TRUE(r.ok()) << policy << ": " << r.status().ToString();
    EXPECT_EQ(r->misses, 0u) << policy;
    EXPECT_EQ(r->stall_ns, 0.0) << policy;
    EXPECT_EQ(r->loads, 0u) << policy;
  }
  auto lru = RunReplay(requests, {}, {0, 1, 2, 3}, Config("lru", 0.25), nullptr);
  auto oracle = RunReplay(requests, {}, {0, 1, 2, 3}, Config("oracle", 0.25), nullptr);
  ASSERT_TRUE(lru.ok() && oracle.ok());
  EXPECT_GT(oracle->hit_rate(), lru->hit_rate());
  EXPECT_LT(oracle->stall_ns, lru->stall_ns);
  EXPECT_GT(lru->misses, 0u);
}

TEST(ReplayTest, LruHitRateGrowsWithTheBudget) {
  Trace trace = RandomTrace(11);
  TraceRequests requests = GroupByRequest(trace);
  double last = -1;
  for (double budget : {0.125, 0.25, 0.5, 0.75, 1.0}) {
    auto r = RunReplay(requests, {}, {0, 1, 2, 3}, Config("lru", budget), nullptr);
    ASSERT_TRUE(r.ok());
    EXPECT_GE(r->hit_rate(), last) << budget;
    last = r->hit_rate();
  }
  EXPECT_EQ(last, 1.0);
}

TEST(ReplayTest, TheMapStoreTeachesFmoeToPrefetchARecurringPattern) {
  // Iterations alternate between two routing patterns over 8 layers, 32 distinct experts in
  // all; the cache holds 16, so LRU misses nearly everything. The semantic embedding says which
  // pattern comes: fmoe, warmed on the same patterns, prefetches them in time (loads are faster
  // than a layer here).
  const uint32_t L = 8, J = 8;
  std::vector<std::vector<uint16_t>> a, b;
  for (uint32_t l = 0; l < L; ++l) {
    a.push_back({static_cast<uint16_t>(l % J), static_cast<uint16_t>((l + 1) % J)});
    b.push_back({static_cast<uint16_t>((l + 4) % J), static_cast<uint16_t>((l + 5) % J)});
    std::sort(b.back().begin(), b.back().end());
    std::sort(a.back().begin(), a.back().end());
  }
  std::vector<std::vector<std::vector<std::vector<uint16_t>>>> reqs(6);
  std::vector<std::vector<std::vector<float>>> sems(6);
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (int i = 0; i < 10; ++i) {
      const bool is_a = (i + r) % 2 == 0;
      reqs[r].push_back(is_a ? a : b);
      sems[r].push_back(is_a ? std::vector<float>{1, 0} : std::vector<float>{0, 1});
    }
  }
  Trace trace = MakeTrace(L, J, 2, reqs, sems, 2, "iteration");
  TraceRequests requests = GroupByRequest(trace);
  const std::vector<uint32_t> train = {0, 1, 2}, test = {3, 4, 5};
  ReplayConfig c = Config("fmoe", 0.25);
  c.online = false;
  c.load_ns = kMs / 4;
  c.max_inflight_prefetches = 4;
  auto store = WarmStore(requests, train, 100, c.distance);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->size(), 30u);
  auto fmoe = RunReplay(requests, train, test, c, &*store);
  c.policy = "lru";
  auto lru = RunReplay(requests, train, test, c, nullptr);
  ASSERT_TRUE(fmoe.ok()) << fmoe.status().ToString();
  ASSERT_TRUE(lru.ok());
  EXPECT_GT(fmoe->directives, 0u);
  EXPECT_GT(fmoe->match_score, 0.99);
  EXPECT_GT(fmoe->precision(), 0.9);
  EXPECT_GT(fmoe->hit_rate(), lru->hit_rate() + 0.3)
      << "fmoe " << fmoe->hit_rate() << " lru " << lru->hit_rate();
  EXPECT_LT(fmoe->stall_ns, lru->stall_ns);
  // Online, the store starts empty and learns from the test requests themselves.
  c.policy = "fmoe";
  c.online = true;
  auto online = RunReplay(requests, train, test, c, nullptr);
  ASSERT_TRUE(online.ok());
  EXPECT_GT(online->hit_rate(), lru->hit_rate());
}

TEST(ReplayTest, BadConfigsAreRefused) {
  Trace trace = RandomTrace(3);
  TraceRequests requests = GroupByRequest(trace);
  ReplayConfig c = Config("lru", 0.0);
  EXPECT_EQ(RunReplay(requests, {}, {0}, c, nullptr).status().code(), ErrorCode::kInvalidArgument);
  c = Config("lru", 0.5);
  c.distance = 7;
  EXPECT_EQ(RunReplay(requests, {}, {0}, c, nullptr).status().code(), ErrorCode::kInvalidArgument);
  c = Config("fmoe", 0.5);
  c.online = false;
  EXPECT_EQ(RunReplay(requests, {}, {0}, c, nullptr).status().code(),
            ErrorCode::kInvalidArgument);  // Offline fmoe needs a warmed store.
  EXPECT_EQ(RunReplay(requests, {}, {0}, Config("belady", 0.5), nullptr).status().code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace fmoe::bench
