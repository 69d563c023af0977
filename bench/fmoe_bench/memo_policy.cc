#include "bench/fmoe_bench/memo_policy.h"

namespace fmoe::bench {

void MemoPolicy::Attach(CacheControl* control) {
  CachePolicy::Attach(control);
  inner_->Attach(control);
  experts_ = control->num_experts();
  const size_t n = static_cast<size_t>(control->num_layers()) * experts_;
  score_.assign(n, 0.0);
  taken_.assign(n, 0);
  layer_seen_ = control->current_layer();
  ForgetAll();
}

void MemoPolicy::Forget(uint32_t layer, uint32_t expert) {
  const size_t k = static_cast<size_t>(layer) * experts_ + expert;
  if (k < taken_.size()) taken_[k] = 0;
}

void MemoPolicy::OnIterationStart(std::span<const SequenceInfo> sequences) {
  ForgetAll();
  inner_->OnIterationStart(sequences);
}

void MemoPolicy::OnLayerStart(const LayerRouting& routing) {
  ForgetAll();
  inner_->OnLayerStart(routing);
}

void MemoPolicy::OnUse(uint32_t layer, uint32_t expert, bool hit) {
  Forget(layer, expert);
  inner_->OnUse(layer, expert, hit);
}

void MemoPolicy::OnLayerEnd(uint32_t layer) {
  ForgetAll();
  inner_->OnLayerEnd(layer);
}

void MemoPolicy::OnIterationEnd() {
  ForgetAll();
  inner_->OnIterationEnd();
}

void MemoPolicy::OnRequestEnd(uint64_t request_id) {
  ForgetAll();
  inner_->OnRequestEnd(request_id);
}

void MemoPolicy::OnResident(uint32_t layer, uint32_t expert) {
  Forget(layer, expert);
  inner_->OnResident(layer, expert);
}

void MemoPolicy::OnEvicted(uint32_t layer, uint32_t expert) {
  Forget(layer, expert);
  inner_->OnEvicted(layer, expert);
}

void MemoPolicy::OnDirective(const PrefetchDirective& directive) {
  ForgetAll();
  inner_->OnDirective(directive);
}

void MemoPolicy::OnSpeculation(uint32_t layer, uint32_t target, std::span<const float> probs) {
  ForgetAll();
  inner_->OnSpeculation(layer, target, probs);
}

double MemoPolicy::EvictionScore(uint32_t layer, uint32_t expert) const {
  const size_t k = static_cast<size_t>(layer) * experts_ + expert;
  if (k >= taken_.size()) return inner_->EvictionScore(layer, expert);
  // The running layer is the cache's state, read by the scores: a new one forgets them all.
  const uint32_t now = control_->current_layer();
  if (now != layer_seen_) {
    layer_seen_ = now;
    ++generation_;
  }
  if (taken_[k] != generation_) {
    score_[k] = inner_->EvictionScore(layer, expert);
    taken_[k] = generation_;
    ++computed_;
  }
  return score_[k];
}

}  // namespace fmoe::bench
