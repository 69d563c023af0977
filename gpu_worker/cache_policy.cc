#include "gpu_worker/cache_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>

#include "common/policy_names.h"
#include "gpu_worker/moe_infinity_policy.h"

namespace fmoe {
namespace {

// Per-expert bookkeeping shared by the policies below, indexed by l * J + j.
class Tracked : public CachePolicy {
 public:
  void Attach(CacheControl* control) override {
    CachePolicy::Attach(control);
    const size_t n = static_cast<size_t>(control->num_layers()) * control->num_experts();
    last_use_.assign(n, 0);
    uses_.assign(n, 0);
    loaded_.assign(n, 0);
  }
  void OnUse(uint32_t layer, uint32_t expert, bool hit) override {
    const size_t k = Key(layer, expert);
    last_use_[k] = ++tick_;
    ++uses_[k];
  }
  void OnResident(uint32_t layer, uint32_t expert) override {
    loaded_[Key(layer, expert)] = ++tick_;
  }

 protected:
  size_t Key(uint32_t layer, uint32_t expert) const {
    return static_cast<size_t>(layer) * control_->num_experts() + expert;
  }
  uint64_t tick_ = 0;
  std::vector<uint64_t> last_use_;  // Tick of the last use (0 = never).
  std::vector<uint64_t> uses_;      // Uses since start.
  std::vector<uint64_t> loaded_;    // Tick it last became resident.
};

// lru: no prediction; evicts the least recently used.
class LruPolicy : public Tracked {
 public:
  std::string_view name() const override { return "lru"; }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    return static_cast<double>(last_use_[Key(layer, expert)]);
  }
};

// on-demand (DeepSpeed-Inference style): loads an expert when the gate picks it, never ahead;
// the slots work as a ring, the expert loaded longest ago goes first, whatever its use.
class OnDemandPolicy final : public Tracked {
 public:
  std::string_view name() const override { return "on-demand"; }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    return static_cast<double>(loaded_[Key(layer, expert)]);
  }
};

// lfu: no prediction; evicts the least frequently used since start, the least recent on ties.
class LfuPolicy final : public Tracked {
 public:
  std::string_view name() const override { return "lfu"; }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    const size_t k = Key(layer, expert);
    // Ticks stay far below 2^40, so the recency term never outweighs one use.
    return static_cast<double>(uses_[k]) + static_cast<double>(last_use_[k]) * 0x1p-40;
  }
};

// speculative (Mixtral-Offloading / ProMoE style): the model applies the gates of layers
// l+1..l+d to layer l's hidden state; experts so predicted are prefetched with priority
// p / (target - l); LRU eviction.
class SpeculativePolicy final : public LruPolicy {
 public:
  explicit SpeculativePolicy(uint32_t distance) : distance_(distance) {}
  std::string_view name() const override { return "speculative"; }
  uint32_t speculation_distance() const override { return distance_; }
  void OnSpeculation(uint32_t layer, uint32_t target, std::span<const float> probs) override {
    for (uint32_t j = 0; j < probs.size(); ++j) {
      if (probs[j] > 0.0f) control_->Prefetch(target, j, probs[j] / (target - layer));
    }
  }

 private:
  uint32_t distance_;
};

// fmoe-pfreq (fMoE section 4.5, the paper's rule, kept as an ablation of fmoe's cache):
// prefetches what the map service's directives name, at their priority p / (target - current);
// evicts the lowest p * freq, p from the latest directive that named the expert (a floor when
// none), freq = the expert's cache visits.
class FmoePolicy : public Tracked {
 public:
  FmoePolicy(std::string name, double floor) : name_(std::move(name)), floor_(floor) {}
  std::string_view name() const override { return name_; }
  void Attach(CacheControl* control) override {
    Tracked::Attach(control);
    p_.assign(last_use_.size(), 0.0f);
  }
  void OnDirective(const PrefetchDirective& d) override {
    for (const PrefetchEntry& e : d.entries) {
      if (e.expert >= control_->num_experts()) continue;
      p_[Key(d.target_layer, e.expert)] = e.probability;
      control_->Prefetch(d.target_layer, e.expert, e.priority);
    }
  }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    const size_t k = Key(layer, expert);
    return std::max<double>(p_[k], floor_) * static_cast<double>(uses_[k]);
  }

 protected:
  std::string name_;
  double floor_;
  std::vector<float> p_;
};

