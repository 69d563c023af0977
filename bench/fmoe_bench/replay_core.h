// The policy replay (DESIGN section 11): runs a recorded trace through the real expert cache
// (gpu_worker/cache/expert_cache.h) with a policy, over a simulated link (sim_link.h), with the map
// store and matcher the map service runs (map_service/) for the fmoe policies. One request at a
// time, in trace order; each layer computes for `layer_ns`, each expert load occupies the link
// for `load_ns`, and a layer starts when every expert it needs is resident (a prefetch still on
// the link then is a miss that stalls for its remaining time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/expert_trace.h"
#include "common/status.h"
#include "map_service/map_store.h"

namespace fmoe::bench {

// The cache moves these many bytes per expert in a replay; the link's time per expert does not
// depend on them, and the reports scale expert counts to real sizes.
inline constexpr size_t kNominalExpertBytes = 64;

// An iteration's semantic vector for the map store: the trace's, or {1} for a trace without one.
std::vector<float> SemOf(const TraceHeader& h, const TraceIteration& it);

// The map store of a replay of `h`'s model.
MapStoreOptions StoreOptions(const TraceHeader& h, uint32_t capacity, uint32_t distance);

// A trace's iterations grouped by request, in the order requests first appear.
struct TraceRequests {
  const Trace* trace = nullptr;
  std::vector<std::vector<uint32_t>> requests;  // Indices into trace->iterations.
};
TraceRequests GroupByRequest(const Trace& trace);

struct ReplayConfig {
  std::string policy;            // A MakePolicy name (cache_policy.h), oracle included.
  double budget = 0.25;          // Fraction of the L * J experts the cache holds, (0, 1].
  uint32_t distance = 3;         // Prefetch distance d.
  bool online = false;           // Store starts empty (online) or warmed (offline).
  int64_t layer_ns = 842'000;    // One layer's compute.
  int64_t load_ns = 11'010'000;  // One expert over the link.
  uint32_t store_capacity = 1000;
  uint32_t max_inflight_prefetches = 2;
};

struct ReplayResult {
  ReplayConfig config;
  uint64_t tokens = 0;      // Tokens of the measured requests.
  uint64_t iterations = 0;  // Measured iterations.
  uint64_t hits = 0, misses = 0, late_prefetches = 0;
  uint64_t on_demand_loads = 0, prefetches_issued = 0, prefetches_used = 0;
  uint64_t prefetches_wasted = 0, prefetches_cancelled = 0;
  uint64_t loads = 0;       // Experts moved (on-demand + prefetch), whole or partial.
  double stall_ns = 0;      // Compute waiting for experts.
  double total_ns = 0;      // Simulated time of the measured requests.
  uint64_t directives = 0;  // Map-service directives applied (fmoe policies).
  double match_score = 0;   // Mean similarity of the matched maps (fmoe policies).
  double wall_s = 0;        // Host time the replay took.

  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0; }
  // Prefetched experts a layer used, over prefetches handed to the link.
  double precision() const {
    return prefetches_issued ? double(prefetches_used) / double(prefetches_issued) : 0;
  }
  // Loads a prefetch covered (in time or late), over every load a layer needed.
  double recall() const {
    const uint64_t needed = prefetches_used + on_demand_loads;
    return needed ? double(prefetches_used) / double(needed) : 0;
  }
};

// Runs the `train` requests first when offline (prediction state and caches warm; not
// measured), then measures the `test` requests. `warm_store` (offline fmoe policies): the store
// after inserting the train split's maps at this distance; copied, not changed. kInvalidArgument
// for a bad config.
Result<ReplayResult> RunReplay(const TraceRequests& requests, const std::vector<uint32_t>& train,
                               const std::vector<uint32_t>& test, const ReplayConfig& config,
                               const MapStore* warm_store);

// The store a map service would hold after the `train` requests: every iteration's map inserted
// in order (deduplicated when full). hidden 0 traces get a constant 1-float embedding.
Result<MapStore> WarmStore(const TraceRequests& requests, const std::vector<uint32_t>& train,
                           uint32_t capacity, uint32_t distance);

bool UsesMapService(const std::string& policy);

}  // namespace fmoe::bench
