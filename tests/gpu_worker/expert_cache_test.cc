// The expert cache's state machine against a scripted link: budget and invariants under random
// sequences, on-demand precedence, stale and foreign directives, eviction order, and the bytes
// every handed-out slot holds.
#include "gpu_worker/cache/expert_cache.h"
#include "gpu_worker/cache/policies/policy_factory.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>

namespace fmoe {
namespace {

// A link the test drives: Submit queues; Step(n) finishes the n tasks the real link would run
// first (on-demand, then priority); Wait finishes one, advancing the clock by its duration.
class ScriptedLink final : public TransferEngine {
 public:
  explicit ScriptedLink(ManualClock& clock) : clock_(clock) {}
  std::string_view name() const override { return "scripted"; }
  void Submit(const TransferTask& task) override {
    ASSERT_EQ(live_.count(task.id), 0u);
    live_[task.id] = task;
    order_.push_back(task.id);
    submitted.push_back(task);
  }
  void Cancel(uint64_t id) override {
    if (live_.erase(id) == 0) return;
    finished_.push_back({id, true, 0, 0, 0, 0, Status::Ok()});
    ++cancels;
  }
  void Promote(uint64_t id) override {
    auto it = live_.find(id);
    if (it != live_.end()) {
      it->second.on_demand = true;
      ++promotions;
    }
  }
  size_t Poll(std::vector<TransferDone>* out) override {
    const size_t n = finished_.size();
    out->insert(out->end(), finished_.begin(), finished_.end());
    finished_.clear();
    return n;
  }
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds) override {
    if (finished_.empty()) Step(1);
    return Poll(out);
  }
  TransferStats stats() const override { return {}; }
  // Tiered mode: a task names its expert; its bytes come from `by_key` (key * task.bytes).
  void Hint(uint32_t key, int64_t) override { hints.push_back(key); }
  bool Staged(uint32_t key) const override { return !on_disk.count(key); }
  Result<void*> AllocateDevice(size_t) override { return InternalError(); }
  void FreeDevice(void*) override {}

  // Finishes up to n tasks in link order, copying their bytes.
  void Step(size_t n) {
    for (size_t i = 0; i < n && !live_.empty(); ++i) {
      uint64_t best = 0;
      for (uint64_t id : order_) {
        if (!live_.count(id)) continue;
        if (best == 0 || Before(live_[id], live_[best])) best = id;
      }
      const TransferTask t = live_[best];
      live_.erase(best);
      clock_.AdvanceNs(1000);
      ++loads[t.key];
      const bool fail_now = fail_next[t.key] > 0;
      if (fail_now) --fail_next[t.key];
      if (unreadable.count(t.key) || fail_now) {
        finished_.push_back({t.id, false, 0, 0, clock_.NowNs() - 1000, clock_.NowNs(),
                             DataLoss("/m/model.safetensors: bytes [0, 64): the file ends at 0")});
        continue;
      }
      const void* src = t.src != nullptr ? t.src : by_key + size_t{t.key} * t.bytes;
      std::memcpy(t.dst, src, t.bytes);
      on_disk.erase(t.key);
      finished_.push_back(
          {t.id, false, t.bytes, 0, clock_.NowNs() - 1000, clock_.NowNs(), Status::Ok()});
    }
    std::erase_if(order_, [&](uint64_t id) { return !live_.count(id); });
  }
  size_t live() const { return live_.size(); }
  bool any_on_demand() const {
    return std::any_of(live_.begin(), live_.end(), [](auto& kv) { return kv.second.on_demand; });
  }

  std::vector<TransferTask> submitted;
  std::vector<uint32_t> hints;
  std::set<uint32_t> on_disk;         // Keys not staged in host memory (Staged false until loaded).
  std::set<uint32_t> unreadable;      // Keys whose load fails (a read error).
  std::map<uint32_t, int> fail_next;  // Keys whose next n loads fail (a transient error).
  std::map<uint32_t, int> loads;      // Loads finished per key (failed ones included).
  const char* by_key = nullptr;
  int cancels = 0;
  int promotions = 0;

 private:
  static Result<void*> InternalError() { return Internal("scripted link has no memory"); }
  static bool Before(const TransferTask& a, const TransferTask& b) {
    if (a.on_demand != b.on_demand) return a.on_demand;
    if (a.on_demand) return a.id < b.id;
    return a.priority > b.priority || (a.priority == b.priority && a.id < b.id);
  }
  ManualClock& clock_;
  std::map<uint64_t, TransferTask> live_;
  std::deque<uint64_t> order_;
  std::vector<TransferDone> finished_;
};

constexpr uint32_t kLayers = 4;
constexpr uint32_t kExperts = 8;
constexpr size_t kBytes = 64;

struct Fixture {
  Fixture(std::string policy, uint32_t slots, uint32_t rank = 0, uint32_t world = 1,
          bool preload = false, uint32_t inflight = 2, bool hybrid = false, bool admit = false,
          bool tiered = false)
      : link(clock) {
    host.resize(kLayers * kExperts * kBytes);
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<char>((i / kBytes) * 7 + i);
    device.assign(slots * kBytes, 0);
    std::vector<const void*> addresses(kLayers * kExperts, nullptr);
    for (uint32_t k = 0; k < kLayers * kExperts; ++k) {
      if (k % world == rank) addresses[k] = host.data() + k * kBytes;
    }
    ExpertCacheOptions o;
    o.num_layers = kLayers;
    o.num_experts = kExperts;
    o.top_k = 2;
    o.rank = rank;
    o.world_size = world;
    o.expert_bytes = kBytes;
    o.slots = slots;
    o.preload = preload;
    o.max_inflight_prefetches = inflight;
    o.hybrid = hybrid;
    o.admit_host_runs = admit;
    o.tiered = tiered;
    if (tiered) {
      std::fill(addresses.begin(), addresses.end(), nullptr);
      link.by_key = host.data();
    }
    PolicyOptions po;
    po.prefetch_distance = 2;
    auto p = MakePolicy(policy, po);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    auto c = ExpertCache::Create(o, std::move(*p), &link, addresses, device.data(), clock);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    cache = std::move(*c);
  }

  // A stream buffer of `slots` experts.
  void AttachStream(uint32_t slots) {
    stream.assign(slots * kBytes, 0);
    ASSERT_TRUE(cache->AttachStreamBuffer(stream.data(), slots).ok());
  }
  // Where a handed-out expert's bytes are.
  const char* Bytes(const ReadyExpert& e) const {
    return (e.streamed ? stream.data() : device.data()) + e.slot * kBytes;
  }

