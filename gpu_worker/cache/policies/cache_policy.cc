#include "gpu_worker/cache/policies/cache_policy.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>

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
// resident expert whose next use is expected furthest away, a Belady estimate from four sources:
//  - draws: an iteration of T tokens of one request uses about as many experts per layer as m(T)
//    independent single-token draws would (m(1) = 1; m(T) learned from the observed union sizes,
//    c = 1 - (1 - K/J)^m, per power-of-two bucket of T), so a prefill and a decode step are
//    counted on one scale;
//  - this iteration's later layers: the matched map's probability from the map service's
//    directives, for each request of the batch 1 - (1 - min(1, K * p))^m, and for the batch one
//    minus the product over its requests; without a directive, the batch's probability from the
//    running requests' frequencies, 1 - prod (1 - q_r)^m_r. A prompt's union thus keeps the
//    experts its own later layers will use (scan resistance) rather than what it just used;
//  - every later iteration: q, the batch's per-iteration use probability, 1 - prod (1 - q_r), q_r
//    the per-draw use frequency of the expert within request r (its uses over the draws of its
//    completed iterations, decayed by `decay` per iteration, smoothed toward the share of all
//    iterations so far that used the expert with the weight of `prior_weight` draws), so an
//    expert is used about every 1/q iterations. That prior counts batches, not requests: at large
//    batches it makes q high for most experts, and the layer distance then decides, which suits
//    a batch that needs half of every layer (evict what the layer that just ran used);
//  - recency: an expert used the last time its layer ran gets q at least the measured repeat
//    rate (the share of uses whose expert the next iteration used too, over all requests), kept
//    apart for iterations with a prefill and iterations of decode steps only.
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
    now_.assign(n, 0.0);
    last_iteration_.assign(n, 0);
    const double K = control->top_k(), J = control->num_experts();
    log_miss_per_draw_ = K < J ? std::log1p(-K / J) : -1.0;
  }
  void OnIterationStart(std::span<const SequenceInfo> sequences) override {
    ++iteration_;
    batch_.clear();
    draws_.clear();
    tokens_.clear();
    slot_of_.clear();
    bool wide = false;
    for (const SequenceInfo& s : sequences) {
      auto [it, inserted] = requests_.try_emplace(s.request_id);
      if (inserted) it->second.uses.assign(last_use_.size(), {0.0f, 0});
      const double m = Draws(s.tokens);
      Request& r = it->second;
      ++r.iterations;
      // The request's previous iteration is complete: its draws count (this one's uses are not
      // known yet).
      r.weight = r.weight * decay_ + r.pending;
      r.pending = m;
      slot_of_[s.request_id] = batch_.size();
      batch_.push_back(s.request_id);
      draws_.push_back(m);
      tokens_.push_back(s.tokens);
      wide = wide || s.tokens > 1;
    }
    ++global_iterations_;
    // The uses of the iteration that ended are candidates for a repeat in this one.
    candidates_[wide_] += used_this_iteration_;
    used_this_iteration_ = 0;
    prev_wide_ = wide_;
    wide_ = wide ? 1 : 0;
    const size_t n = last_use_.size();
    if (directive_slots_.size() < batch_.size() * n) {
      directive_slots_.resize(batch_.size() * n, 0.0f);
      directive_slot_iteration_.resize(batch_.size() * n, 0);
    }
    RefreshQ();
    log_miss_used_ = log_miss_predicted_ = 0.0;
  }
  void OnLayerStart(const LayerRouting& routing) override {
    const uint32_t J = control_->num_experts();
    const bool per_sequence = routing.sequence_counts.size() == batch_.size() * J;
    if (per_sequence) LearnDraws(routing.sequence_counts);
    // How much of this layer the batch uses against what was predicted for it: the later layers
    // of this iteration are expected to follow suit.
    if (routing.layer < predicted_coverage_.size()) {
      const double cap = 1.0 - 0.5 / J;
      const double used = std::min(static_cast<double>(routing.experts.size()) / J, cap);
      log_miss_used_ += std::log1p(-used);
      log_miss_predicted_ += std::log1p(-std::min(predicted_coverage_[routing.layer], cap));
    }
    for (uint32_t e : routing.experts) {
      const size_t k = Key(routing.layer, e);
      if (last_iteration_[k] + 1 == iteration_) ++repeats_[prev_wide_];
      last_iteration_[k] = iteration_;
      ++used_this_iteration_;
      ++global_uses_[k];
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
    const size_t n = last_use_.size();
    auto slot = slot_of_.find(d.request_id);
    for (const PrefetchEntry& e : d.entries) {
      if (e.expert >= control_->num_experts()) continue;
      const size_t k = Key(d.target_layer, e.expert);
      const double per_draw = std::min(1.0, K * e.probability);
      if (slot == slot_of_.end()) {
        directive_p_[k] = static_cast<float>(per_draw);
      } else {
        // This request's prediction replaces its earlier one; the batch uses the expert unless
        // every request with a prediction for it does not.
        const size_t at = slot->second * n + k;
        directive_slots_[at] =
            static_cast<float>(1.0 - std::pow(1.0 - per_draw, draws_[slot->second]));
        directive_slot_iteration_[at] = iteration_;
        double miss = 1.0;
        for (size_t s = 0; s < batch_.size(); ++s) {
          if (directive_slot_iteration_[s * n + k] == iteration_) {
            miss *= 1.0 - directive_slots_[s * n + k];
          }
        }
        directive_p_[k] = static_cast<float>(1.0 - miss);
      }
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
    // the next time (the measured repeat rate after such an iteration, over every request).
    const bool upcoming = layer > now;
    const bool recent =
        upcoming ? last_iteration_[k] + 1 == iteration_ : last_iteration_[k] == iteration_;
    const int used_in = upcoming ? prev_wide_ : wide_;
    if (recent && candidates_[used_in] >= kMinCandidates) {
      q = std::max(
          q, static_cast<double>(repeats_[used_in]) / static_cast<double>(candidates_[used_in]));
    }
    double distance;
    if (upcoming) {
      // This iteration's probability, scaled by how much more (or less) of the layers so far the
      // batch used than predicted.
      double now_k = now_[k];
      if (log_miss_predicted_ < 0.0 && now_k < 1.0) {
        now_k = -std::expm1(std::log1p(-now_k) * (log_miss_used_ / log_miss_predicted_));
      }
      double u = std::max(now_k, recent ? std::min(q, 1.0) : 0.0);
      if (directive_iteration_[k] == iteration_) u = std::max<double>(u, directive_p_[k]);
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
    double weight = 0.0;   // Decayed draws of its completed iterations (sum of decay^age * m).
    double pending = 0.0;  // Draws of the running iteration.
  };
  double Decay(uint32_t age) const { return decay_ >= 1.0 ? 1.0 : std::pow(decay_, age); }
  static size_t Bucket(uint32_t tokens) { return std::min<size_t>(std::bit_width(tokens), 31); }
  // m(T): single-token draws that use as many experts as T tokens of one request; before any
  // iteration of that size was seen, the next smaller size's (and 1 for one token).
  double Draws(uint32_t tokens) const {
    if (tokens <= 1) return 1.0;
    for (size_t b = Bucket(tokens); b > 1; --b) {
      if (draws_by_size_[b] > 0.0) return std::min<double>(draws_by_size_[b], tokens);
    }
    return 1.0;
  }
  // Each multi-token request's union at this layer is a sample of m for its size.
  void LearnDraws(std::span<const uint32_t> sequence_counts) {
    const uint32_t J = control_->num_experts();
    for (size_t s = 0; s < batch_.size(); ++s) {
      if (tokens_[s] <= 1) continue;
      uint32_t used = 0;
      for (uint32_t j = 0; j < J; ++j) used += sequence_counts[s * J + j] > 0 ? 1 : 0;
      const double c = std::min(static_cast<double>(used) / J, 1.0 - 0.5 / J);
      const double m =
          std::clamp(std::log1p(-c) / log_miss_per_draw_, 1.0, static_cast<double>(tokens_[s]));
      double& avg = draws_by_size_[Bucket(tokens_[s])];
      avg = avg == 0.0 ? m : (1.0 - kDrawsWeight) * avg + kDrawsWeight * m;
    }
  }
  // For every expert: q, the batch's probability of using it in a later (decode) iteration, and
  // now, in this one.
  void RefreshQ() {
    for (size_t k = 0; k < q_.size(); ++k) {
      const double g = global_iterations_ > 0 ? static_cast<double>(global_uses_[k]) /
                                                    static_cast<double>(global_iterations_)
                                              : 0.0;
      double miss = 1.0, miss_now = 1.0;
      for (size_t s = 0; s < batch_.size(); ++s) {
        const Request& r = requests_[batch_[s]];
        const Use& u = r.uses[k];
        const double uses = u.value * Decay(r.iterations - u.iteration);
        const double qr = std::min((uses + prior_weight_ * g) / (r.weight + prior_weight_), 1.0);
        miss *= 1.0 - qr;
        miss_now *= draws_[s] == 1.0 ? 1.0 - qr : std::pow(1.0 - qr, draws_[s]);
      }
      q_[k] = batch_.empty() ? g : 1.0 - miss;
      now_[k] = batch_.empty() ? g : 1.0 - miss_now;
    }
    const uint32_t L = control_->num_layers(), J = control_->num_experts();
    predicted_coverage_.assign(L, 0.0);
    for (size_t k = 0; k < now_.size(); ++k) predicted_coverage_[k / J] += now_[k] / J;
  }

  static constexpr uint64_t kMinCandidates = 64;  // Before that, no repeat rate is trusted.
  static constexpr double kDrawsWeight = 0.05;    // Of a new sample in m(T)'s moving average.
  std::string name_;
  double decay_;
  double prior_weight_;
  double log_miss_per_draw_ = -1.0;  // log(1 - K / J).
  uint64_t iteration_ = 0;
  uint64_t global_iterations_ = 0;
  std::vector<uint64_t> global_uses_;  // Iterations that used each expert.
  std::vector<float> directive_p_;     // The batch's, this iteration (directive_iteration_).
  std::vector<uint64_t> directive_iteration_;
  std::vector<float> directive_slots_;  // [batch slot x key]: each request's prediction.
  std::vector<uint64_t> directive_slot_iteration_;
  std::vector<double> q_, now_;
  std::vector<double> predicted_coverage_;  // Mean of now_ per layer.
  // Sums over this iteration's layers so far of log(1 - share of the layer's experts used) and
  // of log(1 - predicted share).
  double log_miss_used_ = 0.0, log_miss_predicted_ = 0.0;
  std::vector<uint64_t> last_iteration_;  // iteration_ of the expert's last use (0 = none).
  // [0]: after an iteration of decode steps only; [1]: after one with a prefill.
  uint64_t repeats_[2] = {0, 0};     // Uses of an expert that the previous iteration also used.
  uint64_t candidates_[2] = {0, 0};  // Uses in iterations that another iteration followed.
  int wide_ = 0, prev_wide_ = 0;     // The running / the previous iteration had a prefill.
  uint64_t used_this_iteration_ = 0;
  double draws_by_size_[32] = {};  // m(T) by Bucket(T); 0 = not seen.
  std::unordered_map<uint64_t, Request> requests_;
  std::unordered_map<uint64_t, size_t> slot_of_;  // Request -> its position in batch_.
  std::vector<uint64_t> batch_;
  std::vector<double> draws_;     // m of each request of the batch.
  std::vector<uint32_t> tokens_;  // Tokens of each request of the batch.
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

Result<std::unique_ptr<CachePolicy>> MakeBuiltinPolicy(std::string_view name,
                                                       const PolicyOptions& options) {
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
  return std::unique_ptr<CachePolicy>();
}

}  // namespace fmoe
