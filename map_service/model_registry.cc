#include "map_service/model_registry.h"

#include <new>
#include <string>
#include <vector>

#include "common/model/model_config.h"

namespace fmoe {

MapStoreOptions ModelRegistry::StoreOptions(const ModelRow& shape) const {
  MapStoreOptions o;
  o.num_layers = shape.num_layers;
  o.num_experts = shape.num_experts;
  o.top_k = shape.top_k;
  o.hidden = shape.hidden_size;
  o.capacity = static_cast<uint32_t>(options_.store_capacity);
  o.prefetch_distance = static_cast<uint32_t>(options_.prefetch_distance);
  return o;
}

uint64_t ModelRegistry::memory_used() const {
  uint64_t used = 0;
  for (const auto& [fp, model] : models_) used += model->bytes;
  return used;
}

Status ModelRegistry::CheckShape(const ModelRow& shape, uint64_t* bytes) const {
  const std::string text =
      "L=" + std::to_string(shape.num_layers) + " J=" + std::to_string(shape.num_experts) +
      " K=" + std::to_string(shape.top_k) + " h=" + std::to_string(shape.hidden_size);
  if (shape.num_layers == 0 || shape.num_experts == 0 || shape.hidden_size == 0 ||
      shape.top_k == 0 || shape.top_k > shape.num_experts) {
    return InvalidArgument("model shape " + text + " is not valid");
  }
  *bytes = MapStore::BytesFor(StoreOptions(shape));
  const uint64_t limit = options_.memory_limit_mb << 20;
  const uint64_t used = memory_used();
  if (*bytes > limit || used + *bytes > limit) {
    return ResourceExhausted("model " + FingerprintHex(shape.fingerprint) + " (" + text +
                             ") needs " + std::to_string((*bytes + (1 << 20) - 1) >> 20) +
                             " MiB for store_capacity " + std::to_string(options_.store_capacity) +
                             " maps; " + std::to_string(used >> 20) +
                             " MiB of map_service.memory_limit_mb " +
                             std::to_string(options_.memory_limit_mb) + " are in use");
  }
  return Status::Ok();
}

Result<ModelMaps*> ModelRegistry::Open(const ModelRow& shape) {
  if (auto it = models_.find(shape.fingerprint); it != models_.end()) return it->second.get();
  uint64_t bytes = 0;
  FMOE_RETURN_IF_ERROR(CheckShape(shape, &bytes));
  std::unique_ptr<ModelMaps> model;
  try {
    FMOE_ASSIGN_OR_RETURN(MapStore store, MapStore::Create(StoreOptions(shape)));
    model = std::make_unique<ModelMaps>();
    model->shape = shape;
    model->bytes = bytes;
    model->store = std::make_unique<MapStore>(std::move(store));
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("model " + FingerprintHex(shape.fingerprint) + ": its store (" +
                             std::to_string(bytes >> 20) + " MiB) cannot be allocated");
  }
  ModelMaps* out = model.get();
  models_.emplace(shape.fingerprint, std::move(model));
  return out;
}

uint32_t ModelRegistry::stored_maps(uint64_t fingerprint) const {
  auto it = models_.find(fingerprint);
  return it == models_.end() ? 0 : it->second->store->size();
}

void ModelRegistry::ForgetIfUnrecorded(uint64_t fingerprint) {
  auto it = models_.find(fingerprint);
  if (it == models_.end()) return;
  const ModelMaps& m = *it->second;
  if (!m.recorded && m.recording == 0 && !m.writing && m.completed.empty() && m.imported.empty() &&
      m.store->size() == 0) {
    models_.erase(it);
  }
}

Result<ModelMaps*> ModelRegistry::Recorded(uint64_t fingerprint) {
  if (fingerprint == 0) {
    std::vector<ModelMaps*> recorded;
    for (auto& [fp, model] : models_) {
      if (model->recorded) recorded.push_back(model.get());
    }
    if (recorded.size() == 1) return recorded[0];
    if (recorded.empty()) return NotFound("no model is stored");
    return InvalidArgument(std::to_string(recorded.size()) +
                           " models are stored; name one by its fingerprint");
  }
  auto it = models_.find(fingerprint);
  if (it == models_.end() || !it->second->recorded) {
    return NotFound("model " + FingerprintHex(fingerprint) + " is not stored");
  }
  return it->second.get();
}

ModelMaps* ModelRegistry::Find(uint64_t fingerprint) {
  auto it = models_.find(fingerprint);
  return it == models_.end() ? nullptr : it->second.get();
}

const ModelMaps* ModelRegistry::Find(uint64_t fingerprint) const {
  auto it = models_.find(fingerprint);
  return it == models_.end() ? nullptr : it->second.get();
}

const NotLoaded* ModelRegistry::FindNotLoaded(uint64_t fingerprint) const {
  auto it = not_loaded_.find(fingerprint);
  return it == not_loaded_.end() ? nullptr : &it->second;
}

}  // namespace fmoe