  // Begins `layer` with `experts` (sorted) and takes every expert Next hands out, with the
  // error it came with; every one without holds its own bytes. Leaves the layer open.
  std::map<uint32_t, Status> HandOut(uint32_t layer, std::vector<uint32_t> experts) {
    std::map<uint32_t, Status> handed;
    const std::vector<uint32_t> tokens(experts.size(), 1);
    EXPECT_TRUE(cache->BeginLayer({layer, experts, tokens, {}}).ok());
    while (true) {
      Result<ReadyExpert> e = cache->Next();
      if (!e.ok()) {
        EXPECT_EQ(e.status().code(), ErrorCode::kNotFound) << e.status().ToString();
        break;
      }
      EXPECT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
      handed[e->expert] = e->error;
      if (e->error.ok()) {
        EXPECT_EQ(0, std::memcmp(Bytes(*e), host.data() + (layer * kExperts + e->expert) * kBytes,
                                 kBytes));
      }
      cache->Done(e->expert);
    }
    return handed;
  }

  // Runs one layer: every expert handed out must hold its own bytes.
  void RunLayer(uint32_t layer, std::vector<uint32_t> experts) {
    std::sort(experts.begin(), experts.end());
    experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
    std::vector<uint32_t> tokens(experts.size(), 1);
    LayerRouting r{layer, experts, tokens, {}};
    ASSERT_TRUE(cache->BeginLayer(r).ok());
    ASSERT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
    std::set<uint32_t> got;
    while (true) {
      Result<ReadyExpert> e = cache->Next();
      if (!e.ok()) {
        ASSERT_EQ(e.status().code(), ErrorCode::kNotFound) << e.status().ToString();
        break;
      }
      const uint32_t key = layer * kExperts + e->expert;
      ASSERT_EQ(0, std::memcmp(Bytes(*e), host.data() + key * kBytes, kBytes))
          << "layer " << layer << " expert " << e->expert << (e->streamed ? " (streamed)" : "");
      got.insert(e->expert);
      ASSERT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
      cache->Done(e->expert);
    }
    std::set<uint32_t> want;
    for (uint32_t x : experts) {
      if (cache->Owns(layer, x)) want.insert(x);
    }
    EXPECT_EQ(got, want);
    cache->EndLayer();
    ASSERT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
  }

  // Runs a layer of one sequence with hybrid execution, reporting each host run as taking
  // `host_ns`; returns the experts run on the host.
  std::vector<uint32_t> RunHybridLayer(uint32_t layer, std::vector<uint32_t> experts,
                                       int64_t host_ns) {
    std::vector<uint32_t> tokens(experts.size(), 1);
    std::vector<uint32_t> counts(kExperts, 0);  // The one sequence's tokens per expert.
    for (uint32_t e : experts) counts[e] = 1;
    EXPECT_TRUE(cache->BeginLayer({layer, experts, tokens, counts}).ok());
    std::vector<uint32_t> on_host;
    uint32_t handed = 0;
    while (true) {
      Result<ReadyExpert> e = cache->Next();
      if (!e.ok()) break;
      ++handed;
      if (e->on_host) {
        on_host.push_back(e->expert);
        if (fail_host_reads) {
          cache->RecordHostReadFailure(e->expert, 2, true);  // Its host copy's read and retry.
        } else {
          cache->RecordHostRun(e->expert, host_ns);
        }
      } else {
        const uint32_t key = layer * kExperts + e->expert;
        EXPECT_EQ(
            0, std::memcmp(device.data() + e->slot * kBytes, host.data() + key * kBytes, kBytes));
      }
      EXPECT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
      cache->Done(e->expert);
    }
    EXPECT_EQ(handed, experts.size());
    cache->EndLayer();
    EXPECT_TRUE(cache->CheckInvariants().ok()) << cache->CheckInvariants().ToString();
    return on_host;
  }

  bool fail_host_reads = false;  // RunHybridLayer: host runs' reads fail.
  ManualClock clock;
  ScriptedLink link;
  std::vector<char> host;
  std::vector<char> device;
  std::vector<char> stream;
  std::unique_ptr<ExpertCache> cache;
};

PrefetchDirective Directive(uint64_t request, uint32_t iteration, uint32_t target,
                            std::vector<uint32_t> experts, float priority = 1.0f) {
  PrefetchDirective d;
  d.request_id = request;
  d.iteration = iteration;
  d.target_layer = target;
  d.score = 0.9f;
  for (uint32_t e : experts) d.entries.push_back({e, 0.5f, priority});
  return d;
}

TEST(BudgetSlots, FractionAndGigabytes) {
  EXPECT_EQ(*BudgetSlots(std::nullopt, 0.25, 100, 64), 16u);
  EXPECT_EQ(*BudgetSlots(std::nullopt, 1.0, 100, 64), 64u);
  EXPECT_EQ(*BudgetSlots(std::nullopt, std::nullopt, 100, 64), 64u);
  EXPECT_EQ(*BudgetSlots(1e-6, std::nullopt, 100, 64), 10u);
  EXPECT_EQ(*BudgetSlots(1.0, std::nullopt, 100, 64), 64u);  // Capped at the experts owned.
  Result<uint32_t> none = BudgetSlots(std::nullopt, 0.001, 100, 64);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("holds no expert"), std::string::npos);
}

TEST(ExpertCache, RejectsBadOptions) {
  ManualClock clock;
  ScriptedLink link(clock);
  std::vector<char> host(kBytes), device(kBytes);
  std::vector<const void*> addresses(kLayers * kExperts, host.data());
  ExpertCacheOptions o;
  o.num_layers = kLayers;
  o.num_experts = kExperts;
  o.top_k = 2;
  o.expert_bytes = kBytes;
  o.slots = 0;
  auto p = MakePolicy("lru", {});
  auto c = ExpertCache::Create(o, std::move(*p), &link, addresses, device.data(), clock);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("slots 0"), std::string::npos);
  o.slots = 1;
  o.top_k = 9;
  c = ExpertCache::Create(o, std::move(*MakePolicy("lru", {})), &link, addresses, device.data(),
                          clock);
  ASSERT_FALSE(c.ok());
  o.top_k = 2;
  addresses.pop_back();
  c = ExpertCache::Create(o, std::move(*MakePolicy("lru", {})), &link, addresses, device.data(),
                          clock);
  ASSERT_FALSE(c.ok());
  EXPECT_FALSE(MakePolicy("belady", {}).ok());
  EXPECT_FALSE(MakePolicy("oracle", {}).ok());  // Needs the future.
}

