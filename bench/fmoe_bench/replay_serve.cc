#include "bench/fmoe_bench/replay_serve.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "bench/fmoe_bench/memo_policy.h"
#include "bench/fmoe_bench/replay_core.h"
#include "bench/fmoe_bench/sim_link.h"
#include "common/clock.h"
#include "gpu_worker/cache/expert_cache.h"
#include "gpu_worker/cache/policies/cache_policy.h"
#include "gpu_worker/cache/policies/policy_factory.h"
#include "gpu_worker/core/chunk_planner.h"
#include "map_service/map_matcher.h"

namespace fmoe::bench {

// ---- ContinuousBatcher ----

ContinuousBatcher::ContinuousBatcher(std::vector<int64_t> arrival_ns, std::vector<uint32_t> steps,
                                     uint32_t max_batch, std::vector<uint32_t> prompt,
                                     uint32_t max_batched_tokens)
    : arrival_ns_(std::move(arrival_ns)),
      steps_(std::move(steps)),
      prompt_(std::move(prompt)),
      max_batched_tokens_(max_batched_tokens),
      max_batch_(std::max<uint32_t>(max_batch, 1)) {
  prompt_.resize(arrival_ns_.size(), 0);
  order_.resize(arrival_ns_.size());
  std::iota(order_.begin(), order_.end(), 0u);
  std::stable_sort(order_.begin(), order_.end(),
                   [this](uint32_t a, uint32_t b) { return arrival_ns_[a] < arrival_ns_[b]; });
}

const std::vector<ContinuousBatcher::Slot>& ContinuousBatcher::Admit(int64_t now_ns) {
  while (running_.size() < max_batch_ && next_ < order_.size() &&
         arrival_ns_[order_[next_]] <= now_ns) {
    running_.push_back(Running{order_[next_++], 0, 0, 0, false});
  }
  const auto chunked = [this](const Running& r) {
    return max_batched_tokens_ > 0 && r.step == 0 && prompt_[r.request] > 0;
  };
  // The steps that are not prefill chunks run first, one token each.
  int64_t left = max_batched_tokens_;
  for (Running& r : running_) {
    r.runs = !chunked(r);
    r.ran = 0;
    if (r.runs) --left;
  }
  slots_.clear();
  bool first_chunk = true;
  for (Running& r : running_) {
    if (chunked(r) && left >= 1) {
      const uint32_t rest = prompt_[r.request] - r.done;
      const uint32_t take = AdvisedChunk(
          advisor_, static_cast<uint32_t>(std::min<int64_t>(rest, left)), rest, first_chunk);
      if (take > 0) {
        left -= take;
        r.runs = true;
        r.ran = r.done + take;
        first_chunk = false;
      }
    }
    if (!r.runs) continue;
    Slot s{r.request, r.step, 0, 0};
    // A chunk of the whole prompt is the step whole.
    if (r.ran > 0 && !(r.done == 0 && r.ran == prompt_[r.request])) {
      s.chunk_begin = r.done;
      s.chunk_end = r.ran;
    }
    slots_.push_back(s);
  }
  return slots_;
}

int64_t ContinuousBatcher::NextArrival() const {
  return next_ < order_.size() ? arrival_ns_[order_[next_]] : -1;
}

void ContinuousBatcher::Advance(std::vector<uint32_t>* finished) {
  size_t kept = 0;
  for (Running& r : running_) {
    if (r.runs) {
      r.runs = false;
      if (r.ran > 0 && r.ran < prompt_[r.request]) {
        r.done = r.ran;  // More of the prompt to come.
      } else if (++r.step >= steps_[r.request]) {
        finished->push_back(r.request);
        ++finished_;
        continue;
      }
    }
    running_[kept++] = r;
  }
  running_.resize(kept);
  slots_.clear();
}

ChunkAdvisor ChunkAdvisorFor(const ServeConfig& c, const TraceHeader& h) {
  if (!(c.chunk_overhead > 0.0) || c.max_batched_tokens == 0) return {};
  ChunkCosts costs;
  costs.experts = h.num_experts;
  costs.top_k = h.top_k;
  costs.moe_layers = h.num_layers;
  costs.miss = 1.0 - c.budget;
  costs.load_ns = static_cast<double>(c.time.LoadNs());
  // A prompt token's compute: the layer time's slope over large iterations, times the layers.
  costs.token_ns =
      static_cast<double>(c.time.LayerNs(1024) - c.time.LayerNs(512)) / 512.0 * h.num_layers;
  const double overhead = c.chunk_overhead;
  return [costs, overhead](uint32_t chunk, uint32_t rest) {
    return ExpertAwareChunk(costs, chunk, rest, overhead);
  };
}

namespace {

using Schedule = std::vector<std::vector<ContinuousBatcher::Slot>>;  // Slots use workload indices.

// The routing each slot of a batch runs: the request's step as the workload holds it, or a
// prefill chunk merged from its prompt positions [begin, end) (MergePositions: the chunk's exact
// per-layer union and token counts). Chunks are kept for reuse, and forgotten (between batches)
// past a bound.
class Routes {
 public:
  explicit Routes(const ServeWorkload& w) : w_(w) {}

