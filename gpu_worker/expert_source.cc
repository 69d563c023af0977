#include "gpu_worker/expert_source.h"

#include <string>

namespace fmoe {

size_t ExpertWeights::bytes() const {
  size_t total = 0;
  for (const at::Tensor* t : {&w1, &w2, &w3}) {
    if (t->defined()) total += static_cast<size_t>(t->numel()) * t->element_size();
  }
  return total;
}

Status ResidentExperts::BeginLayer(uint32_t layer, std::span<const uint32_t> experts) {
  if (layer >= experts_.size()) {
    return Internal("expert source: layer " + std::to_string(layer) + " of " +
                    std::to_string(experts_.size()));
  }
  return Status::Ok();
}

Result<ExpertWeights> ResidentExperts::Get(uint32_t layer, uint32_t expert) {
  if (layer >= experts_.size() || expert >= experts_[layer].size()) {
    return Internal("expert source: no expert " + std::to_string(expert) + " in layer " +
                    std::to_string(layer));
  }
  return experts_[layer][expert];
}

}  // namespace fmoe