TEST(ExpertCache, PreloadFillsTheBudgetAndAllResidentIsAllHits) {
  Fixture f("lru", kLayers * kExperts, 0, 1, /*preload=*/true);
  EXPECT_EQ(f.cache->stats().resident, kLayers * kExperts);
  EXPECT_EQ(f.cache->stats().preload_bytes, kLayers * kExperts * kBytes);
  SequenceInfo s{1, 0, 3};
  f.cache->BeginIteration({&s, 1});
  for (uint32_t l = 0; l < kLayers; ++l) f.RunLayer(l, {l, 7 - l});
  f.cache->EndIteration();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.total.hits, 8u);
  EXPECT_EQ(st.total.misses, 0u);
  EXPECT_EQ(st.total.bytes_moved, 0u);
}

TEST(ExpertCache, MissesLoadOnDemandAndEvictLeastRecentlyUsed) {
  Fixture f("lru", 3);
  SequenceInfo s{1, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {0, 1});
  f.RunLayer(1, {2});
  f.RunLayer(2, {3});  // Evicts (0, 0): used longest ago.
  f.cache->EndIteration();
  CacheStats st = f.cache->stats();
  EXPECT_EQ(st.total.misses, 4u);
  EXPECT_EQ(st.total.on_demand_loads, 4u);
  EXPECT_EQ(st.total.evictions, 1u);
  EXPECT_EQ(st.total.bytes_moved, 4 * kBytes);
  for (const TransferTask& t : f.link.submitted) EXPECT_TRUE(t.on_demand);
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {1});  // Still resident.
  EXPECT_EQ(f.cache->stats().total.hits, 1u);
  f.cache->EndIteration();
}

// Hybrid execution: the split follows the measured link and host times; a host run is handed
// out when nothing loaded is ready, takes no slot and moves no byte.
TEST(ExpertCache, HybridRunsMissingExpertsOnTheHostWhenThatIsSooner) {
  Fixture f("lru", 2, 0, 1, /*preload=*/false, 2, /*hybrid=*/true);
  SequenceInfo s{1, 0, 1};
  auto run = [&](uint32_t layer, std::vector<uint32_t> experts, int64_t host_ns) {
    return f.RunHybridLayer(layer, std::move(experts), host_ns);
  };
  f.cache->BeginIteration({&s, 1});
  // No load measured yet: everything is loaded (each scripted load takes 1000 ns).
  EXPECT_TRUE(run(0, {0, 1}, 300).empty());
  // Loads measured, the host not yet: the lightest missing expert runs there once.
  EXPECT_EQ(run(1, {2, 3, 4}, 300), (std::vector<uint32_t>{2}));
  // A host run (300 ns) beats a load (1000 ns) three times over: all three run on the host, and
  // take 5000 ns each.
  EXPECT_EQ(run(2, {5, 6, 7}, 5000), (std::vector<uint32_t>{5, 6, 7}));
  // The host is now measured slower than a load: everything is loaded again.
  EXPECT_TRUE(run(3, {0, 1}, 5000).empty());
  f.cache->EndIteration();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.total.host_runs, 4u);
  EXPECT_EQ(st.total.bytes_not_moved, 4 * kBytes);
  EXPECT_EQ(st.total.host_ns, 300 + 3 * 5000);
  EXPECT_EQ(st.total.on_demand_loads, 6u);
  EXPECT_EQ(st.total.bytes_moved, 6 * kBytes);
  EXPECT_EQ(st.total.misses, 10u);
  for (const TransferTask& t : f.link.submitted) {
    const size_t key = (static_cast<const char*>(t.src) - f.host.data()) / kBytes;
    EXPECT_NE(key, 1 * kExperts + 2);
    EXPECT_NE(key, 2 * kExperts + 5);
  }
  // The request's share: it was the only one.
  const RequestUsage u = f.cache->Usage(1);
  EXPECT_EQ(u.host_runs, 4u);
  EXPECT_EQ(u.bytes_not_moved, 4 * kBytes);
  EXPECT_EQ(u.bytes_moved, 6 * kBytes);
}

// After a layer, an expert it ran on the host is loaded with the link's spare time when the
// policy values it above the expert it would evict, and only then.
TEST(ExpertCache, HybridAdmitsAHostRunExpertWithSpareLinkTime) {
  Fixture f("lru", 2, 0, 1, /*preload=*/false, /*inflight=*/2, /*hybrid=*/true, /*admit=*/true);
  SequenceInfo s{1, 0, 1};
  f.cache->BeginIteration({&s, 1});
  EXPECT_TRUE(f.RunHybridLayer(0, {0, 1}, 300).empty());  // Measures the link.
  // (1, 2) runs on the host; lru ranks it below (1, 3) and (1, 4), used after it: kept out.
  EXPECT_EQ(f.RunHybridLayer(1, {2, 3, 4}, 300), (std::vector<uint32_t>{2}));
  EXPECT_EQ(f.link.live(), 0u);
  EXPECT_EQ(f.cache->stats().total.host_runs_admitted, 0u);
  // All three run on the host; lru values them above layer 1's experts. Two fit the prefetch
  // window: (2, 5) and (2, 6) are loaded as prefetches, (2, 7) is not.
  EXPECT_EQ(f.RunHybridLayer(2, {5, 6, 7}, 300), (std::vector<uint32_t>{5, 6, 7}));
  EXPECT_EQ(f.link.live(), 2u);
  EXPECT_FALSE(f.link.any_on_demand());
  CacheStats st = f.cache->stats();
  EXPECT_EQ(st.layers[2].host_runs_admitted, 2u);
  EXPECT_EQ(st.layers[2].prefetches_issued, 2u);
  EXPECT_EQ(st.layers[1].evictions, 2u);
  f.link.Step(2);
  f.cache->Pump();
  EXPECT_EQ(f.cache->stats().resident, 2u);
  f.cache->EndIteration();
  // The next iteration finds them resident: hits, nothing on the host.
  ++s.iteration;
  f.cache->BeginIteration({&s, 1});
  EXPECT_TRUE(f.RunHybridLayer(2, {5, 6}, 300).empty());
  st = f.cache->stats();
  EXPECT_EQ(st.layers[2].hits, 2u);
  EXPECT_EQ(st.total.host_runs_admitted, 2u);
  EXPECT_EQ(st.total.bytes_moved, 6 * kBytes);  // Layer 0 and 1's loads, the two admitted.
  f.cache->EndIteration();
}

