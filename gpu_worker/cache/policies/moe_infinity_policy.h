// The moe-infinity policy (MoE-Infinity, Xue et al., sections 4-5): request-level expert
// activation tracing (iteration and request Expert Activation Matrices), an EAM collection with
// its replacement rule, cosine matching, multi-layer prefetch weighted by layer proximity, and
// cache priority from the request-level EAM with initial layers favoured. Engine thread only.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "gpu_worker/cache/policies/cache_policy.h"

namespace fmoe {

std::unique_ptr<CachePolicy> NewMoeInfinityPolicy(const PolicyOptions& options);

// ---- Internals, exposed for tests ----

// Expert Activation Matrix Collection (paper 4.2): at most `capacity` request-level EAMs, each
// flattened into an L*J float vector, stored contiguously with its squared norm over every layer
// prefix (rows [0, l]), so a partial EAM can be matched on the layers it has.
class EamCollection {
 public:
  EamCollection(uint32_t capacity, uint32_t num_layers, uint32_t num_experts);

  // Stores `eam` (L*J counts, row-major). Below capacity it is appended; when full it replaces
  // the stored EAM with the smallest cosine distance to it (ties: the lower index). Returns the
  // index written; nullopt for an all-zero EAM or a zero capacity (nothing stored).
  std::optional<uint32_t> Insert(std::span<const uint32_t> eam);

  uint32_t size() const { return size_; }
  uint32_t capacity() const { return capacity_; }
  std::span<const float> entry(uint32_t index) const;

  // dots[c] += sum over j in `nonzero` of row[j] * entry(c)[layer][j], for c < size().
  void AccumulateRowDots(uint32_t layer, std::span<const uint32_t> row,
                         std::span<const uint32_t> nonzero, std::span<double> dots) const;
  // Dot product of the whole `eam` (L*J) with entry(index).
  double Dot(uint32_t index, std::span<const uint32_t> eam) const;
  // Cosine similarity over layers [0, layers) of entry(index) and a query whose dot with it is
  // `dot` and whose squared norm is `query_norm2`; 0 when either has no mass there.
  double Similarity(uint32_t index, double dot, double query_norm2, uint32_t layers) const;
  // The (at most) `count` entries most similar to the query over layers [0, layers), with
  // similarity > 0, best first (ties: the lower index). `dots` as from AccumulateRowDots.
  void TopMatches(std::span<const double> dots, double query_norm2, uint32_t layers, uint32_t count,
                  std::vector<uint32_t>* out) const;
  // Dots and TopMatches for a whole query EAM (L*J), from scratch: O(size * nonzero cells);
  // `dots` is scratch. The policy keeps its dots up to date incrementally instead.
  void Match(std::span<const uint32_t> query, uint32_t layers, uint32_t count,
             std::vector<double>* dots, std::vector<uint32_t>* out) const;

 private:
  uint32_t capacity_;
  uint32_t layers_;
  uint32_t experts_;
  uint32_t size_ = 0;
  std::vector<float> data_;              // size_ * L * J, grown on insert.
  std::vector<double> prefix_inv_norm_;  // size_ * L: 1 / norm of rows [0, l] of each entry.
};

class MoeInfinityPolicy final : public CachePolicy {
 public:
  // Stored EAMs aggregated per prediction (paper 5.1, "several matched EAMs").
  static constexpr uint32_t kDefaultMatches = 3;
  // The paper traces prefill and decode request-level EAMs separately (4.1); one EAMC each.
  enum Phase : uint8_t { kPrefill = 0, kDecode = 1 };

  explicit MoeInfinityPolicy(const PolicyOptions& options, uint32_t matches = kDefaultMatches);

  std::string_view name() const override { return "moe-infinity"; }
  void Attach(CacheControl* control) override;
  void OnIterationStart(std::span<const SequenceInfo> sequences) override;
  void OnLayerStart(const LayerRouting& routing) override;
  void OnRequestEnd(uint64_t request_id) override;
  double EvictionScore(uint32_t layer, uint32_t expert) const override;

  // Tests: a request's iteration EAM and its request EAM of one phase (L*J); empty if unknown.
  std::span<const uint32_t> IterationEam(uint64_t request_id) const;
  std::span<const uint32_t> RequestEam(uint64_t request_id, Phase phase) const;
  size_t requests_tracked() const { return requests_.size(); }
  const EamCollection& collection(Phase phase) const { return *collections_[phase]; }

 private:
  struct Request {
    Phase phase = kPrefill;
    std::vector<uint32_t> iteration;            // Iteration EAM, L*J (paper 4.1).
    std::array<std::vector<uint32_t>, 2> eams;  // Request EAM per phase, L*J (paper 4.1).
    std::vector<double> dots;  // Iteration EAM . each entry of collections_[phase].
    double query_norm2 = 0;    // Squared norm of the iteration EAM so far.
    // Decode EAM of the completed iterations . each entry of collections_[kDecode], and the
    // squared norm of eams[kDecode].
    std::vector<double> decode_dots;
    double decode_norm2 = 0;
  };

  // Adds the prediction of the stored EAMs in matched_ to pred_ rows [first, last], by max over
  // the calls (the batch combination).
  void AddPrediction(Phase phase, uint32_t first, uint32_t last);
  // Issues pred_ rows [first, last] as prefetches weighted by proximity to `current` (-1 before
  // layer 0), after dropping the queued ones.
  void IssuePrefetches(int64_t current, uint32_t first, uint32_t last);
  uint32_t LastTarget(int64_t current) const;

  PolicyOptions options_;
  uint32_t matches_;
  uint32_t layers_ = 0;
  uint32_t experts_ = 0;
  std::array<std::unique_ptr<EamCollection>, 2> collections_;
  std::unordered_map<uint64_t, Request> requests_;
  std::vector<Request*> batch_;        // This iteration's rows of sequence_counts; null once ended.
  std::vector<int64_t> batch_counts_;  // Sum over requests in flight of their phase's EAM.
  // Scratch, sized at Attach.
  std::vector<double> pred_;  // Predicted activation, L*J.
  std::vector<double> row_;   // J.
  std::vector<uint32_t> nonzero_;
  std::vector<uint32_t> matched_;
  std::vector<double> dots_;
};

}  // namespace fmoe