  // The routings of `batch` (workload indices), in its order; valid until the next call.
  const std::vector<const TraceIteration*>& Of(const std::vector<ContinuousBatcher::Slot>& batch) {
    if (chunks_.size() > kMaxChunks) chunks_.clear();
    out_.clear();
    for (const auto& s : batch) {
      const ServeRequest& r = w_.requests[s.request];
      if (!s.chunk()) {
        out_.push_back(r.steps[s.step]);
        continue;
      }
      auto [it, inserted] = chunks_.try_emplace({s.request, s.chunk_begin, s.chunk_end});
      if (inserted) {
        const std::vector<const TraceIteration*> positions(
            r.prompt_positions.begin() + s.chunk_begin, r.prompt_positions.begin() + s.chunk_end);
        it->second = MergePositions(w_.trace->header, positions);
      }
      out_.push_back(&it->second);
    }
    return out_;
  }

 private:
  static constexpr size_t kMaxChunks = 4096;
  const ServeWorkload& w_;
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, TraceIteration> chunks_;
  std::vector<const TraceIteration*> out_;
};

// The union of the batch's experts at `layer` (`its`: the batch's routings): sorted experts,
// their summed tokens, and the per-sequence counts (rows in batch order, J wide).
void BatchUnion(const ServeWorkload& w, const std::vector<const TraceIteration*>& its,
                uint32_t layer, std::vector<uint32_t>* experts, std::vector<uint32_t>* tokens,
                std::vector<uint32_t>* sequence_counts) {
  const uint32_t J = w.trace->header.num_experts;
  sequence_counts->assign(its.size() * J, 0);
  std::vector<uint32_t> sum(J, 0);
  for (size_t s = 0; s < its.size(); ++s) {
    const TraceIteration& it = *its[s];
    auto used = it.used(layer);
    auto counts = it.used_counts(layer);
    for (size_t e = 0; e < used.size(); ++e) {
      sum[used[e]] += counts[e];
      (*sequence_counts)[s * J + used[e]] = counts[e];
    }
  }
  experts->clear();
  tokens->clear();
  for (uint32_t j = 0; j < J; ++j) {
    if (sum[j] == 0) continue;
    experts->push_back(j);
    tokens->push_back(sum[j]);
  }
}

std::vector<LayerAccess> AccessLog(const ServeWorkload& w, const Schedule& schedule,
                                   Routes& routes) {
  std::vector<LayerAccess> out;
  std::vector<uint32_t> experts, tokens, counts;
  for (const auto& batch : schedule) {
    const auto& its = routes.Of(batch);
    for (uint32_t l = 0; l < w.trace->header.num_layers; ++l) {
      BatchUnion(w, its, l, &experts, &tokens, &counts);
      out.push_back(LayerAccess{l, experts});
    }
  }
  return out;
}

bool SameSchedule(const Schedule& a, const Schedule& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return false;
    for (size_t s = 0; s < a[i].size(); ++s) {
      if (a[i][s].request != b[i][s].request || a[i][s].step != b[i][s].step ||
          a[i][s].chunk_begin != b[i][s].chunk_begin || a[i][s].chunk_end != b[i][s].chunk_end) {
        return false;
      }
    }
  }
  return true;
}

// The schedule of `reqs` when every layer takes its compute time and nothing stalls: the
// oracle's first guess at its own schedule.
Schedule ComputeOnlySchedule(const ServeWorkload& w, const std::vector<uint32_t>& reqs,
                             const std::vector<int64_t>& arrival_ns, const ServeConfig& c,
                             Routes& routes) {
  std::vector<uint32_t> steps, prompt;
  for (uint32_t r : reqs) {
    steps.push_back(static_cast<uint32_t>(w.requests[r].steps.size()));
    prompt.push_back(static_cast<uint32_t>(w.requests[r].prompt_positions.size()));
  }
  ContinuousBatcher batcher(arrival_ns, steps, c.max_batch, prompt, c.max_batched_tokens);
  batcher.SetChunkAdvisor(ChunkAdvisorFor(c, w.trace->header));
  Schedule out;
  int64_t now = 0;
  std::vector<uint32_t> finished;
  while (!batcher.done()) {
    const auto& running = batcher.Admit(now);
    if (running.empty()) {
      now = std::max(now, batcher.NextArrival());
      continue;
    }
    uint64_t tokens = 0;
    auto& batch = out.emplace_back();
    for (const auto& s : running)
      batch.push_back({reqs[s.request], s.step, s.chunk_begin, s.chunk_end});
    for (const TraceIteration* it : routes.Of(batch)) tokens += it->tokens;
    now += c.time.LayerNs(tokens) * w.trace->header.num_layers;
    batcher.Advance(&finished);
  }
  return out;
}

// Hybrid runs: stands between the cache and its policy, forwarding every call, and keeps what
// the CPU path needs: which experts are resident (OnResident / OnEvicted), and for a layer whose
// missing experts run on the CPU it shows the policy the whole layer, as the cache would have:
// a use (a miss) of each CPU-run expert and the routing with them (SetCpuRun before BeginLayer).
class HybridView final : public CachePolicy {
 public:
  explicit HybridView(std::unique_ptr<CachePolicy> inner) : inner_(std::move(inner)) {}
  bool resident(uint32_t key) const { return resident_[key] != 0; }
  // `full`: the layer's routing, CPU-run experts included; `cpu`: those experts. Both outlive
  // the next BeginLayer.
  void SetCpuRun(const LayerRouting* full, const std::vector<uint32_t>* cpu) {
    full_ = full;
    cpu_ = cpu;
  }