// Admission waits for spare link time: with a prefetch queued behind a full window, a host-run
// expert is not loaded.
TEST(ExpertCache, HybridAdmissionGivesWayToLoadsAndQueuedPrefetches) {
  Fixture f("lru", 4, 0, 1, /*preload=*/false, /*inflight=*/1, /*hybrid=*/true, /*admit=*/true);
  SequenceInfo s{1, 0, 1};
  f.cache->BeginIteration({&s, 1});
  EXPECT_TRUE(f.RunHybridLayer(0, {0, 1}, 300).empty());
  // (1, 2) runs on the host (the first probe of its speed), (1, 3) is loaded on demand: the link
  // did not keep up with the layer, nothing is admitted.
  EXPECT_EQ(f.RunHybridLayer(1, {2, 3}, 300), (std::vector<uint32_t>{2}));
  EXPECT_EQ(f.cache->stats().total.host_runs_admitted, 0u);
  EXPECT_EQ(f.link.live(), 0u);
  // (2, 4) runs on the host, nothing loads: the link has spare time, (2, 4) is admitted.
  EXPECT_EQ(f.RunHybridLayer(2, {4}, 300), (std::vector<uint32_t>{4}));
  EXPECT_EQ(f.cache->stats().total.host_runs_admitted, 1u);
  f.link.Step(1);
  f.cache->Pump();
  f.cache->EndIteration();
  ++s.iteration;
  f.cache->BeginIteration({&s, 1});
  // The policy's own plan: two prefetches for layer 3, one on the link and one queued.
  f.cache->Prefetch(3, 0, 1.0);
  f.cache->Prefetch(3, 1, 1.0);
  f.cache->Pump();
  ASSERT_EQ(f.link.live(), 1u);
  const size_t submitted = f.link.submitted.size();
  // (2, 5) runs on the host without a load, but the link is the plan's: not admitted.
  EXPECT_EQ(f.RunHybridLayer(2, {5}, 300), (std::vector<uint32_t>{5}));
  EXPECT_EQ(f.cache->stats().total.host_runs_admitted, 1u);
  for (size_t i = submitted; i < f.link.submitted.size(); ++i) {
    const size_t key = (static_cast<const char*>(f.link.submitted[i].src) - f.host.data()) / kBytes;
    EXPECT_EQ(key / kExperts, 3u) << "only layer 3's prefetches use the link";
  }
  f.cache->EndIteration();
}

TEST(ExpertCache, MorePickedExpertsThanSlotsStillRun) {
  Fixture f("lru", 1);
  SequenceInfo s{1, 0, 8};
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {0, 1, 2, 3, 4, 5, 6, 7});
  f.RunLayer(3, {1, 6});
  f.cache->EndIteration();
  EXPECT_EQ(f.cache->stats().total.misses, 10u);
}

TEST(ExpertCache, OnDemandLoadsGoFirstAndPausePrefetching) {
  Fixture f("fmoe", 4, 0, 1, false, /*inflight=*/1);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->PostDirective(Directive(7, 0, 2, {4, 5, 6}, 1.0f));
  f.cache->PostDirective(Directive(7, 0, 3, {1}, 0.5f));
  f.cache->Pump();
  ASSERT_EQ(f.link.submitted.size(), 1u);  // One prefetch in flight at a time.
  EXPECT_FALSE(f.link.submitted[0].on_demand);
  // Layer 0 misses: its loads are on demand, and no prefetch is handed out meanwhile.
  std::vector<uint32_t> experts = {0, 3};
  std::vector<uint32_t> tokens = {1, 1};
  ASSERT_TRUE(f.cache->BeginLayer({0, experts, tokens, {}}).ok());
  ASSERT_EQ(f.link.submitted.size(), 3u);
  EXPECT_TRUE(f.link.submitted[1].on_demand);
  EXPECT_TRUE(f.link.submitted[2].on_demand);
  f.cache->Pump();
  EXPECT_EQ(f.link.submitted.size(), 3u);
  // The link runs the on-demand loads before the queued prefetch.
  f.link.Step(2);
  f.cache->Pump();
  for (int i = 0; i < 2; ++i) {
    Result<ReadyExpert> e = f.cache->Next();
    ASSERT_TRUE(e.ok());
    f.cache->Done(e->expert);
  }
  EXPECT_EQ(f.cache->Next().status().code(), ErrorCode::kNotFound);
  f.cache->EndLayer();
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  // Now prefetching resumes, highest priority first.
  f.link.Step(1);
  f.cache->Pump();
  ASSERT_GE(f.link.submitted.size(), 4u);
  EXPECT_FALSE(f.link.submitted[3].on_demand);
  EXPECT_EQ(f.link.submitted[3].priority, 1.0);
}

TEST(ExpertCache, APrefetchStillOnTheLinkIsPromotedWhenNeeded) {
  Fixture f("fmoe", 4);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->PostDirective(Directive(7, 0, 1, {5}));
  f.cache->Pump();
  ASSERT_EQ(f.link.submitted.size(), 1u);
  f.RunLayer(0, {0});
  std::vector<uint32_t> experts = {5};
  std::vector<uint32_t> tokens = {1};
  ASSERT_TRUE(f.cache->BeginLayer({1, experts, tokens, {}}).ok());
  EXPECT_EQ(f.link.promotions, 1);
  Result<ReadyExpert> e = f.cache->Next();
  ASSERT_TRUE(e.ok());
  f.cache->Done(5);
  f.cache->EndLayer();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.layers[1].late_prefetches, 1u);
  EXPECT_EQ(st.layers[1].misses, 1u);
  EXPECT_EQ(st.layers[1].prefetches_used, 1u);
}

TEST(ExpertCache, UsedPrefetchIsAHitAndAnUnusedOneIsWasted) {
  Fixture f("fmoe", 4);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->PostDirective(Directive(7, 0, 2, {4, 6}));
  f.cache->Pump();
  f.link.Step(2);
  f.RunLayer(0, {0});
  f.RunLayer(1, {1});
  f.RunLayer(2, {4});
  f.cache->EndIteration();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.layers[2].hits, 1u);
  EXPECT_EQ(st.layers[2].prefetches_used, 1u);
  EXPECT_EQ(st.layers[2].prefetches_wasted, 1u);
  EXPECT_EQ(st.directives, 1u);
}

TEST(ExpertCache, APrefetchItsLayerStartedWithoutIsCancelledOnTheLink) {
  Fixture f("fmoe", 4);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->PostDirective(Directive(7, 0, 1, {5, 6}));
  f.cache->Pump();
  ASSERT_EQ(f.link.submitted.size(), 2u);
  f.RunLayer(0, {0});  // Its on-demand load goes first; the prefetches stay on the link.
  ASSERT_EQ(f.link.live(), 2u);
  // Layer 1 uses expert 5 (promoted, it waits for it) but not 6: 6's copy is cancelled, and its
  // slot comes back.
  f.RunLayer(1, {5});
  EXPECT_EQ(f.link.cancels, 1);
  EXPECT_EQ(f.link.promotions, 1);
  EXPECT_EQ(f.link.live(), 0u);
  f.cache->Pump();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.layers[1].prefetches_used, 1u);
  EXPECT_EQ(st.layers[1].prefetches_wasted, 1u);
  EXPECT_EQ(st.layers[1].prefetches_cancelled, 1u);
  EXPECT_EQ(st.resident, 2u);  // Experts 0 and 5 of layer 0 and 1.
  f.RunLayer(2, {1, 2});       // The freed slot serves the next layer's loads.
  f.cache->EndIteration();
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
}

