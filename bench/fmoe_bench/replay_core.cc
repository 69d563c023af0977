#include "bench/fmoe_bench/replay_core.h"

#include <chrono>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "bench/fmoe_bench/sim_link.h"
#include "common/clock.h"
#include "gpu_worker/cache/expert_cache.h"
#include "gpu_worker/cache/policies/cache_policy.h"
#include "gpu_worker/cache/policies/policy_factory.h"
#include "map_service/map_matcher.h"

namespace fmoe::bench {

std::vector<float> SemOf(const TraceHeader& h, const TraceIteration& it) {
  return h.hidden > 0 ? it.sem : std::vector<float>{1.0f};
}

MapStoreOptions StoreOptions(const TraceHeader& h, uint32_t capacity, uint32_t distance) {
  MapStoreOptions o;
  o.num_layers = h.num_layers;
  o.num_experts = h.num_experts;
  o.top_k = h.top_k;
  o.hidden = h.hidden > 0 ? h.hidden : 1;
  o.capacity = capacity;
  o.prefetch_distance = distance;
  return o;
}

bool UsesMapService(const std::string& policy) {
  return policy == "fmoe" || policy == "fmoe-traj" || policy == "fmoe-traj-sem" ||
         policy == "fmoe-pfreq" || policy == "fmoe-nextuse";
}

TraceRequests GroupByRequest(const Trace& trace) {
  TraceRequests out;
  out.trace = &trace;
  std::unordered_map<uint64_t, uint32_t> index;
  for (uint32_t i = 0; i < trace.iterations.size(); ++i) {
    auto [it, inserted] = index.try_emplace(trace.iterations[i].request_id,
                                            static_cast<uint32_t>(out.requests.size()));
    if (inserted) out.requests.emplace_back();
    out.requests[it->second].push_back(i);
  }
  return out;
}

Result<MapStore> WarmStore(const TraceRequests& requests, const std::vector<uint32_t>& train,
                           uint32_t capacity, uint32_t distance) {
  const Trace& trace = *requests.trace;
  FMOE_ASSIGN_OR_RETURN(MapStore store,
                        MapStore::Create(StoreOptions(trace.header, capacity, distance)));
  std::vector<float> map;
  uint64_t id = 1;
  for (uint32_t r : train) {
    for (uint32_t i : requests.requests.at(r)) {
      const TraceIteration& it = trace.iterations[i];
      it.FillMap(trace.header, &map);
      FMOE_ASSIGN_OR_RETURN(auto inserted, store.Insert(id++, SemOf(trace.header, it), map));
      (void)inserted;
    }
  }
  return store;
}

Result<ReplayResult> RunReplay(const TraceRequests& requests, const std::vector<uint32_t>& train,
                               const std::vector<uint32_t>& test, const ReplayConfig& config,
                               const MapStore* warm_store) {
  const auto wall_start = std::chrono::steady_clock::now();
  const Trace& trace = *requests.trace;
  const TraceHeader& h = trace.header;
  const uint32_t L = h.num_layers, J = h.num_experts;
  if (!(config.budget > 0.0 && config.budget <= 1.0)) {
    return InvalidArgument("budget " + std::to_string(config.budget) + " is not in (0, 1]");
  }
  if (config.distance < 1 || config.distance > L) {
    return InvalidArgument("prefetch distance " + std::to_string(config.distance) +
                           " is not in 1.." + std::to_string(L));
  }
  if (config.layer_ns <= 0 || config.load_ns <= 0) {
    return InvalidArgument("layer and load times must be positive");
  }
  const bool fmoe = UsesMapService(config.policy);
  const bool oracle = config.policy == "oracle";
  const bool warm = !config.online && !oracle;
  if (fmoe && warm && warm_store == nullptr) {
    return InvalidArgument("offline replay of " + config.policy + " needs a warmed store");
  }

  // The oracle knows the measured requests' accesses in order.
  PolicyOptions po;
  po.prefetch_distance = config.distance;
  if (oracle) {
    for (uint32_t r : test) {
      for (uint32_t i : requests.requests.at(r)) {
        const TraceIteration& it = trace.iterations[i];
        for (uint32_t l = 0; l < L; ++l) {
          auto used = it.used(l);
          po.future.push_back(LayerAccess{l, std::vector<uint32_t>(used.begin(), used.end())});
        }
      }
    }
  }
  FMOE_ASSIGN_OR_RETURN(auto policy, MakePolicy(config.policy, po));

  const uint32_t owned = L * J;
  FMOE_ASSIGN_OR_RETURN(uint32_t slots,
                        BudgetSlots(std::nullopt, config.budget, kNominalExpertBytes, owned));
  std::vector<char> host(static_cast<size_t>(owned) * kNominalExpertBytes);
  std::vector<const void*> host_ptrs(owned);
  for (uint32_t k = 0; k < owned; ++k) host_ptrs[k] = host.data() + k * kNominalExpertBytes;

  ManualClock clock(0);
  SimLink link(clock, config.load_ns);
  FMOE_ASSIGN_OR_RETURN(void* slot_memory, link.AllocateDevice(slots * kNominalExpertBytes));
  struct Free {
    SimLink* link;
    void* p;
    ~Free() { link->FreeDevice(p); }
  } free_slots{&link, slot_memory};
  ExpertCacheOptions co;
  co.num_layers = L;
  co.num_experts = J;
  co.top_k = h.top_k;
  co.expert_bytes = kNominalExpertBytes;
  co.slots = slots;
  co.max_inflight_prefetches = config.max_inflight_prefetches;
  co.preload = true;
  FMOE_ASSIGN_OR_RETURN(auto cache, ExpertCache::Create(co, std::move(policy), &link,
                                                        std::move(host_ptrs), slot_memory, clock));

  std::optional<MapStore> store;
  std::unique_ptr<MapMatcher> matcher;
  if (fmoe) {
    if (warm) {
      store.emplace(*warm_store);
    } else {
      FMOE_ASSIGN_OR_RETURN(MapStore empty, MapStore::Create(StoreOptions(h, config.store_capacity,
                                                                          config.distance)));
      store.emplace(std::move(empty));
    }
    MatcherOptions mo;
    mo.prefetch_distance = config.distance;
    mo.semantic = config.policy != "fmoe-traj" && h.hidden > 0;
    mo.delta = config.policy != "fmoe-traj-sem";
    matcher = std::make_unique<MapMatcher>(*store, mo);
  }

  ReplayResult result;
  result.config = config;
  uint64_t next_map_id = 1'000'000'000;
  double score_sum = 0;
  uint64_t score_count = 0;
  std::vector<PrefetchDirective> directives;
  std::vector<float> map, probs(J);
  std::vector<uint32_t> experts, tokens, sequence_counts(J);
  auto post = [&] {
    for (PrefetchDirective& d : directives) {
      score_sum += d.score;
      ++score_count;
      cache->PostDirective(std::move(d));
    }
    directives.clear();
  };

  // One request, iteration by iteration, layer by layer; `match`: ask the map service.
  auto run = [&](uint32_t r, bool match) -> Status {
    const auto& its = requests.requests.at(r);
    const uint64_t rid = trace.iterations[its.front()].request_id;
    for (uint32_t i : its) {
      const TraceIteration& it = trace.iterations[i];
      const SequenceInfo seq{rid, it.iteration, it.tokens};
      cache->BeginIteration(std::span<const SequenceInfo>(&seq, 1));
      if (match) {
        it.FillMap(h, &map);
        matcher->OnIterationStart(IterationStart{rid, it.iteration, SemOf(h, it)}, &directives);
        post();
      }
      cache->Pump();
      const uint32_t speculate = cache->speculation_distance();
      for (uint32_t l = 0; l < L; ++l) {
        if (speculate > 0) {
          for (const TraceSpeculation& sp : it.speculation) {
            if (sp.layer != l || sp.target > l + speculate) continue;
            std::fill(probs.begin(), probs.end(), 0.0f);
            for (size_t e = 0; e < sp.experts.size(); ++e) probs[sp.experts[e]] = sp.fractions[e];
            cache->Speculate(l, sp.target, probs);
          }
        }
        auto used = it.used(l);
        auto counts = it.used_counts(l);
        experts.assign(used.begin(), used.end());
        tokens.assign(counts.begin(), counts.end());
        std::fill(sequence_counts.begin(), sequence_counts.end(), 0);
        for (size_t e = 0; e < used.size(); ++e) sequence_counts[used[e]] = counts[e];
        FMOE_RETURN_IF_ERROR(cache->BeginLayer(LayerRouting{l, experts, tokens, sequence_counts}));
        if (match) {
          const float* row = map.data() + static_cast<size_t>(l) * J;
          matcher->OnLayerObserved(
              LayerObserved{rid, it.iteration, l, std::vector<float>(row, row + J)}, &directives);
          post();
        }
        while (true) {
          auto ready = cache->Next();
          if (!ready.ok()) {
            if (ready.status().code() == ErrorCode::kNotFound) break;
            return ready.status();
          }
          if (!ready->error.ok()) return ready->error;  // The replay's links never fail a load.
          cache->Done(ready->expert);
        }
        clock.AdvanceNs(config.layer_ns);
        cache->EndLayer();
      }
      cache->EndIteration();
      if (match) {
        auto done = matcher->OnIterationEnd(IterationEnd{rid, it.iteration, it.last});
        if (done) {
          FMOE_ASSIGN_OR_RETURN(auto inserted, store->Insert(next_map_id++, done->sem, done->map));
          (void)inserted;
        }
      }
    }
    cache->OnRequestEnd(rid);
    return Status::Ok();
  };

  if (warm) {
    // The train split warms the caches, frequency counts and EAM collections; the fmoe
    // policies' store is already warm, so their directives are not computed here.
    for (uint32_t r : train) FMOE_RETURN_IF_ERROR(run(r, /*match=*/false));
  }
  // A budget that holds every expert moves nothing and the cache consults no policy: the
  // figures are the same without the map service's work.
  const bool match = fmoe && slots < owned;
  const CacheStats before = cache->stats();
  const int64_t start_ns = clock.NowNs();
  for (uint32_t r : test) {
    FMOE_RETURN_IF_ERROR(run(r, match));
    for (uint32_t i : requests.requests.at(r)) {
      result.tokens += trace.iterations[i].tokens;
      ++result.iterations;
    }
  }
  const CacheStats after = cache->stats();
  const CacheCounters& a = after.total;
  const CacheCounters& b = before.total;
  result.hits = a.hits - b.hits;
  result.misses = a.misses - b.misses;
  result.late_prefetches = a.late_prefetches - b.late_prefetches;
  result.on_demand_loads = a.on_demand_loads - b.on_demand_loads;
  result.prefetches_issued = a.prefetches_issued - b.prefetches_issued;
  result.prefetches_used = a.prefetches_used - b.prefetches_used;
  result.prefetches_wasted = a.prefetches_wasted - b.prefetches_wasted;
  result.prefetches_cancelled = a.prefetches_cancelled - b.prefetches_cancelled;
  result.loads = result.on_demand_loads + result.prefetches_issued;
  result.stall_ns = static_cast<double>(a.stall_ns - b.stall_ns);
  result.total_ns = static_cast<double>(clock.NowNs() - start_ns);
  result.directives = after.directives - before.directives;
  result.match_score = score_count ? score_sum / static_cast<double>(score_count) : 0.0;
  FMOE_RETURN_IF_ERROR(cache->CheckInvariants());
  result.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace fmoe::bench
