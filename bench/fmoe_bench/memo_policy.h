// MemoPolicy: a cache policy in front of another that remembers each expert's eviction score
// until something that may change it happens, so the replay's simulated host cache (sim_tier.h),
// which ranks every host-resident expert at each eviction, scores each one once per change
// instead of once per eviction. Results are those of the policy behind it, exactly: a score is
// recomputed after any call that may change the policy's state (every callback forwarded here)
// or the cache's state the score reads (the running layer). A per-expert callback (OnUse,
// OnResident, OnEvicted) forgets only that expert's score: the policy behind must not change
// another expert's score there, which holds for every policy in gpu_worker/cache/policies/.
// Owned by the ExpertCache as its policy. One thread, as every policy.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "gpu_worker/cache/policies/cache_policy.h"

namespace fmoe::bench {

class MemoPolicy final : public CachePolicy {
 public:
  explicit MemoPolicy(std::unique_ptr<CachePolicy> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  void Attach(CacheControl* control) override;

  void OnIterationStart(std::span<const SequenceInfo> sequences) override;
  void OnLayerStart(const LayerRouting& routing) override;
  void OnUse(uint32_t layer, uint32_t expert, bool hit) override;
  void OnLayerEnd(uint32_t layer) override;
  void OnIterationEnd() override;
  void OnRequestEnd(uint64_t request_id) override;
  void OnResident(uint32_t layer, uint32_t expert) override;
  void OnEvicted(uint32_t layer, uint32_t expert) override;
  void OnDirective(const PrefetchDirective& directive) override;
  uint32_t speculation_distance() const override { return inner_->speculation_distance(); }
  void OnSpeculation(uint32_t layer, uint32_t target, std::span<const float> probs) override;
  double EvictionScore(uint32_t layer, uint32_t expert) const override;
  bool admit_by_deadline() const override { return inner_->admit_by_deadline(); }

  // Scores computed by the policy behind (tests).
  uint64_t computed() const { return computed_; }

 private:
  void ForgetAll() { ++generation_; }
  void Forget(uint32_t layer, uint32_t expert);

  std::unique_ptr<CachePolicy> inner_;
  uint32_t experts_ = 0;  // J, from the control.
  mutable uint64_t generation_ = 1;
  mutable uint32_t layer_seen_ = 0;  // The running layer the remembered scores were taken at.
  mutable std::vector<double> score_;
  mutable std::vector<uint64_t> taken_;  // The generation score_ is of; 0: none.
  mutable uint64_t computed_ = 0;
};

}  // namespace fmoe::bench