// fmoe-nextuse (DESIGN section 6, beyond the paper): the same directives, but eviction
// estimates each expert's next use from them (Belady with predictions): an expert no live
// directive names goes first, least recently used first; among named ones, the one named for
// the latest layer goes first. Prefetches are admitted only when the link can finish them in
// time.
class NextUsePolicy final : public FmoePolicy {
 public:
  explicit NextUsePolicy(double floor) : FmoePolicy("fmoe-nextuse", floor) {}
  void Attach(CacheControl* control) override {
    FmoePolicy::Attach(control);
    next_.assign(last_use_.size(), 0);
  }
  void OnIterationStart(std::span<const SequenceInfo>) override { ++iteration_; }
  void OnDirective(const PrefetchDirective& d) override {
    FmoePolicy::OnDirective(d);
    const uint64_t position = iteration_ * control_->num_layers() + d.target_layer;
    for (const PrefetchEntry& e : d.entries) {
      if (e.expert >= control_->num_experts()) continue;
      uint64_t& next = next_[Key(d.target_layer, e.expert)];
      if (next <= Now() || position < next) next = position;
    }
  }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    const size_t k = Key(layer, expert);
    if (next_[k] <= Now()) return static_cast<double>(last_use_[k]);  // Below 2^53.
    return 0x1p60 - static_cast<double>(next_[k]);
  }
  bool admit_by_deadline() const override { return true; }

 private:
  uint64_t Now() const { return iteration_ * control_->num_layers() + control_->current_layer(); }
  uint64_t iteration_ = 0;
  std::vector<uint64_t> next_;  // Position of the predicted next use (0 = none).
};

