// The replay's disk tier: the simulated host cache and disk in front of the simulated link
// (sim_tier.h) on hand-made cases, and the serving replay with it (replay_serve.h).
#include "bench/fmoe_bench/sim_tier.h"

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "bench/fmoe_bench/format.h"
#include "bench/fmoe_bench/replay_report.h"
#include "bench/fmoe_bench/replay_serve.h"
#include "tests/bench/replay_fixtures.h"

namespace fmoe::bench {
namespace {

constexpr int64_t kUs = 1'000;
constexpr int64_t kMs = 1'000'000;
constexpr int64_t kCopyNs = 500 * kUs;

// 8 experts of 1 MB; the disk moves 1 byte/ns (1 MB: 1 ms) after 100 us: a read alone takes
// 1.1 ms; a copy 0.5 ms.
SimTierOptions Options(uint32_t host_slots, bool warm, uint32_t queue_depth = 8) {
  SimTierOptions o;
  o.experts = 8;
  o.host_slots = host_slots;
  o.expert_bytes = 1e6;
  o.disk.host_budget = 1;
  o.disk.gbps = 1;
  o.disk.latency_us = 100;
  o.disk.queue_depth = queue_depth;
  o.disk.warm = warm;
  return o;
}

TransferTask Task(uint64_t id, uint32_t key, bool on_demand) {
  TransferTask t;
  t.id = id;
  t.key = key;
  t.bytes = 64;
  t.on_demand = on_demand;
  return t;
}

struct Tier {
  explicit Tier(const SimTierOptions& o) {
    auto t = SimTieredLink::Create(clock, kCopyNs, o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    link = std::move(*t);
  }
  // Waits for the next finished task (the clock advances to it).
  TransferDone Next() {
    std::vector<TransferDone> out;
    while (out.empty()) {
      if (link->Wait(&out, std::chrono::milliseconds(100)) == 0 && out.empty()) {
        ADD_FAILURE() << "nothing to wait for";
        return {};
      }
    }
    EXPECT_EQ(out.size(), 1u);
    EXPECT_TRUE(link->CheckInvariants().ok()) << link->CheckInvariants().ToString();
    return out[0];
  }
  void AdvanceTo(int64_t ns) { clock.AdvanceNs(ns - clock.NowNs()); }
  ManualClock clock{0};
  std::unique_ptr<SimTieredLink> link;
};

TEST(SimTieredLinkTest, AnAbsentExpertTakesLatencyPlusBytesOverBandwidthThenTheCopy) {
  Tier t(Options(2, /*warm=*/true));  // Experts 0 and 1 in host memory.
  t.link->Submit(Task(1, 5, /*on_demand=*/true));
  const TransferDone d = t.Next();
  EXPECT_EQ(d.id, 1u);
  EXPECT_TRUE(d.status.ok());
  EXPECT_FALSE(d.cancelled);
  EXPECT_EQ(d.end_ns, 1100 * kUs + kCopyNs);
  EXPECT_EQ(d.start_ns, 0);  // The read's start: the cache's load time sees the disk.
  EXPECT_EQ(t.clock.NowNs(), d.end_ns);
  const SimTierStats& s = t.link->tier_stats();
  EXPECT_EQ(s.loads, 1u);
  EXPECT_EQ(s.host_hits, 0u);
  EXPECT_EQ(s.disk_reads, 1u);
  EXPECT_DOUBLE_EQ(s.bytes_read, 1e6);
  // The compute waited 1.6 ms: 1.1 of it for the read, the rest for the copy.
  EXPECT_EQ(s.disk_stall_ns, 1100 * kUs);
  EXPECT_TRUE(t.link->Resident(5));
}

TEST(SimTieredLinkTest, AHostResidentExpertTakesOnlyTheCopy) {
  Tier t(Options(2, /*warm=*/true));
  t.link->Submit(Task(1, 1, /*on_demand=*/true));
  const TransferDone d = t.Next();
  EXPECT_EQ(d.start_ns, 0);
  EXPECT_EQ(d.end_ns, kCopyNs);
  EXPECT_EQ(t.link->tier_stats().host_hits, 1u);
  EXPECT_EQ(t.link->tier_stats().disk_reads, 0u);
  EXPECT_EQ(t.link->tier_stats().disk_stall_ns, 0);
  EXPECT_DOUBLE_EQ(t.link->tier_stats().host_hit_rate(), 1.0);
}

TEST(SimTieredLinkTest, ReadsInFlightShareTheBandwidth) {
  Tier t(Options(4, /*warm=*/false));
  t.link->Submit(Task(1, 2, true));
  t.link->Submit(Task(2, 3, true));
  // Both read at half the bandwidth: 100 us + 2 ms; then the copies one after the other.
  EXPECT_EQ(t.Next().end_ns, 2100 * kUs + kCopyNs);
  EXPECT_EQ(t.Next().end_ns, 2100 * kUs + 2 * kCopyNs);
}

TEST(SimTieredLinkTest, UrgentReadsGoBeforeHintedOnes) {
  Tier t(Options(4, /*warm=*/false, /*queue_depth=*/1));
  t.link->Hint(5, -1);  // On the disk at once.
  t.link->Hint(6, -1);  // Waits for the disk.
  EXPECT_EQ(t.link->reads_in_flight(), 1u);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 2u);
  t.link->Submit(Task(1, 7, /*on_demand=*/true));
  // 7 overtakes 6: read after 5 (1.1 ms), its own read (2.2 ms), the copy.
  const TransferDone d = t.Next();
  EXPECT_EQ(d.end_ns, 2200 * kUs + kCopyNs);
  EXPECT_FALSE(t.link->Resident(6));
  t.AdvanceTo(3300 * kUs);
  std::vector<TransferDone> out;
  t.link->Poll(&out);
  EXPECT_TRUE(t.link->Resident(6));
  EXPECT_EQ(t.link->tier_stats().disk_reads, 3u);
}

TEST(SimTieredLinkTest, PromoteMakesAWaitingReadUrgent) {
  Tier t(Options(4, /*warm=*/false, /*queue_depth=*/1));
  t.link->Submit(Task(1, 4, /*on_demand=*/false));  // On the disk.
  t.link->Submit(Task(2, 5, /*on_demand=*/false));  // Waits.
  t.link->Submit(Task(3, 6, /*on_demand=*/true));   // Overtakes 5.
  t.link->Promote(2);                               // 5 urgent, and older than 6.
  TransferDone d = t.Next();
  EXPECT_EQ(d.id, 1u);
  EXPECT_EQ(d.end_ns, 1100 * kUs + kCopyNs);
  d = t.Next();
  EXPECT_EQ(d.id, 2u);
  EXPECT_EQ(d.end_ns, 2200 * kUs + kCopyNs);
  d = t.Next();
  EXPECT_EQ(d.id, 3u);
  EXPECT_EQ(d.end_ns, 3300 * kUs + kCopyNs);
}

TEST(SimTieredLinkTest, CancelWhileReadingFinishesAtOnceAndTheReadGoesOn) {
  Tier t(Options(2, /*warm=*/false));
  t.link->Submit(Task(1, 5, /*on_demand=*/false));
  t.AdvanceTo(300 * kUs);
  t.link->Cancel(1);
  std::vector<TransferDone> out;
  t.link->Poll(&out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].cancelled);
  EXPECT_EQ(out[0].end_ns, 300 * kUs);
  EXPECT_EQ(out[0].bytes_copied, 0u);
  EXPECT_FALSE(t.link->Resident(5));
  // Nothing is waited for: Wait returns at once and the clock stays.
  out.clear();
  EXPECT_EQ(t.link->Wait(&out, std::chrono::milliseconds(100)), 0u);
  EXPECT_EQ(t.clock.NowNs(), 300 * kUs);
  t.AdvanceTo(1100 * kUs);
  t.link->Poll(&out);
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(t.link->Resident(5));
  // Now a host hit.
  t.link->Submit(Task(2, 5, true));
  EXPECT_EQ(t.Next().end_ns, 1100 * kUs + kCopyNs);
  EXPECT_EQ(t.link->tier_stats().host_hits, 1u);
  EXPECT_EQ(t.link->tier_stats().disk_reads, 1u);
}

TEST(SimTieredLinkTest, EvictsTheLowestScoreThenTheLeastRecentlyUsed) {
  Tier t(Options(3, /*warm=*/true));  // 0, 1, 2 resident, used in that order.
  t.link->set_score([](uint32_t key) { return key == 1 ? 0.0 : 1.0; });
  t.link->Submit(Task(1, 0, true));  // Uses 0 again: 2 is now the least recently used.
  t.Next();
  t.link->Submit(Task(2, 5, true));  // Evicts 1 (lowest score).
  t.Next();
  EXPECT_FALSE(t.link->Resident(1));
  EXPECT_TRUE(t.link->Resident(0) && t.link->Resident(2) && t.link->Resident(5));
  t.link->Submit(Task(3, 6, true));  // Scores tie: evicts 2 (LRU).
  t.Next();
  EXPECT_FALSE(t.link->Resident(2));
  EXPECT_TRUE(t.link->Resident(0) && t.link->Resident(5) && t.link->Resident(6));
  EXPECT_EQ(t.link->tier_stats().evictions, 2u);
  EXPECT_EQ(t.link->resident(), 3u);
}

// The tier's own score (DiskModel::Score::kLoads): the expert it served fewest loads goes first,
// whatever the policy's score says; ties by recency.
TEST(SimTieredLinkTest, ItsOwnScoreEvictsTheExpertLoadedLeast) {
  SimTierOptions o = Options(3, /*warm=*/true);  // 0, 1, 2 resident, used in that order.
  o.disk.score = DiskModel::Score::kLoads;
  Tier t(o);
  t.link->set_score([](uint32_t key) { return key == 0 ? 0.0 : 1.0; });  // Not used.
  for (uint64_t id = 1; id <= 2; ++id) {
    t.link->Submit(Task(id, 0, true));  // 0 twice, then 1 and 2 once each: 1 is the oldest.
    t.Next();
  }
  t.link->Submit(Task(3, 1, true));
  t.Next();
  t.link->Submit(Task(4, 2, true));
  t.Next();
  t.link->Submit(Task(5, 5, true));  // Evicts 1: one load, least recent among the ones.
  t.Next();
  EXPECT_FALSE(t.link->Resident(1));
  EXPECT_TRUE(t.link->Resident(0) && t.link->Resident(2) && t.link->Resident(5));
  t.link->Submit(Task(6, 6, true));  // 2 and 5 have one load each: 2 is older.
  t.Next();
  EXPECT_FALSE(t.link->Resident(2));
  EXPECT_TRUE(t.link->Resident(0) && t.link->Resident(5) && t.link->Resident(6));
}

TEST(SimTieredLinkTest, TheHostBudgetHoldsAndACopyingExpertIsNotEvicted) {
  Tier t(Options(1, /*warm=*/true));  // Expert 0 only.
  t.link->Submit(Task(1, 0, true));   // Copying: pinned.
  t.link->Submit(Task(2, 3, true));   // No slot until 0's copy ends.
  TransferDone d = t.Next();
  EXPECT_EQ(d.id, 1u);
  EXPECT_EQ(d.end_ns, kCopyNs);
  d = t.Next();
  EXPECT_EQ(d.id, 2u);
  EXPECT_EQ(d.end_ns, kCopyNs + 1100 * kUs + kCopyNs);
  EXPECT_EQ(d.start_ns, 0);
  EXPECT_EQ(t.link->resident(), 1u);
  EXPECT_TRUE(t.link->Resident(3));
  // A hint never evicts an expert scoring as high as itself, and starts no read then.
  t.link->Hint(4, -1);
  EXPECT_EQ(t.link->reads_in_flight(), 0u);
  t.link->set_score([](uint32_t key) { return key == 4 ? 2.0 : 1.0; });
  t.link->Hint(4, -1);
  EXPECT_EQ(t.link->reads_in_flight(), 1u);
  EXPECT_FALSE(t.link->Resident(3));
  EXPECT_TRUE(t.link->CheckInvariants().ok());
}

TEST(SimTieredLinkTest, HintedReadsAreBounded) {
  SimTierOptions o = Options(8, /*warm=*/false);
  o.disk.max_hinted_reads = 4;
  Tier t(o);
  for (uint32_t key = 0; key < 6; ++key) t.link->Hint(key, -1);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 4u);
  t.AdvanceTo(10 * kMs);
  std::vector<TransferDone> out;
  t.link->Poll(&out);
  t.link->Hint(4, -1);  // The first four are read: room again.
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 5u);
}