  std::string_view name() const override { return inner_->name(); }
  void Attach(CacheControl* control) override {
    CachePolicy::Attach(control);
    inner_->Attach(control);
    resident_.assign(static_cast<size_t>(control->num_layers()) * control->num_experts(), 0);
  }
  void OnIterationStart(std::span<const SequenceInfo> sequences) override {
    inner_->OnIterationStart(sequences);
  }
  void OnLayerStart(const LayerRouting& routing) override {
    if (full_ != nullptr && full_->layer == routing.layer) {
      for (uint32_t e : *cpu_) inner_->OnUse(routing.layer, e, /*hit=*/false);
      inner_->OnLayerStart(*full_);
    } else {
      inner_->OnLayerStart(routing);
    }
    full_ = nullptr;
    cpu_ = nullptr;
  }
  void OnUse(uint32_t layer, uint32_t expert, bool hit) override {
    inner_->OnUse(layer, expert, hit);
  }
  void OnLayerEnd(uint32_t layer) override { inner_->OnLayerEnd(layer); }
  void OnIterationEnd() override { inner_->OnIterationEnd(); }
  void OnRequestEnd(uint64_t request_id) override { inner_->OnRequestEnd(request_id); }
  void OnResident(uint32_t layer, uint32_t expert) override {
    resident_[Key(layer, expert)] = 1;
    inner_->OnResident(layer, expert);
  }
  void OnEvicted(uint32_t layer, uint32_t expert) override {
    resident_[Key(layer, expert)] = 0;
    inner_->OnEvicted(layer, expert);
  }
  void OnDirective(const PrefetchDirective& directive) override { inner_->OnDirective(directive); }
  uint32_t speculation_distance() const override { return inner_->speculation_distance(); }
  void OnSpeculation(uint32_t layer, uint32_t target, std::span<const float> probs) override {
    inner_->OnSpeculation(layer, target, probs);
  }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    return inner_->EvictionScore(layer, expert);
  }
  bool admit_by_deadline() const override { return inner_->admit_by_deadline(); }

 private:
  size_t Key(uint32_t layer, uint32_t expert) const {
    return static_cast<size_t>(layer) * control_->num_experts() + expert;
  }
  std::unique_ptr<CachePolicy> inner_;
  std::vector<uint8_t> resident_;  // By l * J + j.
  const LayerRouting* full_ = nullptr;
  const std::vector<uint32_t>* cpu_ = nullptr;
};

// One cache, link and (for the fmoe policies) map store, serving requests in simulated time.
class ServeRun {
 public:
  struct Measured {
    std::vector<RequestTiming> timings;  // By position in the request list.
    PhaseFigures prefill, decode;
    uint64_t iterations = 0, batch_sum = 0;
    Schedule schedule;
  };

  // `routes` outlives the run.
  static Result<std::unique_ptr<ServeRun>> Create(const ServeWorkload& w, const ServeConfig& c,
                                                  Routes* routes, std::vector<LayerAccess> future,
                                                  const MapStore* store) {
    std::unique_ptr<ServeRun> run(new ServeRun(w, c, routes));
    FMOE_RETURN_IF_ERROR(run->Init(std::move(future), store));
    return run;
  }
  ~ServeRun() {
    cache_.reset();  // Cancels what is on the link before the slots go.
    if (slot_memory_ != nullptr) link().FreeDevice(slot_memory_);
  }

