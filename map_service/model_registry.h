// The models the map service holds (service thread only): per model fingerprint its shape, its
// in-memory MapStore and the maps waiting for their write (ModelMaps), and the stored models
// that were not loaded at start (NotLoaded). A new model's store is sized by store_capacity and
// must fit in what memory_limit_mb leaves; it is built whole before it is published, so a
// refusal or a failed allocation leaves nothing behind.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "map_service/map_service_options.h"
#include "map_service/map_store.h"
#include "map_service/store_db.h"

namespace fmoe {

struct ImportState;  // map_writes.h

// A map on its way to the store writer: completed from a rank's contexts, or read by an import.
struct PendingMap {
  MapRow row;
  std::string peer;                     // Gets MapStored; empty for an imported map.
  std::shared_ptr<ImportState> import;  // The import it comes from, or null.
  std::chrono::steady_clock::time_point completed;
};

// One model's store; `store` has a stable address (matchers refer to it). Its maps are written
// one at a time: a map is planned (its row, the entry it replaces) against the store that holds
// every map written before it, so the store only ever holds what is on disk.
struct ModelMaps {
  ModelRow shape;
  std::unique_ptr<MapStore> store;
  uint64_t next_id = 1;
  uint64_t inserted = 0;
  uint64_t replaced = 0;
  bool recorded = false;  // Its model record is on disk.
  int recording = 0;      // Writes in flight that record it (registrations, an import's).
  bool writing = false;   // One of its maps is with the store writer.
  bool dropping = false;  // Its removal is with the store writer (MapWrites::StartDrop).
  uint64_t bytes = 0;     // MapStore::BytesFor its store.
  std::deque<PendingMap> completed;  // From contexts, in completion order.
  std::deque<PendingMap> imported;   // From imports; written while `completed` is empty.
};

// A stored model kept out at start (its shape, or memory_limit_mb); its records stay on disk.
struct NotLoaded {
  ModelRow shape;
  std::string reason;
};

class ModelRegistry {
 public:
  explicit ModelRegistry(const MapServiceOptions& options) : options_(options) {}

  // The model's entry, made (and its store allocated) when new; kInvalidArgument for a shape a
  // store cannot hold, kResourceExhausted past memory_limit_mb or when the allocation fails.
  Result<ModelMaps*> Open(const ModelRow& shape);
  ModelMaps* Find(uint64_t fingerprint);
  const ModelMaps* Find(uint64_t fingerprint) const;
  // A model whose record is on disk (one still being registered is not stored yet); 0: the one
  // stored model, if there is exactly one.
  Result<ModelMaps*> Recorded(uint64_t fingerprint);
  // A model whose record never reached the disk (every write that would record it failed) and
  // that nothing else refers to is forgotten, as if it had never been seen.
  void ForgetIfUnrecorded(uint64_t fingerprint);
  void Erase(uint64_t fingerprint) { models_.erase(fingerprint); }

  void SetNotLoaded(const ModelRow& shape, std::string reason) {
    not_loaded_[shape.fingerprint] = {shape, std::move(reason)};
  }
  const NotLoaded* FindNotLoaded(uint64_t fingerprint) const;
  void EraseNotLoaded(uint64_t fingerprint) { not_loaded_.erase(fingerprint); }

  MapStoreOptions StoreOptions(const ModelRow& shape) const;
  uint64_t memory_used() const;
  uint32_t stored_maps(uint64_t fingerprint) const;

  std::unordered_map<uint64_t, std::unique_ptr<ModelMaps>>& models() { return models_; }
  const std::unordered_map<uint64_t, std::unique_ptr<ModelMaps>>& models() const { return models_; }
  const std::unordered_map<uint64_t, NotLoaded>& not_loaded() const { return not_loaded_; }

 private:
  // The shape is one a store can hold, and the store fits in what memory_limit_mb leaves.
  Status CheckShape(const ModelRow& shape, uint64_t* bytes) const;

  const MapServiceOptions& options_;
  std::unordered_map<uint64_t, std::unique_ptr<ModelMaps>> models_;
  std::unordered_map<uint64_t, NotLoaded> not_loaded_;
};

}  // namespace fmoe