TEST(ExpertCache, StaleDirectivesAreDropped) {
  Fixture f("fmoe", 4);
  SequenceInfo s{7, 3, 1};
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {0});
  f.RunLayer(1, {1});
  const size_t before = f.link.submitted.size();
  f.cache->PostDirective(Directive(7, 3, 1, {5}));  // Layer 1 has run.
  f.cache->PostDirective(Directive(7, 2, 3, {5}));  // An older iteration.
  f.cache->PostDirective(Directive(8, 3, 3, {5}));  // Not in the batch.
  f.cache->PostDirective(Directive(7, 3, 9, {5}));  // No such layer.
  f.cache->Pump();
  EXPECT_EQ(f.link.submitted.size(), before);
  EXPECT_EQ(f.cache->stats().directives_stale, 4u);
  EXPECT_EQ(f.cache->stats().directives, 0u);
  // A queued prefetch whose layer starts first is dropped, never loaded.
  f.cache->PostDirective(Directive(7, 3, 2, {5, 6, 7}));
  f.cache->Pump();  // Two go to the link, one waits in the queue.
  f.RunLayer(2, {0});
  f.cache->EndIteration();
  EXPECT_GE(f.cache->stats().prefetch_requests_dropped, 1u);
  ASSERT_TRUE(f.cache->CheckInvariants().ok());
}

// Tiered (a link in front of a host tier): loads name their expert, misses not staged in host
// memory count as disk reads (and in the request's usage), directives are hinted to the link
// even when their layer has started (the next iteration may use them), and an expert whose load
// fails twice is handed to the layer that needs it as failed, with the read's error; the layer
// and the ones after go on.
TEST(ExpertCache, TieredLoadsByKeyCountDiskReadsHintAndFailOnlyTheirExpert) {
  Fixture f("fmoe", 4, 0, 1, /*preload=*/false, 2, false, false, /*tiered=*/true);
  for (uint32_t k = 0; k < kLayers * kExperts; ++k) f.link.on_disk.insert(k);
  f.link.on_disk.erase(1);  // Expert 1 of layer 0 is in host memory.
  SequenceInfo s{7, 3, 1};
  f.cache->BeginIteration({&s, 1});
  std::vector<uint32_t> counts(kExperts, 0);
  counts[0] = counts[1] = 1;
  const std::vector<uint32_t> experts = {0, 1}, tokens = {1, 1};
  ASSERT_TRUE(f.cache->BeginLayer({0, experts, tokens, counts}).ok());
  for (int i = 0; i < 2; ++i) {
    Result<ReadyExpert> e = f.cache->Next();
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_EQ(0, std::memcmp(f.device.data() + e->slot * kBytes, f.host.data() + e->expert * kBytes,
                             kBytes));
    f.cache->Done(e->expert);
  }
  EXPECT_EQ(f.cache->Next().status().code(), ErrorCode::kNotFound);
  f.cache->EndLayer();
  for (const TransferTask& t : f.link.submitted) {
    EXPECT_EQ(t.src, nullptr);
    EXPECT_LT(t.key, kLayers * kExperts);
  }
  EXPECT_EQ(f.cache->stats().total.disk_reads, 1u);  // Expert 0; expert 1 was staged.
  EXPECT_EQ(f.cache->stats().total.misses, 2u);
  EXPECT_EQ(f.cache->Usage(7).disk_reads, 1u);
  EXPECT_EQ(f.cache->Usage(7).misses, 2u);
  // A directive for layer 0, which has run: too late for the device, hinted to the link.
  f.cache->PostDirective(Directive(7, 3, 0, {5, 6}));
  f.cache->Pump();
  EXPECT_EQ(f.cache->stats().directives_stale, 1u);
  EXPECT_NE(std::find(f.link.hints.begin(), f.link.hints.end(), 5u), f.link.hints.end());
  EXPECT_NE(std::find(f.link.hints.begin(), f.link.hints.end(), 6u), f.link.hints.end());
  // Layer 1 needs an unreadable expert (3) and a readable one (5): 5 comes out with its bytes,
  // 3 is tried twice and comes out failed with the read's error, holding no slot.
  f.link.unreadable.insert(kExperts + 3);
  std::map<uint32_t, Status> handed = f.HandOut(1, {3, 5});
  ASSERT_EQ(handed.size(), 2u);
  EXPECT_TRUE(handed[5].ok());
  EXPECT_EQ(handed[3].code(), ErrorCode::kDataLoss);
  EXPECT_NE(handed[3].message().find("model.safetensors"), std::string::npos);
  EXPECT_EQ(f.link.loads[kExperts + 3], 2);  // One retry.
  EXPECT_EQ(f.cache->stats().layers[1].failed_loads, 2u);
  EXPECT_EQ(f.cache->stats().layers[1].failed_experts, 1u);
  f.cache->EndLayer();
  EXPECT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  // Layer 2 goes on.
  f.RunLayer(2, {4});
  f.cache->EndIteration();
  EXPECT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  // Readable again: the next iteration that picks it loads it.
  f.link.unreadable.clear();
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(1, {3});
  f.cache->EndIteration();
  EXPECT_EQ(f.link.loads[kExperts + 3], 3);
  EXPECT_EQ(f.cache->stats().total.failed_experts, 1u);
}

// A load that fails once (a transient read error) is retried on demand and the layer gets the
// expert's bytes; no expert is handed out failed.
TEST(ExpertCache, TieredRetriesAFailedLoadOnce) {
  Fixture f("lru", 2, 0, 1, /*preload=*/false, 2, false, false, /*tiered=*/true);
  for (uint32_t k = 0; k < kLayers * kExperts; ++k) f.link.on_disk.insert(k);
  f.link.fail_next[2] = 1;
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {1, 2});  // Checks every expert comes out with its own bytes.
  f.cache->EndIteration();
  EXPECT_EQ(f.link.loads[2], 2);
  EXPECT_EQ(f.cache->stats().total.failed_loads, 1u);
  EXPECT_EQ(f.cache->stats().total.failed_experts, 0u);
  EXPECT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
}