  // Serves `reqs` (workload indices), request k arriving arrival_ns[k] after now: batched
  // continuously, or as `forced` says (its batches in order, each waiting for its new requests to
  // arrive; slots hold workload indices).
  Status Serve(const std::vector<uint32_t>& reqs, const std::vector<int64_t>& arrival_ns,
               bool match, Measured* out, const Schedule* forced = nullptr) {
    const int64_t t0 = clock_.NowNs();
    std::vector<int64_t> at(arrival_ns.size());
    std::vector<uint32_t> steps, prompt;
    for (size_t k = 0; k < reqs.size(); ++k) {
      at[k] = t0 + arrival_ns[k];
      steps.push_back(static_cast<uint32_t>(w_.requests[reqs[k]].steps.size()));
      prompt.push_back(static_cast<uint32_t>(w_.requests[reqs[k]].prompt_positions.size()));
    }
    out->timings.assign(reqs.size(), RequestTiming{});
    for (size_t k = 0; k < reqs.size(); ++k) {
      const ServeRequest& r = w_.requests[reqs[k]];
      RequestTiming& t = out->timings[k];
      t.id = r.id;
      t.has_prefill = r.has_prefill;
      t.prompt_tokens = r.prompt_tokens;
      t.steps = steps[k];
      t.arrival_ns = arrival_ns[k];
    }
    std::vector<ContinuousBatcher::Slot> local;
    if (forced != nullptr) {
      std::unordered_map<uint32_t, uint32_t> local_of;
      for (uint32_t k = 0; k < reqs.size(); ++k) local_of[reqs[k]] = k;
      // Per request: the steps it ran, and of its first the prompt positions run (chunked).
      std::vector<uint32_t> ran(reqs.size(), 0), done(reqs.size(), 0);
      for (const auto& batch : *forced) {
        local.clear();
        int64_t ready = clock_.NowNs();
        for (const auto& s : batch) {
          auto it = local_of.find(s.request);
          if (it == local_of.end() || s.step != ran[it->second] ||
              (s.chunk() && (s.step != 0 || s.chunk_begin != done[it->second] ||
                             s.chunk_end <= s.chunk_begin || s.chunk_end > prompt[it->second]))) {
            return Internal("serving replay: the forced schedule does not fit the requests");
          }
          local.push_back({it->second, s.step, s.chunk_begin, s.chunk_end});
          if (s.step == 0 && s.chunk_begin == 0) ready = std::max(ready, at[it->second]);
          if (s.chunk() && s.chunk_end < prompt[it->second]) {
            done[it->second] = s.chunk_end;
          } else {
            ++ran[it->second];
          }
        }
        if (ready > clock_.NowNs()) {
          clock_.AdvanceNs(ready - clock_.NowNs());
          cache_->Pump();
        }
        FMOE_RETURN_IF_ERROR(RunBatch(reqs, local, match, t0, out));
        for (const auto& s : local) {
          if (LastOfRequest(s, steps[s.request], prompt[s.request])) {
            cache_->OnRequestEnd(w_.requests[reqs[s.request]].id);
          }
        }
      }
      if (ran != steps) {
        return Internal("serving replay: the forced schedule does not fit the requests");
      }
      return Status::Ok();
    }
    ContinuousBatcher batcher(at, steps, c_.max_batch, prompt, c_.max_batched_tokens);
    batcher.SetChunkAdvisor(ChunkAdvisorFor(c_, w_.trace->header));
    std::vector<uint32_t> finished;
    while (!batcher.done()) {
      const auto& running = batcher.Admit(clock_.NowNs());
      if (running.empty()) {
        clock_.AdvanceNs(std::max<int64_t>(0, batcher.NextArrival() - clock_.NowNs()));
        cache_->Pump();
        continue;
      }
      local.assign(running.begin(), running.end());
      FMOE_RETURN_IF_ERROR(RunBatch(reqs, local, match, t0, out));
      finished.clear();
      batcher.Advance(&finished);
      for (uint32_t k : finished) cache_->OnRequestEnd(w_.requests[reqs[k]].id);
    }
    return Status::Ok();
  }

  uint64_t directives() const { return cache_->stats().directives; }
  double match_score() const {
    return score_count_ ? score_sum_ / static_cast<double>(score_count_) : 0.0;
  }
  bool full() const { return slots_ >= owned_; }
  Status CheckInvariants() const {
    FMOE_RETURN_IF_ERROR(cache_->CheckInvariants());
    return tiered_ != nullptr ? tiered_->CheckInvariants() : Status::Ok();
  }

 private:
  ServeRun(const ServeWorkload& w, const ServeConfig& c, Routes* routes)
      : w_(w), c_(c), routes_(routes), clock_(0), link_(clock_, c.time.LoadNs()) {}

  // Whether `s` ends its step: a chunk ends it when it reaches the prompt's end.
  static bool EndsStep(const ContinuousBatcher::Slot& s, uint32_t prompt) {
    return !s.chunk() || s.chunk_end == prompt;
  }
  // Whether `s` is the request's last (of `steps` steps, `prompt` prompt positions).
  static bool LastOfRequest(const ContinuousBatcher::Slot& s, uint32_t steps, uint32_t prompt) {
    return s.step + 1 == steps && EndsStep(s, prompt);
  }

  // The cache's link: the disk tier in front of the link when configured, else the link alone.
  TransferEngine& link() {
    return tiered_ != nullptr ? *tiered_ : static_cast<TransferEngine&>(link_);
  }