// oracle (replay only): knows the whole access sequence. Prefetches the next d layers' experts
// exactly (nearer first) and evicts the expert used again furthest in the future (Belady).
// fmoe's cache (beyond fMoE 4.5's p * freq; DESIGN section 6 "Beyond the paper"): evicts the
// resident expert whose next use is expected furthest away, a Belady estimate from three sources:
//  - this iteration's later layers: the matched map's probability from the map service's
//    directives (usage probability min(1, K * p)), while the directive is for the running
//    iteration;
//  - every later iteration: q, the per-iteration use frequency of the expert within the running
//    requests (decayed by `decay` per iteration, smoothed toward the expert's frequency over
//    every request so far with the weight of `prior_weight` iterations), so an expert is used
//    about every 1/q iterations;
//  - recency: an expert used the last time its layer ran gets q at least the measured repeat
//    rate (the share of uses whose expert the previous iteration used too, over all requests).
// Expected distance in layers for expert (l', j) while layer l runs, q' = max(q, 1e-4):
//   l' > l:  u * (l' - l) + (1 - u) * (l' - l + L / q'),  u = this iteration's usage probability
//   l' <= l: (L - l + l') + L * (1 / q' - 1)
// The largest goes first; ties by least recent use. Prefetches every expert of the directives,
// as fMoE does. The constants were the best of a small sweep on the DeepSeek-V2-Lite trace
// (bench/RESULTS.md, policy replay); the recency term is what lifts it above LRU.
class PredictedUsePolicy final : public Tracked {
 public:
  explicit PredictedUsePolicy(std::string name, double decay = 0.95, double prior_weight = 4.0)
      : name_(std::move(name)), decay_(decay), prior_weight_(prior_weight) {}
  std::string_view name() const override { return name_; }
  void Attach(CacheControl* control) override {
    Tracked::Attach(control);
    const size_t n = last_use_.size();
    global_uses_.assign(n, 0);
    directive_p_.assign(n, 0.0f);
    directive_iteration_.assign(n, 0);
    q_.assign(n, 0.0);
    last_iteration_.assign(n, 0);
  }
  void OnIterationStart(std::span<const SequenceInfo> sequences) override {
    ++iteration_;
    batch_.clear();
    for (const SequenceInfo& s : sequences) {
      auto [it, inserted] = requests_.try_emplace(s.request_id);
      if (inserted) it->second.uses.assign(last_use_.size(), {0.0f, 0});
      ++it->second.iterations;
      it->second.weight = it->second.weight * decay_ + 1.0;
      batch_.push_back(s.request_id);
    }
    ++global_iterations_;
    candidates_ += used_this_iteration_;
    used_this_iteration_ = 0;
    RefreshQ();
  }
  void OnLayerStart(const LayerRouting& routing) override {
    const uint32_t J = control_->num_experts();
    const bool per_sequence = routing.sequence_counts.size() == batch_.size() * J;
    for (uint32_t e : routing.experts) {
      const size_t k = Key(routing.layer, e);
      ++global_uses_[k];
      if (last_iteration_[k] + 1 == iteration_) ++repeats_;
      last_iteration_[k] = iteration_;
      ++used_this_iteration_;
      for (size_t s = 0; s < batch_.size(); ++s) {
        if (per_sequence && routing.sequence_counts[s * J + e] == 0) continue;
        Request& r = requests_[batch_[s]];
        Use& u = r.uses[k];
        u.value = static_cast<float>(u.value * Decay(r.iterations - u.iteration) + 1.0);
        u.iteration = r.iterations;
      }
    }
  }
  void OnRequestEnd(uint64_t request_id) override { requests_.erase(request_id); }
  void OnDirective(const PrefetchDirective& d) override {
    const double K = control_->top_k();
    for (const PrefetchEntry& e : d.entries) {
      if (e.expert >= control_->num_experts()) continue;
      const size_t k = Key(d.target_layer, e.expert);
      const double u = std::min(1.0, K * e.probability);
      directive_p_[k] = static_cast<float>(u);
      directive_iteration_[k] = iteration_;
      control_->Prefetch(d.target_layer, e.expert, e.priority);
    }
  }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    const size_t k = Key(layer, expert);
    const double L = control_->num_layers();
    const double now = control_->current_layer();
    double q = std::max(q_[k], 1e-4);
    // Used the last time its layer ran: at least as likely as any expert to be used again
    // the next time (the measured repeat rate over every request).
    const bool recent =
        layer > now ? last_iteration_[k] + 1 == iteration_ : last_iteration_[k] == iteration_;
    if (recent && candidates_ >= kMinCandidates) {
      q = std::max(q, static_cast<double>(repeats_) / static_cast<double>(candidates_));
    }
    double distance;
    if (layer > now) {
      const double u = directive_iteration_[k] == iteration_ ? directive_p_[k] : std::min(q, 1.0);
      distance = (layer - now) + (1.0 - u) * L / q;
    } else {
      distance = (L - now + layer) + L * (1.0 / q - 1.0);
    }
    // Ties (and near-ties) by recency: last_use_ is below 2^40 for any real run.
    return -distance + static_cast<double>(last_use_[k]) * 0x1p-60;
  }

 private:
  struct Use {
    float value = 0.0f;      // Decayed uses.
    uint32_t iteration = 0;  // The request's iteration count when value was last updated.
  };
  struct Request {
    std::vector<Use> uses;  // By key.
    uint32_t iterations = 0;
    double weight = 0.0;  // Decayed iteration count (sum of decay^age).
  };
  double Decay(uint32_t age) const { return decay_ >= 1.0 ? 1.0 : std::pow(decay_, age); }
  // q for every expert: the batch's probability of using it in an iteration.
  void RefreshQ() {
    const double g_den = static_cast<double>(global_iterations_);
    for (size_t k = 0; k < q_.size(); ++k) {
      const double g = g_den > 0 ? static_cast<double>(global_uses_[k]) / g_den : 0.0;
      double miss = 1.0;
      for (uint64_t id : batch_) {
        const Request& r = requests_[id];
        const Use& u = r.uses[k];
        const double uses = u.value * Decay(r.iterations - u.iteration);
        const double qr = (uses + prior_weight_ * g) / (r.weight + prior_weight_);
        miss *= 1.0 - std::min(qr, 1.0);
      }
      q_[k] = batch_.empty() ? g : 1.0 - miss;
    }
  }

  static constexpr uint64_t kMinCandidates = 64;  // Before that, no repeat rate is trusted.
  std::string name_;
  double decay_;
  double prior_weight_;
  uint64_t iteration_ = 0;
  uint64_t global_iterations_ = 0;
  std::vector<uint64_t> global_uses_;
  std::vector<float> directive_p_;
  std::vector<uint64_t> directive_iteration_;
  std::vector<double> q_;
  std::vector<uint64_t> last_iteration_;  // iteration_ of the expert's last use (0 = none).
  uint64_t repeats_ = 0;     // Uses of an expert that the previous iteration also used.
  uint64_t candidates_ = 0;  // Uses in iterations that another iteration followed.
  uint64_t used_this_iteration_ = 0;
  std::unordered_map<uint64_t, Request> requests_;
  std::vector<uint64_t> batch_;
};