TEST(SimTieredLinkTest, AHintedReadDoesNotStartWhileAnUrgentReadWaits) {
  Tier t(Options(4, /*warm=*/false));
  t.link->Submit(Task(1, 7, /*on_demand=*/true));
  EXPECT_EQ(t.link->urgent_pending(), 1u);
  t.link->Hint(5, -1);  // Would share the disk with 7's read: not read.
  EXPECT_EQ(t.link->reads_in_flight(), 1u);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 0u);
  EXPECT_EQ(t.link->tier_stats().hints_yielded, 1u);
  // 7's read alone: 1.1 ms, then the copy.
  EXPECT_EQ(t.Next().end_ns, 1100 * kUs + kCopyNs);
  EXPECT_EQ(t.link->urgent_pending(), 0u);
  t.link->Hint(5, -1);  // The disk is spare now.
  EXPECT_EQ(t.link->reads_in_flight(), 1u);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 1u);
  // A prefetch's read (not on demand) does not hold hints back.
  t.link->Submit(Task(2, 8, /*on_demand=*/false));
  t.link->Hint(6, -1);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 2u);
  EXPECT_TRUE(t.link->CheckInvariants().ok()) << t.link->CheckInvariants().ToString();
}

TEST(SimTieredLinkTest, AHintWhoseUseComesBeforeTheReadWouldEndIsNotRead) {
  Tier t(Options(4, /*warm=*/false));
  EXPECT_EQ(t.link->read_ns_mean(), 0.0);
  t.link->Hint(5, 1);  // Nothing measured yet: read.
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 1u);
  t.AdvanceTo(2 * kMs);
  std::vector<TransferDone> out;
  t.link->Poll(&out);
  EXPECT_DOUBLE_EQ(t.link->read_ns_mean(), 1100.0 * kUs);  // 100 us + 1 MB at 1 GB/s.
  t.link->Hint(6, 1000 * kUs);                             // Used before its read would end.
  EXPECT_EQ(t.link->tier_stats().hints_late, 1u);
  EXPECT_EQ(t.link->reads_in_flight(), 0u);
  t.link->Hint(6, 1200 * kUs);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 2u);
  // Behind one hinted read: it needs two reads' time.
  t.link->Hint(7, 2100 * kUs);
  EXPECT_EQ(t.link->tier_stats().hints_late, 2u);
  t.link->Hint(7, 2200 * kUs);
  EXPECT_EQ(t.link->tier_stats().hinted_reads, 3u);
  EXPECT_TRUE(t.link->CheckInvariants().ok()) << t.link->CheckInvariants().ToString();
}