  Status Init(std::vector<LayerAccess> future, const MapStore* store) {
    const TraceHeader& h = w_.trace->header;
    const uint32_t L = h.num_layers, J = h.num_experts;
    PolicyOptions po;
    po.prefetch_distance = c_.distance;
    po.future = std::move(future);
    FMOE_ASSIGN_OR_RETURN(std::unique_ptr<CachePolicy> policy, MakePolicy(c_.policy, po));
    if (c_.hybrid) {
      auto view = std::make_unique<HybridView>(std::move(policy));
      view_ = view.get();
      policy = std::move(view);
    }
    // The host cache scores every expert it holds at each eviction: the scores are remembered
    // between changes (the same results, far fewer computed).
    if (c_.disk.enabled()) policy = std::make_unique<MemoPolicy>(std::move(policy));
    owned_ = L * J;
    FMOE_ASSIGN_OR_RETURN(slots_,
                          BudgetSlots(std::nullopt, c_.budget, kNominalExpertBytes, owned_));
    std::vector<const void*> host_ptrs(owned_);
    if (c_.disk.enabled()) {
      // The tier finds each expert by its key: no host addresses.
      SimTierOptions to;
      to.experts = owned_;
      to.host_slots = std::clamp<uint32_t>(
          static_cast<uint32_t>(std::floor(c_.disk.host_budget * owned_)), 1, owned_);
      to.expert_bytes = c_.time.expert_mb * 1e6;
      to.disk = c_.disk;
      FMOE_ASSIGN_OR_RETURN(tiered_, SimTieredLink::Create(clock_, c_.time.LoadNs(), to));
    } else {
      host_.resize(static_cast<size_t>(owned_) * kNominalExpertBytes);
      for (uint32_t k = 0; k < owned_; ++k) host_ptrs[k] = host_.data() + k * kNominalExpertBytes;
    }
    FMOE_ASSIGN_OR_RETURN(slot_memory_, link().AllocateDevice(slots_ * kNominalExpertBytes));
    ExpertCacheOptions co;
    co.num_layers = L;
    co.num_experts = J;
    co.top_k = h.top_k;
    co.expert_bytes = kNominalExpertBytes;
    co.slots = slots_;
    co.max_inflight_prefetches = c_.max_inflight_prefetches;
    co.preload = true;
    co.tiered = tiered_ != nullptr;
    FMOE_ASSIGN_OR_RETURN(cache_, ExpertCache::Create(co, std::move(policy), &link(),
                                                      std::move(host_ptrs), slot_memory_, clock_));
    if (tiered_ != nullptr) {
      // Host-cache eviction by the policy's score, as the worker's host tier.
      const ExpertCache* cache = cache_.get();
      tiered_->set_score(
          [cache, J](uint32_t key) { return cache->policy().EvictionScore(key / J, key % J); });
    }
    if (UsesMapService(c_.policy)) {
      if (store != nullptr) {
        store_.emplace(*store);
      } else {
        FMOE_ASSIGN_OR_RETURN(MapStore empty,
                              MapStore::Create(StoreOptions(h, c_.store_capacity, c_.distance)));
        store_.emplace(std::move(empty));
      }
      MatcherOptions mo;
      mo.prefetch_distance = c_.distance;
      mo.semantic = c_.policy != "fmoe-traj" && h.hidden > 0;
      mo.delta = c_.policy != "fmoe-traj-sem";
      matcher_ = std::make_unique<MapMatcher>(*store_, mo);
    }
    probs_.assign(J, 0.0f);
    return Status::Ok();
  }

  // One iteration of `local` (positions in `reqs` and their steps), with its figures.
  Status RunBatch(const std::vector<uint32_t>& reqs,
                  const std::vector<ContinuousBatcher::Slot>& local, bool match, int64_t t0,
                  Measured* out) {
    batch_.clear();
    bool prefill = false;
    for (const auto& s : local) {
      batch_.push_back({reqs[s.request], s.step, s.chunk_begin, s.chunk_end});
      if (s.step == 0) {
        if (s.chunk_begin == 0) out->timings[s.request].start_ns = clock_.NowNs() - t0;
        prefill = prefill || w_.requests[reqs[s.request]].has_prefill;
      }
    }
    const CacheCounters before = cache_->stats().total;
    const SimTierStats tier_before = tiered_ != nullptr ? tiered_->tier_stats() : SimTierStats{};
    const int64_t start = clock_.NowNs();
    FMOE_RETURN_IF_ERROR(Iteration(batch_, match));
    const CacheCounters after = cache_->stats().total;
    const SimTierStats tier_after = tiered_ != nullptr ? tiered_->tier_stats() : SimTierStats{};
    const int64_t end = clock_.NowNs();
    PhaseFigures& p = prefill ? out->prefill : out->decode;
    ++p.iterations;
    for (size_t i = 0; i < batch_.size(); ++i) {
      const auto& s = batch_[i];
      p.tokens += its_[i]->tokens;
      // A chunked prefill counts once, at its last chunk.
      const uint32_t prompt = static_cast<uint32_t>(w_.requests[s.request].prompt_positions.size());
      if (!prefill || (s.step == 0 && EndsStep(s, prompt))) ++p.requests;
    }
    p.hits += after.hits - before.hits;
    p.misses += after.misses - before.misses;
    p.late_prefetches += after.late_prefetches - before.late_prefetches;
    p.on_demand_loads += after.on_demand_loads - before.on_demand_loads;
    p.prefetches_issued += after.prefetches_issued - before.prefetches_issued;
    p.prefetches_used += after.prefetches_used - before.prefetches_used;
    p.experts_moved += static_cast<double>(after.bytes_moved - before.bytes_moved) /
                       static_cast<double>(kNominalExpertBytes);
    p.stall_ns += static_cast<double>(after.stall_ns - before.stall_ns) + cpu_stall_ns_;
    p.misses += cpu_experts_;
    p.cpu_experts += cpu_experts_;
    p.cpu_ns += cpu_ns_;
    p.cpu_stall_ns += cpu_stall_ns_;
    p.host_loads += tier_after.loads - tier_before.loads;
    p.host_hits += tier_after.host_hits - tier_before.host_hits;
    p.disk_reads += tier_after.disk_reads - tier_before.disk_reads;
    p.hinted_reads += tier_after.hinted_reads - tier_before.hinted_reads;
    p.hints_yielded += tier_after.hints_yielded - tier_before.hints_yielded;
    p.hints_late += tier_after.hints_late - tier_before.hints_late;
    p.disk_bytes += tier_after.bytes_read - tier_before.bytes_read;
    p.disk_stall_ns += static_cast<double>(tier_after.disk_stall_ns - tier_before.disk_stall_ns);
    p.time_ns += static_cast<double>(end - start);
    ++out->iterations;
    out->batch_sum += batch_.size();
    out->schedule.push_back(batch_);
    for (const auto& s : local) {
      RequestTiming& t = out->timings[s.request];
      if (s.step == 0) {
        ++t.prefill_iterations;
        const uint32_t prompt =
            static_cast<uint32_t>(w_.requests[reqs[s.request]].prompt_positions.size());
        if (!EndsStep(s, prompt)) continue;  // No token before the last chunk.
        t.first_token_ns = end - t0;
      }
      t.last_token_ns = end - t0;
    }
    return Status::Ok();
  }