class OraclePolicy final : public CachePolicy {
 public:
  OraclePolicy(std::vector<LayerAccess> future, uint32_t distance)
      : future_(std::move(future)), distance_(std::max<uint32_t>(distance, 1)) {}
  std::string_view name() const override { return "oracle"; }
  void Attach(CacheControl* control) override {
    CachePolicy::Attach(control);
    const size_t n = static_cast<size_t>(control->num_layers()) * control->num_experts();
    uses_.assign(n, {});
    cursor_.assign(n, 0);
    for (size_t i = 0; i < future_.size(); ++i) {
      for (uint32_t e : future_[i].experts) {
        if (future_[i].layer < control->num_layers() && e < control->num_experts()) {
          uses_[static_cast<size_t>(future_[i].layer) * control->num_experts() + e].push_back(i);
        }
      }
    }
  }
  void OnIterationStart(std::span<const SequenceInfo>) override { PrefetchAhead(); }
  void OnLayerStart(const LayerRouting&) override {
    ++next_;
    PrefetchAhead();
  }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    const size_t k = static_cast<size_t>(layer) * control_->num_experts() + expert;
    const std::vector<size_t>& u = uses_[k];
    size_t& c = cursor_[k];
    while (c < u.size() && u[c] < next_) ++c;
    if (c == u.size()) return -std::numeric_limits<double>::max();  // Never used again.
    return -static_cast<double>(u[c]);
  }

 private:
  void PrefetchAhead() {
    // Accesses next_ .. next_ + d - 1 are the layers to come (within this iteration).
    const uint32_t now = control_->current_layer();
    for (size_t i = next_; i < future_.size() && i < next_ + distance_; ++i) {
      const LayerAccess& a = future_[i];
      if (i > next_ && a.layer <= future_[i - 1].layer) break;  // The next iteration.
      const double distance = a.layer > now ? a.layer - now : 1.0;
      for (uint32_t e : a.experts) control_->Prefetch(a.layer, e, 1.0 / distance);
    }
  }

  std::vector<LayerAccess> future_;
  uint32_t distance_;
  size_t next_ = 0;  // Index in future_ of the next layer to start.
  std::vector<std::vector<size_t>> uses_;
  mutable std::vector<size_t> cursor_;
};

}  // namespace

Result<std::unique_ptr<CachePolicy>> MakePolicy(std::string_view name,
                                                const PolicyOptions& options) {
  if (FindPolicyName(name) == nullptr) {
    return InvalidArgument("unknown policy \"" + std::string(name) +
                           "\"; valid: " + PolicyNameList(/*servable_only=*/false));
  }
  if (name == "fmoe" || name == "fmoe-traj" || name == "fmoe-traj-sem") {
    // The ablations differ in how the map service matches, not in the cache.
    return std::unique_ptr<CachePolicy>(new PredictedUsePolicy(std::string(name)));
  }
  if (name == "fmoe-pfreq") {
    return std::unique_ptr<CachePolicy>(
        new FmoePolicy(std::string(name), options.probability_floor));
  }
  if (name == "fmoe-nextuse") {
    return std::unique_ptr<CachePolicy>(new NextUsePolicy(options.probability_floor));
  }
  if (name == "moe-infinity") {
    // The paper prefetches across every later layer (section 5.1, multi-layer prefetching),
    // weighted by proximity, rather than to a fixed distance.
    PolicyOptions all_layers = options;
    all_layers.prefetch_distance = 0;
    return NewMoeInfinityPolicy(all_layers);
  }
  if (name == "speculative") {
    return std::unique_ptr<CachePolicy>(new SpeculativePolicy(options.prefetch_distance));
  }
  if (name == "on-demand") return std::unique_ptr<CachePolicy>(new OnDemandPolicy());
  if (name == "lru") return std::unique_ptr<CachePolicy>(new LruPolicy());
  if (name == "lfu") return std::unique_ptr<CachePolicy>(new LfuPolicy());
  if (name == "oracle") {
    if (options.future.empty()) {
      return InvalidArgument("policy oracle needs the future access sequence (trace replay)");
    }
    return std::unique_ptr<CachePolicy>(
        new OraclePolicy(options.future, options.prefetch_distance));
  }
  // cache_policy_test builds every name of the table, so this is a bug caught there.
  return Internal("policy \"" + std::string(name) +
                  "\" is in common/policy_names.h but MakePolicy cannot build it");
}

}  // namespace fmoe
