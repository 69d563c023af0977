// Matching for one model (DESIGN section 5, fMoE sections 4.3-4.4): keeps each in-flight
// request's iteration context (its semantic embedding, the gate distributions observed so far,
// its trajectory search state), turns every IterationStart and LayerObserved into prefetch
// directives from the MapStore, and hands the completed map back at IterationEnd for the store.
// Owned by the map service thread with its MapStore; not thread-safe.
//
// A request's iteration: IterationStart (semantic search -> directives for layers 0..d-1)
//   -> LayerObserved l = 0..L-1 in order (trajectory search -> a directive for layer l+d)
//   -> IterationEnd (the map is complete if every layer was observed; state freed when the
//      request finished, or on Forget when its rank stops heartbeating or it is cancelled).
// A second IterationEnd for an iteration that already ended, with `finished`, only frees the
// request (a worker reports the end of a request after its last iteration).
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/wire/messages.h"
#include "map_service/map_store.h"

namespace fmoe {

struct MatcherOptions {
  uint32_t prefetch_distance = 3;  // d, 1..L. Default: 3
  bool semantic = true;  // Semantic search at iteration start (off: fmoe-traj). Default: on
  bool delta = true;     // Similarity-aware selection (off: exactly top-k). Default: on
  uint32_t max_requests = 65536;  // In-flight requests tracked; more are refused. Default: 65536
};

struct MatcherCounters {
  uint64_t directives = 0;
  uint64_t invalid = 0;  // Wrong length, layer out of range or out of order, unknown request.
  uint64_t refused = 0;  // New requests beyond max_requests.
  uint64_t completed = 0;
  uint64_t incomplete = 0;  // IterationEnd before every layer was observed.
};

// A finished iteration's context, ready to insert into the store.
struct CompletedMap {
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  std::vector<float> sem;  // h
  std::vector<float> map;  // L x J
};

class MapMatcher {
 public:
  MapMatcher(MapStore& store, MatcherOptions options);

  // Appends the directives to send (possibly none) to `out`.
  void OnIterationStart(const IterationStart& m, std::vector<PrefetchDirective>* out);
  void OnLayerObserved(const LayerObserved& m, std::vector<PrefetchDirective>* out);
  // The iteration's map when every layer was observed.
  std::optional<CompletedMap> OnIterationEnd(const IterationEnd& m);
  void Forget(uint64_t request_id);

  size_t in_flight() const { return requests_.size(); }
  const MatcherCounters& counters() const { return counters_; }

 private:
  struct Request {
    uint32_t iteration = 0;
    std::vector<float> sem;
    std::vector<float> map;
    uint32_t observed = 0;  // Layers 0..observed-1 are in `map`.
    bool ended = false;     // IterationEnd seen for `iteration`.
    Trajectory trajectory;
  };
  PrefetchDirective Direct(uint64_t request, uint32_t iteration, uint32_t target, int32_t current,
                           const MapMatch& match) const;

  MapStore& store_;
  MatcherOptions options_;
  std::unordered_map<uint64_t, Request> requests_;
  MatcherCounters counters_;
};

}  // namespace fmoe