  void Post() {
    for (PrefetchDirective& d : directives_) {
      score_sum_ += d.score;
      ++score_count_;
      cache_->PostDirective(std::move(d));
    }
    directives_.clear();
  }

  // One engine iteration of `batch` (workload request indices and their steps).
  Status Iteration(const std::vector<ContinuousBatcher::Slot>& batch, bool match) {
    const TraceHeader& h = w_.trace->header;
    const uint32_t L = h.num_layers, J = h.num_experts;
    seqs_.clear();
    // A chunk is a prefill-like iteration of its request: step 0, the chunk's tokens.
    its_ = routes_->Of(batch);
    uint64_t tokens = 0;
    for (size_t s = 0; s < batch.size(); ++s) {
      seqs_.push_back(
          SequenceInfo{w_.requests[batch[s].request].id, batch[s].step, its_[s]->tokens});
      tokens += its_[s]->tokens;
    }
    cache_->BeginIteration(seqs_);
    cpu_experts_ = 0;
    cpu_ns_ = cpu_stall_ns_ = 0;
    if (match) {
      maps_.resize(batch.size());
      for (size_t s = 0; s < batch.size(); ++s) {
        const TraceIteration& it = *its_[s];
        it.FillMap(h, &maps_[s]);
        matcher_->OnIterationStart(
            IterationStart{seqs_[s].request_id, seqs_[s].iteration, SemOf(h, it)}, &directives_);
        Post();
      }
    }
    cache_->Pump();
    const uint32_t speculate = cache_->speculation_distance();
    for (uint32_t l = 0; l < L; ++l) {
      if (speculate > 0) Speculate(batch, l, speculate, tokens);
      BatchUnion(w_, its_, l, &experts_, &tokens_, &sequence_counts_);
      const int64_t layer_start = clock_.NowNs();
      split_ = LayerSplit{};
      if (view_ != nullptr) SplitToCpu(l, batch.size());
      FMOE_RETURN_IF_ERROR(
          cache_->BeginLayer(LayerRouting{l, experts_, tokens_, sequence_counts_}));
      if (match) {
        for (size_t s = 0; s < batch.size(); ++s) {
          const float* row = maps_[s].data() + static_cast<size_t>(l) * J;
          matcher_->OnLayerObserved(LayerObserved{seqs_[s].request_id, seqs_[s].iteration, l,
                                                  std::vector<float>(row, row + J)},
                                    &directives_);
          Post();
        }
      }
      while (true) {
        auto ready = cache_->Next();
        if (!ready.ok()) {
          if (ready.status().code() == ErrorCode::kNotFound) break;
          return ready.status();
        }
        if (!ready->error.ok()) return ready->error;  // The replay's links never fail a load.
        cache_->Done(ready->expert);
      }
      if (!split_.cpu.empty()) {
        // The layer computes once the CPU's experts are done too.
        const int64_t wait = layer_start + split_.cpu_done_ns - clock_.NowNs();
        if (wait > 0) {
          clock_.AdvanceNs(wait);
          cpu_stall_ns_ += static_cast<double>(wait);
        }
        cpu_experts_ += split_.cpu.size();
        cpu_ns_ += static_cast<double>(split_.cpu_busy_ns);
      }
      clock_.AdvanceNs(c_.time.LayerNs(tokens));
      cache_->EndLayer();
    }
    cache_->EndIteration();
    if (match) {
      for (size_t s = 0; s < batch.size(); ++s) {
        const ServeRequest& r = w_.requests[batch[s].request];
        const bool last = LastOfRequest(batch[s], static_cast<uint32_t>(r.steps.size()),
                                        static_cast<uint32_t>(r.prompt_positions.size()));
        auto done = matcher_->OnIterationEnd(IterationEnd{r.id, batch[s].step, last});
        if (done) {
          FMOE_ASSIGN_OR_RETURN(auto inserted,
                                store_->Insert(next_map_id_++, done->sem, done->map));
          (void)inserted;
        }
      }
    }
    return Status::Ok();
  }