// Tiered hybrid: only an expert already in host memory may run on the host; one still on disk
// is read and loaded whichever way, so it goes to the link.
TEST(ExpertCache, TieredHybridRunsOnlyStagedExpertsOnTheHost) {
  Fixture f("lru", 2, 0, 1, /*preload=*/false, 2, /*hybrid=*/true, false, /*tiered=*/true);
  for (uint32_t k = 0; k < kLayers * kExperts; ++k) f.link.on_disk.insert(k);
  for (uint32_t k : {1u, 2u, 3u, 9u, 10u, 11u}) f.link.on_disk.erase(k);  // Staged.
  SequenceInfo s{7, 3, 1};
  f.cache->BeginIteration({&s, 1});
  std::set<uint32_t> ran;
  // A host far faster than the link: the split sends every candidate to the host.
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (uint32_t e : f.RunHybridLayer(layer, {0, 1, 2, 3, 4, 5}, 1))
      ran.insert(layer * kExperts + e);
  }
  EXPECT_FALSE(ran.empty());
  for (uint32_t key : ran) EXPECT_EQ(f.link.on_disk.count(key), 0u) << "key " << key;
  f.cache->EndIteration();
  EXPECT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  EXPECT_EQ(f.cache->stats().total.failed_experts, 0u);
  // Host runs whose host copy cannot be read (evicted from host memory and unreadable on disk)
  // count as failed loads and failed experts, as the link's do; outside a layer nothing counts.
  f.fail_host_reads = true;
  f.cache->BeginIteration({&s, 1});
  size_t failed = 0;
  for (uint32_t layer = 0; layer < 2; ++layer)
    failed += f.RunHybridLayer(layer, {1, 2, 3}, 1).size();
  f.cache->EndIteration();
  EXPECT_GT(failed, 0u);
  EXPECT_EQ(f.cache->stats().total.failed_experts, failed);
  EXPECT_EQ(f.cache->stats().total.failed_loads, 2 * failed);
  f.cache->RecordHostReadFailure(1, 2, true);
  EXPECT_EQ(f.cache->stats().total.failed_experts, failed);
  EXPECT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
}

TEST(ExpertCache, DirectivesForAnotherRanksExpertsAreIgnored) {
  // Rank 1 of 2 owns keys 1, 3, 5, ...: in layer 1 (keys 8..15) experts 1, 3, 5, 7.
  Fixture f("fmoe", 4, /*rank=*/1, /*world=*/2);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->PostDirective(Directive(7, 0, 1, {0, 2, 3}));
  f.cache->Pump();
  ASSERT_EQ(f.link.submitted.size(), 1u);
  EXPECT_EQ(f.link.submitted[0].src, f.host.data() + (1 * kExperts + 3) * kBytes);
  EXPECT_EQ(f.cache->stats().directives_foreign, 2u);
  f.link.Step(1);
  f.RunLayer(0, {0, 1, 2});  // Only expert 1 is this rank's.
  f.RunLayer(1, {2, 3});
  f.cache->EndIteration();
  const CacheStats st = f.cache->stats();
  EXPECT_EQ(st.layers[0].misses, 1u);
  EXPECT_EQ(st.layers[1].hits, 1u);
  EXPECT_EQ(st.layers[1].misses, 0u);
}

TEST(ExpertCache, PrefetchedExpertsAreProtectedUntilTheirLayer) {
  Fixture f("lru", 2);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.cache->Prefetch(3, 1, 1.0);
  f.cache->Prefetch(3, 2, 1.0);
  f.cache->Pump();
  f.link.Step(2);
  f.cache->Pump();
  // Layer 0 needs a slot: both are protected for layer 3, so one is evicted by force.
  f.RunLayer(0, {4});
  EXPECT_EQ(f.cache->stats().total.forced_evictions, 1u);
  f.cache->EndIteration();
}

// Random batches, routings, directives, prefetches and link progress, for every policy and
// several budgets: the invariants hold after every step and every handed-out slot holds the
// right bytes (RunLayer checks both).
TEST(ExpertCache, LendsFreeSlotsFirstThenTheLeastValuedExpertAndKeepsItsFloor) {
  Fixture f("lru", 4);
  f.cache->BeginIteration(std::vector<SequenceInfo>{{1, 0, 1}});
  f.RunLayer(0, {0, 1});
  f.RunLayer(1, {2});
  f.cache->EndIteration();
  // One slot is free: it goes first, and no expert leaves.
  std::optional<uint32_t> a = f.cache->LendSlot(1);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(f.cache->stats().resident, 3u);
  EXPECT_EQ(f.cache->stats().total.evictions, 0u);
  // Then the least recently used expert (layer 0's expert 0) is evicted for the next.
  std::optional<uint32_t> b = f.cache->LendSlot(1);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(f.cache->stats().total.evictions, 1u);
  EXPECT_EQ(f.cache->stats().slots, 2u);
  EXPECT_EQ(f.cache->speculation_distance(), f.cache->policy().speculation_distance());
  // The floor: the cache keeps two slots here.
  EXPECT_FALSE(f.cache->LendSlot(2).has_value());
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  // Lent slots come back free and take loads again.
  f.cache->ReturnSlot(*a);
  f.cache->ReturnSlot(*a);  // Not lent any more: ignored.
  f.cache->ReturnSlot(*b);
  EXPECT_EQ(f.cache->lent_slots(), 0u);
  f.cache->BeginIteration(std::vector<SequenceInfo>{{1, 1, 1}});
  f.RunLayer(0, {0, 3, 4, 5});
  f.cache->EndIteration();
  EXPECT_EQ(f.cache->stats().resident, 4u);
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
}

// Between iterations every slot may be loading (prefetches for the next one): a lend waits for
// the first load to finish and gives that expert up rather than fail, as every rank of a group
// must lend when its leader did.
TEST(ExpertCache, ALendWhileEverySlotIsLoadingWaitsForALoad) {
  Fixture f("lru", 2);
  SequenceInfo s{7, 0, 1};
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {4});
  f.cache->Prefetch(3, 1, 1.0);
  f.cache->Prefetch(3, 2, 1.0);
  f.cache->Pump();
  f.cache->EndIteration();
  ASSERT_EQ(f.link.live(), 2u);  // Both slots loading (layer 0's expert went for one).
  const uint64_t evictions = f.cache->stats().total.evictions;
  std::optional<uint32_t> lent = f.cache->LendSlot(1);
  ASSERT_TRUE(lent.has_value());
  EXPECT_EQ(f.link.live(), 1u);  // One load finished (and its expert went), one goes on.
  EXPECT_EQ(f.cache->stats().total.evictions, evictions + 1);
  EXPECT_EQ(f.cache->stats().total.prefetches_wasted, 1u);
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  // The floor still holds: nothing waits for it.
  EXPECT_FALSE(f.cache->LendSlot(1).has_value());
  f.cache->ReturnSlot(*lent);
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
}