TEST(SimTieredLinkTest, BadOptionsAreRefused) {
  ManualClock clock(0);
  SimTierOptions o = Options(0, true);
  EXPECT_FALSE(SimTieredLink::Create(clock, kCopyNs, o).ok());
  o = Options(9, true);
  EXPECT_FALSE(SimTieredLink::Create(clock, kCopyNs, o).ok());
  o = Options(2, true);
  o.disk.gbps = 0;
  EXPECT_FALSE(SimTieredLink::Create(clock, kCopyNs, o).ok());
  o = Options(2, true);
  EXPECT_FALSE(SimTieredLink::Create(clock, 0, o).ok());
}

// ---- the serving replay with the tier ----

using Routing = std::vector<std::vector<std::vector<std::vector<uint16_t>>>>;

// Random prompts over 4 layers of 8 experts, top-2.
Trace RandomPrompts(uint32_t seed, int requests) {
  std::mt19937 rng(seed);
  Routing r(requests);
  for (auto& req : r) {
    const int positions = 2 + static_cast<int>(rng() % 8);
    for (int p = 0; p < positions; ++p) {
      std::vector<std::vector<uint16_t>> layers;
      for (int l = 0; l < 4; ++l) {
        uint16_t a = static_cast<uint16_t>(rng() % 8), b = static_cast<uint16_t>(rng() % 7);
        if (b >= a) ++b;
        layers.push_back({std::min(a, b), std::max(a, b)});
      }
      req.push_back(layers);
    }
  }
  return MakeTrace(4, 8, 2, r, {}, 0, "prompt token position");
}

