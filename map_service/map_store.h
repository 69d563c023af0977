// The expert map store of one model (DESIGN section 5, fMoE sections 4.2-4.4), in memory: up to
// C entries, each a semantic embedding (h floats) and an expert map (L x J floats), kept as two
// contiguous row-major matrices with the norms that matching needs. Semantic search, the
// incremental trajectory search (O(C * J) per observed layer), insert with the redundancy
// deduplication rule, and the similarity-aware expert selection. Torch-free; not thread-safe:
// owned by the map service thread. Persistence is the caller's (store_db.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "common/wire/messages.h"

namespace fmoe {

struct MapStoreOptions {
  uint32_t num_layers = 0;         // L. Required.
  uint32_t num_experts = 0;        // J. Required.
  uint32_t top_k = 0;              // K. Required.
  uint32_t hidden = 0;             // h of the semantic embedding. Required.
  uint32_t capacity = 1000;        // C, 1..1000000. Default: 1000
  uint32_t prefetch_distance = 3;  // d, weighs semantic against map similarity in RDY. Default: 3
};

struct MapMatch {
  int64_t index = -1;  // Row of the best entry; -1 when the store is empty or nothing matches.
  float score = 0.0f;  // Its cosine similarity.
};

struct InsertResult {
  uint32_t index = 0;        // Row written.
  bool replaced = false;     // The store was full and the row held another entry.
  uint64_t replaced_id = 0;  // That entry's id.
  float redundancy = 0.0f;   // RDY of the new entry with the one it replaced.
};

// One request's trajectory search state across the layers of an iteration: running dot products
// with every stored row and the prefix norm of the observed map.
struct Trajectory {
  std::vector<double> dots;     // Per row: sum over observed layers of P_l . map_row[l].
  std::vector<float> observed;  // The observed layers' rows, concatenated.
  double norm2 = 0.0;           // |observed|^2.
  uint32_t layers = 0;          // Layers observed: 0..layers-1.
  uint64_t generation = 0;      // Store generation the dots were computed against.
};

class MapStore {
 public:
  static Result<MapStore> Create(const MapStoreOptions& options);
  // The bytes a store with these options allocates (its matrices and norms): capacity x
  // (16 + 6 h + 8 L J + 16 L). Saturates at UINT64_MAX.
  static uint64_t BytesFor(const MapStoreOptions& options);

  const MapStoreOptions& options() const { return options_; }
  uint32_t size() const { return size_; }
  uint64_t id(uint32_t index) const { return ids_[index]; }
  std::span<const float> sem(uint32_t index) const;
  std::span<const float> map(uint32_t index) const;
  // Row `layer` (J floats) of entry `index`'s map.
  std::span<const float> map_layer(uint32_t index, uint32_t layer) const;

  // Adds an entry; when full, replaces the stored entry with the highest redundancy
  // RDY(x, y) = (d/L) cos_sem(x, y) + ((L-d)/L) cos_map(x, y), lowest row on ties.
  // kInvalidArgument for a wrong shape or a non-finite value.
  Result<InsertResult> Insert(uint64_t id, std::span<const float> sem, std::span<const float> map);
  // Where Insert would write, without writing (the service persists first, then Puts).
  Result<InsertResult> PlanInsert(std::span<const float> sem, std::span<const float> map) const;
  // Writes an entry into a given row (rebuilding from persistence); rows fill in order.
  Status Put(uint32_t index, uint64_t id, std::span<const float> sem, std::span<const float> map);

  // Semantic search at iteration start: argmax cosine(sem, stored sem); lowest row on ties.
  MapMatch SemanticMatch(std::span<const float> sem) const;
  // Starts a trajectory for one request and iteration.
  void BeginTrajectory(Trajectory* t) const;
  // Adds the observed gate distribution of the next layer (t->layers) and returns the entry
  // whose map prefix is most similar to the observed prefix.
  MapMatch ObserveLayer(Trajectory* t, std::span<const float> probs) const;

  // Increases whenever a row changes; trajectories recompute their dots when it moved.
  uint64_t generation() const { return generation_; }

 private:
  explicit MapStore(const MapStoreOptions& options);
  Status CheckShapes(std::span<const float> sem, std::span<const float> map) const;
  void Write(uint32_t index, uint64_t id, std::span<const float> sem, std::span<const float> map);
  double Redundancy(uint32_t index, std::span<const float> sem, double sem_norm,
                    std::span<const float> map, double map_norm) const;

  MapStoreOptions options_;
  uint32_t size_ = 0;
  uint64_t generation_ = 0;
  size_t map_width_ = 0;  // L * J.
  std::vector<uint64_t> ids_;
  std::vector<float> sems_;          // C x h.
  std::vector<uint16_t> sems_bf16_;  // C x h, bfloat16: the semantic search's screening pass.
  std::vector<float> maps_;          // C x (L * J).
  std::vector<double> sem_norm_;     // |sem| per row.
  // Per row, per layer l: sum over layers 0..l of |map[k]|^2 (prefix norms for the trajectory).
  std::vector<double> prefix_norm2_;
  // The same maps layer-major (layer l of every row contiguous, L x C x J) and the inverse prefix
  // norms per layer (L x C): the trajectory step reads one contiguous block per layer.
  std::vector<float> layer_maps_;
  std::vector<double> prefix_inv_norm_;
};

// The similarity-aware selection (fMoE section 4.4): experts of `probs` (the matched map's row
// for the target layer) in descending probability until their sum reaches
// delta = clip(1 - score, 0, 1), never fewer than top_k; priority p / (target - current)
// (current < target; -1 at iteration start, before any layer). Ties by lower expert index.
std::vector<PrefetchEntry> SelectExperts(std::span<const float> probs, float score, uint32_t top_k,
                                         uint32_t target_layer, int32_t current_layer);

}  // namespace fmoe