// Streaming: a streamed iteration serves what is resident from the slots, brings every other
// expert of layer l + 1 into the stream buffer while layer l runs (layer 0's from
// BeginIteration), evicts and prefetches nothing, and leaves the cache as it found it; the
// next layer's experts it then does not route to are counted wasted.
TEST(ExpertCache, AStreamedIterationLoadsEachLayerAheadAndEvictsNothing) {
  Fixture f("lru", 4, 0, 1, /*preload=*/true);  // Layer 0's experts 0-3 resident.
  f.AttachStream(2 * kExperts);
  EXPECT_EQ(f.cache->stats().stream_slots, 2 * kExperts);
  f.link.submitted.clear();  // The preload's.
  SequenceInfo s{1, 0, 512, true};
  f.cache->StreamNextIteration();
  f.cache->BeginIteration({&s, 1});
  EXPECT_TRUE(f.cache->streaming());
  // Layer 0's four experts not resident are on their way before its routing is known.
  std::set<uint32_t> submitted;
  for (const TransferTask& t : f.link.submitted) {
    submitted.insert(t.key);
    EXPECT_GE(static_cast<const char*>(t.dst), f.stream.data());
    EXPECT_LT(static_cast<const char*>(t.dst), f.stream.data() + f.stream.size());
  }
  EXPECT_EQ(submitted, (std::set<uint32_t>{4, 5, 6, 7}));
  const std::vector<uint32_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<uint32_t> ones(kExperts, 1);
  ASSERT_TRUE(f.cache->BeginLayer({0, all, ones, {}}).ok());
  // Layer 1's eight follow while layer 0 runs.
  size_t layer1 = 0;
  for (const TransferTask& t : f.link.submitted) layer1 += t.key / kExperts == 1 ? 1 : 0;
  EXPECT_EQ(layer1, kExperts);
  uint32_t streamed = 0;
  while (true) {
    Result<ReadyExpert> e = f.cache->Next();
    if (!e.ok()) break;
    EXPECT_EQ(0, std::memcmp(f.Bytes(*e), f.host.data() + e->expert * kBytes, kBytes));
    EXPECT_EQ(e->streamed, e->expert >= 4) << e->expert;
    streamed += e->streamed ? 1 : 0;
    ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
    f.cache->Done(e->expert);
  }
  EXPECT_EQ(streamed, 4u);
  f.cache->EndLayer();
  f.RunLayer(1, all);
  f.RunLayer(2, {0, 1});  // Layer 2's other six were loaded ahead for nothing.
  f.RunLayer(3, all);
  f.cache->EndIteration();
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  CacheStats st = f.cache->stats();
  EXPECT_EQ(st.stream_iterations, 1u);
  EXPECT_EQ(st.total.hits, 4u);
  EXPECT_EQ(st.total.misses, 4u + 8 + 2 + 8);
  EXPECT_EQ(st.total.stream_loads, 4u + 8 + 8 + 8);
  EXPECT_EQ(st.total.stream_wasted, 6u);
  EXPECT_EQ(st.layers[2].stream_wasted, 6u);
  EXPECT_EQ(st.total.evictions, 0u);
  EXPECT_EQ(st.total.on_demand_loads, 0u);
  EXPECT_EQ(st.total.prefetches_issued, 0u);
  EXPECT_EQ(st.resident, 4u);
  // The next iteration is not streamed: layer 0's four are still hits, misses load on demand.
  f.cache->BeginIteration({&s, 1});
  EXPECT_FALSE(f.cache->streaming());
  f.RunLayer(0, {0, 1, 2, 3});
  f.RunLayer(1, {0});
  f.cache->EndIteration();
  st = f.cache->stats();
  EXPECT_EQ(st.total.hits, 8u);
  EXPECT_EQ(st.total.on_demand_loads, 1u);
  EXPECT_EQ(st.total.stream_loads, 28u);
}

// A stream buffer smaller than a layer still brings every expert, in order: a load the running
// layer needs takes the slot of a later layer's expert when none is free; with one slot the
// loads follow one another.
TEST(ExpertCache, AStreamBufferSmallerThanALayerStillServesEveryExpert) {
  for (uint32_t slots : {1u, 3u, 9u}) {
    Fixture f("lru", 2);
    f.AttachStream(slots);
    SequenceInfo s{1, 0, 64, true};
    for (int it = 0; it < 2; ++it) {
      f.cache->StreamNextIteration();
      f.cache->BeginIteration({&s, 1});
      for (uint32_t l = 0; l < kLayers; ++l) {
        f.RunLayer(l, l % 2 == 0 ? std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7}
                                 : std::vector<uint32_t>{6, 7});
        ASSERT_FALSE(::testing::Test::HasFatalFailure()) << "slots " << slots;
      }
      f.cache->EndIteration();
      ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
    }
    const CacheStats st = f.cache->stats();
    EXPECT_EQ(st.total.misses, 2u * (8 + 2 + 8 + 2)) << slots;
    EXPECT_EQ(st.total.evictions, 0u);
    EXPECT_EQ(st.resident, 0u);
  }
}

// A stream load that fails is retried once; when its retry fails too the layer gets the expert
// as failed, with the read's error, and goes on.
TEST(ExpertCache, AFailedStreamLoadIsRetriedOnceThenHandedOutFailed) {
  Fixture f("lru", 2, 0, 1, /*preload=*/false, 2, false, false, /*tiered=*/true);
  f.AttachStream(2 * kExperts);
  f.link.fail_next[1] = 1;                 // Layer 0's expert 1: one transient failure.
  f.link.unreadable.insert(kExperts + 2);  // Layer 1's expert 2: never readable.
  SequenceInfo s{1, 0, 64, true};
  f.cache->StreamNextIteration();
  f.cache->BeginIteration({&s, 1});
  f.RunLayer(0, {0, 1});
  EXPECT_EQ(f.link.loads[1], 2);
  std::map<uint32_t, Status> handed = f.HandOut(1, {2, 3});
  f.cache->EndLayer();
  ASSERT_EQ(handed.size(), 2u);
  EXPECT_TRUE(handed[3].ok());
  EXPECT_EQ(handed[2].code(), ErrorCode::kDataLoss);
  EXPECT_EQ(f.link.loads[kExperts + 2], 2);
  f.RunLayer(2, {5});
  f.cache->EndIteration();
  ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
  EXPECT_EQ(f.cache->stats().total.failed_experts, 1u);
  EXPECT_EQ(f.cache->stats().total.failed_loads, 3u);
}