  // Hybrid: splits the missing experts of layer `l` (experts_, tokens_: the batch's union)
  // between the link and the CPU (split_), and leaves in experts_, tokens_ and
  // sequence_counts_ only the link's share, for the cache; the view shows the policy the whole.
  void SplitToCpu(uint32_t l, size_t sequences) {
    const uint32_t J = w_.trace->header.num_experts;
    cache_->Pump();  // Transfers finished by now count as resident.
    const int64_t load_ns = c_.time.LoadNs();
    missing_.clear();
    for (size_t i = 0; i < experts_.size(); ++i) {
      const uint32_t key = l * J + experts_[i];
      if (view_->resident(key)) continue;
      const int64_t left = link_.RemainingNs(host_.data() + key * kNominalExpertBytes);
      missing_.push_back(MissingExpert{experts_[i], left >= 0 ? left : load_ns,
                                       c_.cpu.ExpertNs(tokens_[i], load_ns)});
    }
    // On-demand loads go ahead of the prefetches on the link, and the CPU is idle at a layer's
    // start (the previous layer waited for it).
    split_ = SplitLayer(missing_, 0, 0);
    if (split_.cpu.empty()) return;
    full_experts_ = experts_;
    full_tokens_ = tokens_;
    full_counts_ = sequence_counts_;
    full_routing_ = LayerRouting{l, full_experts_, full_tokens_, full_counts_};
    size_t kept = 0, next_cpu = 0;
    for (size_t i = 0; i < experts_.size(); ++i) {
      const uint32_t e = experts_[i];
      if (next_cpu < split_.cpu.size() && split_.cpu[next_cpu] == e) {
        ++next_cpu;
        for (size_t s = 0; s < sequences; ++s) sequence_counts_[s * J + e] = 0;
        continue;
      }
      experts_[kept] = e;
      tokens_[kept] = tokens_[i];
      ++kept;
    }
    experts_.resize(kept);
    tokens_.resize(kept);
    view_->SetCpuRun(&full_routing_, &split_.cpu);
  }

  // The batch's speculative predictions made before layer `l`: per target, each request's
  // fractions weighted by its share of the iteration's tokens.
  void Speculate(const std::vector<ContinuousBatcher::Slot>& batch, uint32_t l, uint32_t ahead,
                 uint64_t tokens) {
    const uint32_t L = w_.trace->header.num_layers;
    for (uint32_t target = l + 1; target < L && target <= l + ahead; ++target) {
      std::fill(probs_.begin(), probs_.end(), 0.0f);
      bool any = false;
      for (size_t s = 0; s < batch.size(); ++s) {
        const TraceIteration& it = *its_[s];
        const float share = static_cast<float>(it.tokens) / static_cast<float>(tokens);
        for (const TraceSpeculation& sp : it.speculation) {
          if (sp.layer != l || sp.target != target) continue;
          for (size_t e = 0; e < sp.experts.size(); ++e) {
            probs_[sp.experts[e]] += sp.fractions[e] * share;
          }
          any = true;
        }
      }
      if (any) cache_->Speculate(l, target, probs_);
    }
  }

  const ServeWorkload& w_;
  ServeConfig c_;
  Routes* routes_;
  std::vector<const TraceIteration*> its_;  // The running iteration's routings.
  ManualClock clock_;
  SimLink link_;
  std::unique_ptr<SimTieredLink> tiered_;  // The disk tier, when configured (link() then).
  uint32_t owned_ = 0, slots_ = 0;
  std::vector<char> host_;
  void* slot_memory_ = nullptr;
  std::unique_ptr<ExpertCache> cache_;
  HybridView* view_ = nullptr;  // Hybrid runs: owned by the cache, between it and the policy.
  std::vector<MissingExpert> missing_;
  LayerSplit split_;
  std::vector<uint32_t> full_experts_, full_tokens_, full_counts_;  // The layer, CPU's included.
  LayerRouting full_routing_;                                       // Spans of the three above.
  uint64_t cpu_experts_ = 0;  // This iteration's, for RunBatch.
  double cpu_ns_ = 0, cpu_stall_ns_ = 0;
  std::optional<MapStore> store_;
  std::unique_ptr<MapMatcher> matcher_;
  uint64_t next_map_id_ = 1'000'000'000;
  double score_sum_ = 0;
  uint64_t score_count_ = 0;
  std::vector<PrefetchDirective> directives_;
  std::vector<SequenceInfo> seqs_;
  std::vector<ContinuousBatcher::Slot> batch_;  // Workload indices of the running iteration.
  std::vector<std::vector<float>> maps_;
  std::vector<uint32_t> experts_, tokens_, sequence_counts_;
  std::vector<float> probs_;
};

}  // namespace

Result<MapStore> WarmServeStore(const ServeWorkload& w, const std::vector<uint32_t>& train,
                                uint32_t capacity, uint32_t distance) {
  const TraceHeader& h = w.trace->header;
  FMOE_ASSIGN_OR_RETURN(MapStore store, MapStore::Create(StoreOptions(h, capacity, distance)));
  std::vector<float> map;
  uint64_t id = 1;
  for (uint32_t r : train) {
    for (const TraceIteration* it : w.requests.at(r).steps) {
      it->FillMap(h, &map);
      FMOE_ASSIGN_OR_RETURN(auto inserted, store.Insert(id++, SemOf(h, *it), map));
      (void)inserted;
    }
  }
  return store;
}