struct Fixture {
  Fixture() : trace(RandomPrompts(11, 16)), grouped(GroupByRequest(trace)) {
    ServeWorkloadOptions o;
    o.kind = TraceKind::kPromptPositions;
    o.decode_share = 0.5;
    auto w = BuildServeWorkload(grouped, o);
    EXPECT_TRUE(w.ok());
    workload = std::move(*w);
    auto s = WarmServeStore(workload, train, 100, 1);
    EXPECT_TRUE(s.ok());
    store = std::move(*s);
  }
  Result<ServeResult> Run(const std::string& policy, double host_budget, DiskModel disk = {}) {
    ServeConfig c;
    c.policy = policy;
    c.budget = 0.25;
    c.distance = 1;
    c.online = false;
    c.max_batch = 4;
    c.time.name = "test";
    c.time.layer = {{1, 1.0}, {2, 1.1}};
    c.time.expert_mb = 1;
    c.time.link_gbps = 1.0 / 3;  // 3 ms a copy.
    c.time.link_latency_us = 0;
    disk.host_budget = host_budget;
    c.disk = disk;
    return RunServeReplay(workload, train, test, arrivals, c, &*store);
  }
  Trace trace;
  TraceRequests grouped;
  ServeWorkload workload;
  std::optional<MapStore> store;
  std::vector<uint32_t> train = {0, 1, 2, 3, 4, 5}, test = {6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  std::vector<int64_t> arrivals = {0, 1, 2, 30, 31, 32, 60, 61, 90, 91};
};

double Stall(const ServeResult& r) { return r.prefill.stall_ns + r.decode.stall_ns; }
double DiskStall(const ServeResult& r) { return r.prefill.disk_stall_ns + r.decode.disk_stall_ns; }
uint64_t DiskReads(const ServeResult& r) { return r.prefill.disk_reads + r.decode.disk_reads; }

// What must match: every request's timing, and every cache figure of both phases.
void ExpectSameRun(const ServeResult& a, const ServeResult& b, const std::string& what) {
  ASSERT_EQ(a.requests.size(), b.requests.size()) << what;
  for (size_t k = 0; k < a.requests.size(); ++k) {
    EXPECT_EQ(a.requests[k].first_token_ns, b.requests[k].first_token_ns) << what << " " << k;
    EXPECT_EQ(a.requests[k].last_token_ns, b.requests[k].last_token_ns) << what << " " << k;
  }
  for (auto phase : {&ServeResult::prefill, &ServeResult::decode}) {
    const PhaseFigures &x = a.*phase, &y = b.*phase;
    EXPECT_EQ(x.iterations, y.iterations) << what;
    EXPECT_EQ(x.hits, y.hits) << what;
    EXPECT_EQ(x.misses, y.misses) << what;
    EXPECT_EQ(x.on_demand_loads, y.on_demand_loads) << what;
    EXPECT_EQ(x.prefetches_issued, y.prefetches_issued) << what;
    EXPECT_EQ(x.prefetches_used, y.prefetches_used) << what;
    EXPECT_EQ(x.experts_moved, y.experts_moved) << what;
    EXPECT_EQ(x.stall_ns, y.stall_ns) << what;
    EXPECT_EQ(x.time_ns, y.time_ns) << what;
  }
}

TEST(ServeReplayDiskTest, AWarmHostCacheOfEveryExpertChangesNothing) {
  Fixture f;
  for (const char* policy : {"lru", "lfu", "moe-infinity", "fmoe"}) {
    auto without = f.Run(policy, 0);
    auto with = f.Run(policy, 1.0);
    ASSERT_TRUE(without.ok() && with.ok()) << policy;
    ExpectSameRun(*without, *with, policy);
    EXPECT_EQ(DiskReads(*with), 0u) << policy;
    EXPECT_EQ(DiskStall(*with), 0.0) << policy;
    EXPECT_GT(with->decode.host_loads + with->prefill.host_loads, 0u) << policy;
    EXPECT_DOUBLE_EQ(with->decode.host_hit_rate(), 1.0) << policy;
    EXPECT_EQ(without->decode.host_loads, 0u) << policy;
  }
}

TEST(ServeReplayDiskTest, AnEmptyHostCacheOfEveryExpertOverAnInstantDiskNearlyChangesNothing) {
  Fixture f;
  DiskModel fast;
  fast.gbps = 1e6;  // 1 ns for an expert.
  fast.latency_us = 0;
  fast.warm = false;
  for (const char* policy : {"lru", "fmoe"}) {
    auto without = f.Run(policy, 0);
    auto with = f.Run(policy, 1.0, fast);
    ASSERT_TRUE(without.ok() && with.ok()) << policy;
    // Each expert is read once at most (the host cache holds them all; the train split read
    // most), each read 1 ns.
    EXPECT_LE(DiskReads(*with), 32u);
    EXPECT_EQ(with->iterations, without->iterations) << policy;
    EXPECT_NEAR(with->total_ns, without->total_ns, 1e-3 * without->total_ns) << policy;
    EXPECT_NEAR(Stall(*with), Stall(*without), 1e-3 * Stall(*without) + 1e3) << policy;
    EXPECT_LE(DiskStall(*with), 32.0) << policy;
  }
}

TEST(ServeReplayDiskTest, ASmallerHostBudgetReadsMoreFromDisk) {
  Fixture f;
  DiskModel disk;
  disk.gbps = 1;  // 1 ms an expert read, after 100 us.
  disk.latency_us = 100;
  disk.warm = false;
  for (const char* policy : {"lru", "fmoe"}) {
    auto small = f.Run(policy, 0.25, disk);
    auto large = f.Run(policy, 0.75, disk);
    auto all = f.Run(policy, 1.0, disk);
    ASSERT_TRUE(small.ok() && large.ok() && all.ok()) << policy;
    EXPECT_GT(DiskReads(*small), DiskReads(*large)) << policy;
    EXPECT_GE(DiskReads(*large), DiskReads(*all)) << policy;
    EXPECT_LT(small->decode.host_hit_rate(), all->decode.host_hit_rate()) << policy;
    EXPECT_GT(DiskStall(*small), 0.0) << policy;
    EXPECT_LE(DiskStall(*small), Stall(*small)) << policy;
    EXPECT_GT(small->prefill.disk_bytes + small->decode.disk_bytes, 0.0) << policy;
    EXPECT_DOUBLE_EQ(small->prefill.disk_bytes + small->decode.disk_bytes,
                     1e6 * static_cast<double>(DiskReads(*small)));
  }
}

TEST(ServeReplayDiskTest, TheReportCarriesTheDiskFiguresOnlyForRunsWithTheTier) {
  Fixture f;
  DiskModel disk;
  disk.warm = false;
  auto with = f.Run("lru", 0.25, disk);
  auto without = f.Run("lru", 0);
  ASSERT_TRUE(with.ok() && without.ok());
  const ServeSummary s = Summarise(*with, 1.0);
  EXPECT_TRUE(s.disk);
  EXPECT_GT(s.prefill.disk_reads + s.decode.disk_reads, 0.0);
  EXPECT_GT(s.prefill.disk_mb, 0.0);
  const std::string header = ServeCsvHeader(true);
  const std::string row = ServeCsvRow(with->config, s);
  EXPECT_EQ(std::count(header.begin(), header.end(), ','), std::count(row.begin(), row.end(), ','));
  EXPECT_TRUE(
      header.ends_with(",decode_disk_stall_ms_per_token,chunk_overhead,"
                       "prefill_hinted_reads,prefill_hints_not_read,"
                       "decode_hinted_reads_per_token,decode_hints_not_read_per_token"))
      << header;
  const std::string table = ServeTable({{"lru", s}});
  EXPECT_NE(table.find("disk prefill"), std::string::npos) << table;
  // Without the tier: the columns of before, nothing added.
  const ServeSummary plain = Summarise(*without, 1.0);
  EXPECT_FALSE(plain.disk);
  EXPECT_TRUE(ServeCsvHeader().ends_with(",max_batched_tokens,chunk_overhead"));
  EXPECT_EQ(ServeTable({{"lru", plain}}).find("disk"), std::string::npos);
}

TEST(ServeReplayDiskTest, HintedReadsAndTheHintsNotReadReachTheReport) {
  Fixture f;
  DiskModel disk;
  disk.gbps = 10;  // 0.1 ms an expert read, after 10 us: a tenth of a layer's compute.
  disk.latency_us = 10;
  disk.warm = false;
  auto r = f.Run("fmoe", 0.5, disk);
  ASSERT_TRUE(r.ok());
  uint64_t hinted = 0, not_read = 0;
  for (const PhaseFigures* p : {&r->prefill, &r->decode}) {
    EXPECT_LE(p->hinted_reads, p->disk_reads);
    hinted += p->hinted_reads;
    not_read += p->hints_yielded + p->hints_late;
  }
  // fmoe's directives hint the host tier: some are read ahead, some are not.
  EXPECT_GT(hinted, 0u);
  EXPECT_GT(not_read, 0u);
  const ServeSummary s = Summarise(*r, 1.0);
  ASSERT_GT(s.decode.units, 0u);
  EXPECT_DOUBLE_EQ(s.decode.hinted_reads, static_cast<double>(r->decode.hinted_reads) /
                                              static_cast<double>(s.decode.units));
  EXPECT_DOUBLE_EQ(s.decode.hints_not_read,
                   static_cast<double>(r->decode.hints_yielded + r->decode.hints_late) /
                       static_cast<double>(s.decode.units));
  // The CSV's last four columns: prefill's hinted reads and hints not read, then decode's.
  const std::string row = ServeCsvRow(r->config, s);
  std::vector<std::string> cells;
  std::stringstream in(row);
  for (std::string cell; std::getline(in, cell, ',');) cells.push_back(cell);
  ASSERT_GE(cells.size(), 4u);
  EXPECT_EQ(std::stod(cells[cells.size() - 4]), std::stod(Fixed(s.prefill.hinted_reads, 3)));
  EXPECT_EQ(std::stod(cells[cells.size() - 3]), std::stod(Fixed(s.prefill.hints_not_read, 3)));
  EXPECT_EQ(std::stod(cells[cells.size() - 2]), std::stod(Fixed(s.decode.hinted_reads, 4)));
  EXPECT_EQ(std::stod(cells[cells.size() - 1]), std::stod(Fixed(s.decode.hints_not_read, 4)));
  // With every expert in host memory from the start nothing is hinted to the disk.
  auto warm = f.Run("fmoe", 1.0);
  ASSERT_TRUE(warm.ok());
  EXPECT_EQ(warm->prefill.hinted_reads + warm->decode.hinted_reads, 0u);
}

TEST(ServeReplayDiskTest, BadDiskConfigsAreRefused) {
  Fixture f;
  DiskModel disk;
  disk.gbps = -1;
  EXPECT_FALSE(f.Run("lru", 0.25, disk).ok());
  EXPECT_FALSE(f.Run("lru", 1.5).ok());
}

}  // namespace
}  // namespace fmoe::bench
