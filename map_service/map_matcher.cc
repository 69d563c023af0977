#include "map_service/map_matcher.h"

#include <algorithm>
#include <cmath>

namespace fmoe {

MapMatcher::MapMatcher(MapStore& store, MatcherOptions options) : store_(store), options_(options) {
  options_.prefetch_distance =
      std::clamp<uint32_t>(options_.prefetch_distance, 1, store_.options().num_layers);
}

PrefetchDirective MapMatcher::Direct(uint64_t request, uint32_t iteration, uint32_t target,
                                     int32_t current, const MapMatch& match) const {
  PrefetchDirective d;
  d.request_id = request;
  d.iteration = iteration;
  d.target_layer = target;
  d.score = match.score;
  const auto probs = store_.map_layer(static_cast<uint32_t>(match.index), target);
  // Without delta (the fmoe-traj-sem ablation) the selection is exactly the top-k.
  const float score = options_.delta ? match.score : 1.0f;
  d.entries = SelectExperts(probs, score, store_.options().top_k, target, current);
  return d;
}

void MapMatcher::OnIterationStart(const IterationStart& m, std::vector<PrefetchDirective>* out) {
  const MapStoreOptions& shape = store_.options();
  if (m.sem.size() != shape.hidden ||
      !std::all_of(m.sem.begin(), m.sem.end(), [](float x) { return std::isfinite(x); })) {
    ++counters_.invalid;
    return;
  }
  auto it = requests_.find(m.request_id);
  if (it == requests_.end()) {
    if (requests_.size() >= options_.max_requests) {
      ++counters_.refused;
      return;
    }
    it = requests_.emplace(m.request_id, Request{}).first;
  }
  Request& r = it->second;
  r.iteration = m.iteration;
  r.sem = m.sem;
  r.map.assign(static_cast<size_t>(shape.num_layers) * shape.num_experts, 0.0f);
  r.observed = 0;
  r.ended = false;
  store_.BeginTrajectory(&r.trajectory);
  if (!options_.semantic || store_.size() == 0) return;
  const MapMatch match = store_.SemanticMatch(m.sem);
  if (match.index < 0) return;
  for (uint32_t target = 0; target < options_.prefetch_distance; ++target) {
    out->push_back(Direct(m.request_id, m.iteration, target, -1, match));
    ++counters_.directives;
  }
}

void MapMatcher::OnLayerObserved(const LayerObserved& m, std::vector<PrefetchDirective>* out) {
  const MapStoreOptions& shape = store_.options();
  auto it = requests_.find(m.request_id);
  if (it == requests_.end() || it->second.iteration != m.iteration || it->second.ended ||
      m.layer != it->second.observed || m.layer >= shape.num_layers ||
      m.probs.size() != shape.num_experts ||
      !std::all_of(m.probs.begin(), m.probs.end(), [](float x) { return std::isfinite(x); })) {
    ++counters_.invalid;
    return;
  }
  Request& r = it->second;
  std::copy(m.probs.begin(), m.probs.end(),
            r.map.begin() + static_cast<size_t>(m.layer) * shape.num_experts);
  r.observed = m.layer + 1;
  const MapMatch match = store_.ObserveLayer(&r.trajectory, m.probs);
  const uint32_t target = m.layer + options_.prefetch_distance;
  if (match.index < 0 || target >= shape.num_layers) return;
  out->push_back(Direct(m.request_id, m.iteration, target, static_cast<int32_t>(m.layer), match));
  ++counters_.directives;
}

std::optional<CompletedMap> MapMatcher::OnIterationEnd(const IterationEnd& m) {
  auto it = requests_.find(m.request_id);
  if (it == requests_.end() || it->second.iteration != m.iteration) {
    ++counters_.invalid;
    if (m.finished && it != requests_.end()) requests_.erase(it);
    return std::nullopt;
  }
  std::optional<CompletedMap> done;
  Request& r = it->second;
  if (r.ended) {
    if (m.finished) {
      requests_.erase(it);
    } else {
      ++counters_.invalid;  // The same iteration ended twice.
    }
    return std::nullopt;
  }
  r.ended = true;
  if (r.observed == store_.options().num_layers) {
    done = CompletedMap{m.request_id, m.iteration, r.sem, r.map};
    ++counters_.completed;
  } else {
    ++counters_.incomplete;
  }
  r.observed = 0;
  if (m.finished) requests_.erase(it);
  return done;
}

void MapMatcher::Forget(uint64_t request_id) { requests_.erase(request_id); }

}  // namespace fmoe