Result<ServeResult> RunServeReplay(const ServeWorkload& w, const std::vector<uint32_t>& train,
                                   const std::vector<uint32_t>& test,
                                   const std::vector<int64_t>& arrival_ns, const ServeConfig& c,
                                   const MapStore* warm_store) {
  const auto wall_start = std::chrono::steady_clock::now();
  const uint32_t L = w.trace->header.num_layers;
  if (!(c.budget > 0.0 && c.budget <= 1.0)) {
    return InvalidArgument("budget " + std::to_string(c.budget) + " is not in (0, 1]");
  }
  if (c.distance < 1 || c.distance > L) {
    return InvalidArgument("prefetch distance " + std::to_string(c.distance) + " is not in 1.." +
                           std::to_string(L));
  }
  if (c.max_batch < 1) return InvalidArgument("max batch must be at least 1");
  if (c.max_batched_tokens > 0) {
    // A chunk's routing is its prompt positions' own: only a trace of them has it.
    if (w.kind != TraceKind::kPromptPositions) {
      return InvalidArgument(
          "max batched tokens " + std::to_string(c.max_batched_tokens) +
          " (chunked prefill) needs the routing of each prompt position, and the trace kind " +
          std::string(TraceKindName(w.kind)) +
          " has none (iterations: a prefill's routing is recorded whole; decode-positions: no "
          "prefill is recorded); use 0 or a prompt-positions trace");
    }
    for (const ServeRequest& r : w.requests) {
      for (const TraceIteration* p : r.prompt_positions) {
        if (p->tokens != 1) {
          return InvalidArgument("chunked prefill: a prompt position of request " +
                                 std::to_string(r.id) + " holds " + std::to_string(p->tokens) +
                                 " tokens, not 1");
        }
      }
    }
  }
  if (arrival_ns.size() != test.size()) {
    return InvalidArgument(std::to_string(arrival_ns.size()) + " arrival times for " +
                           std::to_string(test.size()) + " requests");
  }
  for (uint32_t r : train) {
    if (r >= w.requests.size()) return InvalidArgument("train request out of range");
  }
  for (uint32_t r : test) {
    if (r >= w.requests.size()) return InvalidArgument("test request out of range");
  }
  FMOE_RETURN_IF_ERROR(ValidateTimeModel(c.time));
  FMOE_RETURN_IF_ERROR(ValidateCpuModel(c.cpu));
  if (c.hybrid && !c.cpu.enabled()) {
    return InvalidArgument("hybrid execution needs a CPU model (a factor c or measured times)");
  }
  if (c.disk.enabled()) {
    FMOE_RETURN_IF_ERROR(ValidateDiskModel(c.disk));
    if (c.hybrid) {
      return InvalidArgument(
          "the disk tier (host budget) does not model hybrid execution: run one or the other");
    }
    if (!(c.time.expert_mb > 0)) return InvalidArgument("the disk tier needs the expert's MB");
  }
  const bool fmoe = UsesMapService(c.policy);
  const bool oracle = c.policy == "oracle";
  const bool warm = !c.online && !oracle;
  if (fmoe && warm && warm_store == nullptr) {
    return InvalidArgument("offline replay of " + c.policy + " needs a warmed store");
  }

  ServeResult result;
  result.config = c;
  ServeRun::Measured measured;
  std::unique_ptr<ServeRun> run;
  Routes routes(w);
  if (oracle) {
    // The oracle knows the accesses to come, but batches depend on timing, which depends on the
    // oracle: run until the schedule it was told is the one it ran (or out of passes).
    Schedule told = ComputeOnlySchedule(w, test, arrival_ns, c, routes);
    for (uint32_t pass = 1;; ++pass) {
      // The last pass runs the schedule it was told, each batch waiting for its new requests.
      const bool force = pass > c.oracle_passes;
      FMOE_ASSIGN_OR_RETURN(run,
                            ServeRun::Create(w, c, &routes, AccessLog(w, told, routes), nullptr));
      measured = ServeRun::Measured{};
      FMOE_RETURN_IF_ERROR(
          run->Serve(test, arrival_ns, /*match=*/false, &measured, force ? &told : nullptr));
      result.oracle_passes = pass;
      result.oracle_forced = force;
      if (force || SameSchedule(measured.schedule, told)) break;
      told = std::move(measured.schedule);
    }
  } else {
    FMOE_ASSIGN_OR_RETURN(run, ServeRun::Create(w, c, &routes, {}, warm ? warm_store : nullptr));
    if (warm) {
      // The train split warms the caches, frequency counts and EAM collections; the fmoe
      // policies' store is already warm, so their directives are not computed here.
      ServeRun::Measured ignored;
      FMOE_RETURN_IF_ERROR(run->Serve(train, std::vector<int64_t>(train.size(), 0),
                                      /*match=*/false, &ignored));
    }
    // A budget that holds every expert moves nothing and the cache consults no policy.
    const bool match = fmoe && !run->full();
    const uint64_t directives_before = run->directives();
    FMOE_RETURN_IF_ERROR(run->Serve(test, arrival_ns, match, &measured));
    result.directives = run->directives() - directives_before;
    result.match_score = run->match_score();
  }
  FMOE_RETURN_IF_ERROR(run->CheckInvariants());
  result.requests = std::move(measured.timings);
  result.prefill = measured.prefill;
  result.decode = measured.decode;
  result.iterations = measured.iterations;
  result.mean_batch = measured.iterations ? static_cast<double>(measured.batch_sum) /
                                                static_cast<double>(measured.iterations)
                                          : 0.0;
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (const RequestTiming& t : result.requests) {
    first = std::min(first, t.arrival_ns);
    last = std::max(last, t.last_token_ns);
  }
  result.total_ns = result.requests.empty() ? 0.0 : static_cast<double>(last - first);
  result.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace fmoe::bench
