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

ExpertTable CloneExpertTable(const ExpertTable& table) {
  ExpertTable copy(table.size());
  for (size_t l = 0; l < table.size(); ++l) {
    for (const ExpertWeights& w : table[l]) {
      copy[l].push_back({w.w1.defined() ? w.w1.clone() : at::Tensor(),
                         w.w2.defined() ? w.w2.clone() : at::Tensor(),
                         w.w3.defined() ? w.w3.clone() : at::Tensor()});
    }
  }
  return copy;
}

Status ResidentExperts::BeginLayer(const LayerRouting& routing) {
  if (routing.layer >= experts_.size()) {
    return Internal("expert source: layer " + std::to_string(routing.layer) + " of " +
                    std::to_string(experts_.size()));
  }
  layer_ = routing.layer;
  pending_.assign(routing.experts.rbegin(), routing.experts.rend());
  for (uint32_t e : pending_) {
    if (e >= experts_[layer_].size()) {
      return Internal("expert source: no expert " + std::to_string(e) + " in layer " +
                      std::to_string(layer_));
    }
  }
  return Status::Ok();
}

Result<std::pair<uint32_t, ExpertWeights>> ResidentExperts::Next() {
  if (pending_.empty()) return NotFound("expert source: layer done");
  const uint32_t e = pending_.back();
  pending_.pop_back();
  return std::pair<uint32_t, ExpertWeights>(e, experts_[layer_][e]);
}

}  // namespace fmoe