TEST(ExpertCache, AStreamBufferIsAttachedOnceBetweenIterations) {
  Fixture f("lru", 2);
  std::vector<char> memory(kBytes);
  EXPECT_EQ(f.cache->AttachStreamBuffer(nullptr, 1).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(f.cache->AttachStreamBuffer(memory.data(), 0).code(), ErrorCode::kInvalidArgument);
  SequenceInfo s{1, 0, 1};
  f.cache->StreamNextIteration();  // No buffer: no effect.
  f.cache->BeginIteration({&s, 1});
  EXPECT_FALSE(f.cache->streaming());
  EXPECT_EQ(f.cache->AttachStreamBuffer(memory.data(), 1).code(), ErrorCode::kFailedPrecondition);
  f.cache->EndIteration();
  ASSERT_TRUE(f.cache->AttachStreamBuffer(memory.data(), 1).ok());
  EXPECT_EQ(f.cache->AttachStreamBuffer(memory.data(), 1).code(), ErrorCode::kFailedPrecondition);
}

TEST(ExpertCache, RandomSequencesKeepInvariantsForEveryPolicy) {
  for (const char* policy :
       {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand", "lru", "lfu"}) {
    for (uint32_t slots : {1u, 3u, 8u, 32u}) {
      for (uint32_t world : {1u, 2u}) {
        const uint32_t owned = kLayers * kExperts / world;
        Fixture f(policy, std::min(slots, owned), world - 1, world, slots > 4);
        f.AttachStream(slots % 5 + 1);  // 2, 4, 4, 3 stream slots.
        std::mt19937 rng(slots * 131 + world);
        uint64_t next_request = 1;
        std::vector<SequenceInfo> batch;
        std::vector<uint32_t> lent;
        for (int it = 0; it < 40; ++it) {
          if (batch.empty() || rng() % 4 == 0) {
            for (SequenceInfo& s : batch) f.cache->OnRequestEnd(s.request_id);
            batch.clear();
            const int n = 1 + static_cast<int>(rng() % 3);
            for (int i = 0; i < n; ++i)
              batch.push_back({next_request++, 0, static_cast<uint32_t>(1 + rng() % 5)});
          }
          if (rng() % 3 == 0) f.cache->StreamNextIteration();
          f.cache->BeginIteration(batch);
          for (uint32_t l = 0; l < kLayers; ++l) {
            if (rng() % 2 == 0) {
              const SequenceInfo& s = batch[rng() % batch.size()];
              const uint32_t target = static_cast<uint32_t>(rng() % kLayers);
              f.cache->PostDirective(Directive(s.request_id, s.iteration - (rng() % 5 == 0), target,
                                               {static_cast<uint32_t>(rng() % kExperts),
                                                static_cast<uint32_t>(rng() % kExperts)},
                                               static_cast<float>(rng() % 100) / 10.0f));
            }
            if (rng() % 3 == 0) {
              f.cache->Prefetch(static_cast<uint32_t>(rng() % kLayers),
                                static_cast<uint32_t>(rng() % kExperts), rng() % 10);
            }
            if (l + 1 < kLayers && f.cache->speculation_distance() > 0) {
              std::vector<float> probs(kExperts, 0.0f);
              probs[rng() % kExperts] = 1.0f;
              f.cache->Speculate(l, l + 1, probs);
            }
            f.link.Step(rng() % 3);
            f.cache->Pump();
            ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
            std::vector<uint32_t> experts;
            const int picks = 1 + static_cast<int>(rng() % 4);
            for (int p = 0; p < picks; ++p) experts.push_back(rng() % kExperts);
            f.RunLayer(l, experts);
            if (::testing::Test::HasFatalFailure()) {
              FAIL() << policy << " slots " << slots << " world " << world << " it " << it;
            }
          }
          f.cache->EndIteration();
          for (SequenceInfo& s : batch) ++s.iteration;
          ASSERT_TRUE(f.cache->CheckInvariants().ok());
          // One device budget with the KV pool: slots are lent between iterations (the KV
          // pool writes them) and come back; no load may write a lent slot meanwhile.
          if (rng() % 3 == 0) {
            if (std::optional<uint32_t> slot = f.cache->LendSlot(1)) {
              std::memset(f.device.data() + *slot * kBytes, 0x5a, kBytes);
              lent.push_back(*slot);
            } else {
              EXPECT_LE(f.cache->active_slots(), 1u);
            }
          } else if (rng() % 3 == 0 && !lent.empty()) {
            const uint32_t slot = lent.back();
            lent.pop_back();
            const std::vector<char> marker(kBytes, 0x5a);
            ASSERT_EQ(0, std::memcmp(f.device.data() + slot * kBytes, marker.data(), kBytes))
                << "a load wrote lent slot " << slot;
            f.cache->ReturnSlot(slot);
          }
          ASSERT_TRUE(f.cache->CheckInvariants().ok()) << f.cache->CheckInvariants().ToString();
          ASSERT_EQ(f.cache->lent_slots(), lent.size());
        }
        const CacheStats st = f.cache->stats();
        EXPECT_LE(st.resident, st.slots);
        EXPECT_GT(st.total.hits + st.total.misses, 0u);
        // Every expert resident for good streams nothing.
        if (slots < owned) {
          EXPECT_GT(st.stream_iterations, 0u);
        }
      }
    }
  }
}

// Hybrid execution with admission under random layers, directives and host speeds: the
// invariants hold and every handed-out slot holds its expert's bytes, for every policy.
TEST(ExpertCache, RandomHybridSequencesKeepInvariantsForEveryPolicy) {
  uint64_t admitted = 0;
  for (const char* policy :
       {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand", "lru", "lfu"}) {
    for (uint32_t slots : {1u, 3u, 8u}) {
      Fixture f(policy, slots, 0, 1, /*preload=*/slots > 4, /*inflight=*/2, /*hybrid=*/true,
                /*admit=*/true);
      std::mt19937 rng(slots * 977 + 5);
      SequenceInfo s{1, 0, 1};
      for (int it = 0; it < 30; ++it) {
        f.cache->BeginIteration({&s, 1});
        for (uint32_t l = 0; l < kLayers; ++l) {
          if (rng() % 2 == 0) {
            f.cache->PostDirective(Directive(1, s.iteration, static_cast<uint32_t>(rng() % kLayers),
                                             {static_cast<uint32_t>(rng() % kExperts)}));
          }
          f.link.Step(rng() % 3);
          f.cache->Pump();
          std::vector<uint32_t> experts;
          const int picks = 1 + static_cast<int>(rng() % 3);
          for (int p = 0; p < picks; ++p) experts.push_back(rng() % kExperts);
          std::sort(experts.begin(), experts.end());
          experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
          f.RunHybridLayer(l, experts, rng() % 2 == 0 ? 300 : 3000);
          if (::testing::Test::HasFailure()) FAIL() << policy << " slots " << slots << " it " << it;
        }
        f.cache->EndIteration();
        ++s.iteration;
      }
      const CacheStats st = f.cache->stats();
      EXPECT_LE(st.resident, st.slots);
      EXPECT_GT(st.total.host_runs, 0u) << policy << " slots " << slots;
      admitted += st.total.host_runs_admitted;
    }
  }
  EXPECT_GT(admitted, 0u);
}

}  // namespace
}  // namespace fmoe
