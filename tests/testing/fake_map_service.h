// A stand-in for the map service in the in-process tests: after each layer's gates it directs a
// prefetch of that layer's most likely experts for the layer two ahead to every cache it serves
// (a crude predictor: the tests using it are about losslessness with prefetches in flight, not
// about their precision).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gpu_worker/experts/cached_experts.h"
#include "gpu_worker/observe/forward_observer.h"

namespace fmoe::testing {

class FakeMapService final : public ForwardObserver {
 public:
  // `targets`: the caches that get every directive (the ranks of a group: each keeps its own
  // experts); `layers`: the model's MoE layers; `experts`: entries per directive.
  FakeMapService(std::vector<CachedExperts*> targets, uint32_t layers, size_t experts = 3);
  // One cache; none when `target` is null.
  FakeMapService(CachedExperts* target, uint32_t layers, size_t experts = 3);

  void OnLayerGates(uint64_t id, uint32_t iteration, uint32_t layer,
                    std::span<const float> probs) override;

 private:
  std::vector<CachedExperts*> targets_;
  uint32_t layers_;
  size_t experts_;
};

}  // namespace fmoe::testing
