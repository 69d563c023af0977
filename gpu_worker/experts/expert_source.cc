#include "gpu_worker/experts/expert_source.h"

#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fmoe {

size_t ExpertWeights::bytes() const {
  size_t total = 0;
  for (const at::Tensor* t : Tensors())
    total += static_cast<size_t>(t->numel()) * t->element_size();
  return total;
}

std::array<at::Tensor*, kExpertPlaces> ExpertWeights::Places() {
  return {&w1, &q[0].scale, &q[0].zero, &q[0].g_idx, &q[0].bias,
          &w3, &q[2].scale, &q[2].zero, &q[2].g_idx, &q[2].bias,
          &w2, &q[1].scale, &q[1].zero, &q[1].g_idx, &q[1].bias};
}

std::vector<at::Tensor*> ExpertWeights::Tensors() {
  std::vector<at::Tensor*> out;
  for (at::Tensor* t : Places()) {
    if (t->defined()) out.push_back(t);
  }
  return out;
}

std::vector<const at::Tensor*> ExpertWeights::Tensors() const {
  std::vector<const at::Tensor*> out;
  for (at::Tensor* t : const_cast<ExpertWeights*>(this)->Tensors()) out.push_back(t);
  return out;
}

namespace {

at::Tensor HostCopy(const at::Tensor& t) {
  if (!t.defined()) return {};
  if (t.is_meta()) return t;  // An expert left on disk: shapes only, nothing to copy.
  return t.is_cpu() ? t.clone() : t.to(at::kCPU);
}

}  // namespace

ExpertTable CloneExpertTable(const ExpertTable& table) {
  ExpertTable copy(table.size());
  for (size_t l = 0; l < table.size(); ++l) {
    for (const ExpertWeights& w : table[l]) {
      ExpertWeights c = w;
      for (at::Tensor* t : c.Tensors()) *t = HostCopy(*t);
      copy[l].push_back(std::move(c));
    }
  }
  return copy;
}

Result<std::unique_ptr<ResidentExperts>> ResidentExperts::Create(ExpertTable experts,
                                                                 int cuda_index) {
  for (const auto& layer : experts) {
    for (const ExpertWeights& w : layer) {
      if (w.disk != nullptr) {
        return InvalidArgument(
            "resident experts: the experts were left on disk; every expert resident needs them "
            "loaded (no host_cache_gb)");
      }
    }
  }
  if (cuda_index >= 0) {
    const at::Device device(at::kCUDA, static_cast<at::DeviceIndex>(cuda_index));
    size_t bytes = 0;
    try {
      for (auto& layer : experts) {
        for (ExpertWeights& w : layer) {
          for (at::Tensor* t : w.Tensors()) *t = t->to(device);
          bytes += w.bytes();
        }
      }
    } catch (const c10::Error& e) {
      return ResourceExhausted(
          "resident experts: cannot place every expert on cuda:" + std::to_string(cuda_index) +
          " (" + std::to_string(bytes) + " bytes placed): " + e.what_without_backtrace() +
          "; serve with an expert cache instead");
    }
  }
  return std::make_unique<ResidentExperts>(std::move(experts));
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

Result<SourcedExpert> ResidentExperts::Next() {
  if (pending_.empty()) return NotFound("expert source: layer done");
  const uint32_t e = pending_.back();
  pending_.pop_back();
  return SourcedExpert{e, experts_[layer_][e], Status::Ok()};
}

}  // namespace fmoe
