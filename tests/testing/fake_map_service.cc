#include "tests/testing/fake_map_service.h"

#include <algorithm>
#include <utility>

namespace fmoe::testing {

FakeMapService::FakeMapService(std::vector<CachedExperts*> targets, uint32_t layers, size_t experts)
    : targets_(std::move(targets)), layers_(layers), experts_(experts) {}

FakeMapService::FakeMapService(CachedExperts* target, uint32_t layers, size_t experts)
    : FakeMapService(
          target == nullptr ? std::vector<CachedExperts*>{} : std::vector<CachedExperts*>{target},
          layers, experts) {}

void FakeMapService::OnLayerGates(uint64_t id, uint32_t iteration, uint32_t layer,
                                  std::span<const float> probs) {
  if (targets_.empty() || layer + 2 >= layers_) return;
  std::vector<uint32_t> order(probs.size());
  for (uint32_t j = 0; j < order.size(); ++j) order[j] = j;
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return probs[a] > probs[b]; });
  PrefetchDirective d;
  d.request_id = id;
  d.iteration = iteration;
  d.target_layer = layer + 2;
  d.score = 0.5f;
  for (size_t i = 0; i < experts_ && i < order.size(); ++i) {
    d.entries.push_back({order[i], probs[order[i]], probs[order[i]] / 2});
  }
  for (CachedExperts* target : targets_) target->PostDirective(d);
}

}  // namespace fmoe::testing
