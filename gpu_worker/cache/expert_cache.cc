#include "gpu_worker/cache/expert_cache.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "common/log.h"

namespace fmoe {
namespace {

// Weight of a new sample in the moving averages of layer compute and expert load time.
constexpr double kAverageWeight = 0.2;
// Next() gives up when the link has finished nothing for this long.
constexpr int64_t kLinkSilenceNs = 30'000'000'000;
// Loads of an expert the running layer needs before it is handed out as failed: the first
// failure is retried once (a transient read error passes; a file cut short fails again).
constexpr uint8_t kLoadAttempts = 2;

void Average(double* avg, double sample) {
  *avg = *avg == 0.0 ? sample : (1.0 - kAverageWeight) * *avg + kAverageWeight * sample;
}

}  // namespace

CacheCounters& CacheCounters::operator+=(const CacheCounters& o) {
  hits += o.hits;
  misses += o.misses;
  late_prefetches += o.late_prefetches;
  on_demand_loads += o.on_demand_loads;
  prefetches_issued += o.prefetches_issued;
  prefetches_used += o.prefetches_used;
  prefetches_wasted += o.prefetches_wasted;
  prefetches_cancelled += o.prefetches_cancelled;
  evictions += o.evictions;
  forced_evictions += o.forced_evictions;
  bytes_moved += o.bytes_moved;
  stall_ns += o.stall_ns;
  host_runs += o.host_runs;
  host_ns += o.host_ns;
  bytes_not_moved += o.bytes_not_moved;
  host_runs_admitted += o.host_runs_admitted;
  disk_reads += o.disk_reads;
  disk_stall_ns += o.disk_stall_ns;
  failed_loads += o.failed_loads;
  failed_experts += o.failed_experts;
  stream_loads += o.stream_loads;
  stream_wasted += o.stream_wasted;
  return *this;
}

Result<uint32_t> BudgetSlots(std::optional<double> gb, std::optional<double> fraction,
                             size_t expert_bytes, uint32_t owned_experts) {
  if (expert_bytes == 0 || owned_experts == 0) {
    return InvalidArgument("expert cache: no experts to cache");
  }
  double slots = 0.0;
  std::string what;
  if (gb) {
    slots = std::floor(*gb * 1e9 / static_cast<double>(expert_bytes));
    what = "expert_cache_gb " + std::to_string(*gb);
  } else {
    const double f = fraction.value_or(1.0);
    // A hair of slack so that 0.25 * 64 is 16, not 15.999.
    slots = std::floor(f * owned_experts + 1e-9);
    what = "expert_cache_fraction " + std::to_string(f);
  }
  if (!(slots >= 1.0)) {
    return InvalidArgument("expert cache: " + what + " holds no expert of " +
                           std::to_string(expert_bytes) + " bytes; at least one must fit");
  }
  return static_cast<uint32_t>(std::min<double>(slots, owned_experts));
}

Result<std::unique_ptr<ExpertCache>> ExpertCache::Create(ExpertCacheOptions options,
                                                         std::unique_ptr<CachePolicy> policy,
                                                         TransferEngine* link,
                                                         std::vector<const void*> host,
                                                         void* slot_memory, Clock& clock) {
  const auto bad = [](const std::string& what) { return InvalidArgument("expert cache: " + what); };
  if (options.num_layers == 0 || options.num_experts == 0) return bad("no layers or experts");
  if (options.top_k == 0 || options.top_k > options.num_experts) {
    return bad("top_k " + std::to_string(options.top_k) + " is not in 1.." +
               std::to_string(options.num_experts));
  }
  if (options.world_size == 0 || options.rank >= options.world_size) {
    return bad("rank " + std::to_string(options.rank) + " is not below world size " +
               std::to_string(options.world_size));
  }
  if (options.expert_bytes == 0) return bad("expert_bytes is 0");
  if (options.slot_stride != 0 && options.slot_stride < options.expert_bytes) {
    return bad("slot_stride " + std::to_string(options.slot_stride) + " is below expert_bytes " +
               std::to_string(options.expert_bytes));
  }
  if (options.max_inflight_prefetches == 0) return bad("max_inflight_prefetches is 0");
  if (policy == nullptr || link == nullptr || slot_memory == nullptr) {
    return bad("missing policy, link or slot memory");
  }
  const size_t total = static_cast<size_t>(options.num_layers) * options.num_experts;
  if (host.size() != total) {
    return bad("host addresses for " + std::to_string(host.size()) + " experts, expected " +
               std::to_string(total));
  }
  uint32_t owned = 0;
  for (size_t key = 0; key < total; ++key) {
    const bool mine = key % options.world_size == options.rank;
    owned += mine ? 1 : 0;
    if (options.tiered) {
      if (host[key] != nullptr) return bad("a tiered link takes no host addresses");
      continue;
    }
    if (mine != (host[key] != nullptr)) {
      return bad("expert " + std::to_string(key % options.num_experts) + " of layer " +
                 std::to_string(key / options.num_experts) +
                 (mine ? " has no host copy" : " belongs to another rank but has a host copy"));
    }
  }
  if (options.slots == 0 || options.slots > owned) {
    return bad("slots " + std::to_string(options.slots) + " is not in 1.." + std::to_string(owned));
  }
  std::unique_ptr<ExpertCache> cache(new ExpertCache(std::move(options), std::move(policy), link,
                                                     std::move(host), slot_memory, clock));
  if (cache->options_.preload) FMOE_RETURN_IF_ERROR(cache->Preload());
  return cache;
}

ExpertCache::ExpertCache(ExpertCacheOptions options, std::unique_ptr<CachePolicy> policy,
                         TransferEngine* link, std::vector<const void*> host, void* slot_memory,
                         Clock& clock)
    : options_(std::move(options)),
      policy_(std::move(policy)),
      link_(link),
      host_(std::move(host)),
      slots_base_(static_cast<char*>(slot_memory)),
      clock_(clock) {
  const size_t total = static_cast<size_t>(options_.num_layers) * options_.num_experts;
  entries_.resize(total);
  queue_index_.assign(total, -1);
  slot_owner_.assign(options_.slots, -1);
  slot_fence_.assign(options_.slots, 0);
  slot_lent_.assign(options_.slots, 0);
  slot_stride_ = options_.slot_stride != 0 ? options_.slot_stride : options_.expert_bytes;
  for (uint32_t s = options_.slots; s > 0; --s) free_slots_.push_back(static_cast<int32_t>(s - 1));
  counters_.resize(options_.num_layers);
  for (size_t key = 0; key < total; ++key) {
    owned_ += key % options_.world_size == options_.rank ? 1 : 0;
  }
  policy_->Attach(this);
}

ExpertCache::~ExpertCache() {
  // Cancel what is still on the link, so no copy writes a slot after the owner frees it.
  if (!LinkBusy()) return;
  for (const auto& [id, key] : tasks_) link_->Cancel(id);
  for (const auto& [id, where] : stream_tasks_) link_->Cancel(id);
  const int64_t deadline = clock_.NowNs() + kLinkSilenceNs;
  while (LinkBusy() && clock_.NowNs() < deadline) {
    done_.clear();
    link_->Wait(&done_, std::chrono::milliseconds(100));
    for (const TransferDone& d : done_) {
      tasks_.erase(d.id);
      stream_tasks_.erase(d.id);
    }
  }
}

Status ExpertCache::Preload() {
  for (uint32_t key = 0; key < entries_.size() && !free_slots_.empty(); ++key) {
    if (key % options_.world_size != options_.rank) continue;
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    SubmitLoad(key, slot, /*on_demand=*/true, 0.0);
  }
  // Preloading is set-up, not serving: its transfers are not in the counters.
  while (!tasks_.empty()) FMOE_RETURN_IF_ERROR(WaitForLink());
  full_ = free_slots_.empty() && options_.slots >= owned_;
  for (CacheCounters& c : counters_) {
    preload_bytes_ += c.bytes_moved;
    c = CacheCounters{};
  }
  return Status::Ok();
}

bool ExpertCache::Owns(uint32_t layer, uint32_t expert) const {
  return layer < options_.num_layers && expert < options_.num_experts &&
         Key(layer, expert) % options_.world_size == options_.rank;
}

bool ExpertCache::Evictable(const Entry& e) const {
  return e.state == Residency::kResident && !e.pinned && e.protect_until == 0;
}

// ---- slots and transfers ----

int32_t ExpertCache::Victim(bool force, bool* is_protected) const {
  int32_t victim = -1;
  double victim_score = 0.0;
  bool victim_protected = false;
  for (int32_t owner : slot_owner_) {
    if (owner < 0) continue;
    const Entry& e = entries_[owner];
    if (e.state != Residency::kResident || e.pinned) continue;
    const bool prot = e.protect_until != 0;
    if (prot && !force) continue;
    const double score =
        policy_->EvictionScore(static_cast<uint32_t>(owner) / options_.num_experts,
                               static_cast<uint32_t>(owner) % options_.num_experts);
    // Unprotected experts go before protected ones; then by score; then by key.
    const bool better = victim < 0 || (victim_protected && !prot) ||
                        (victim_protected == prot &&
                         (score < victim_score || (score == victim_score && owner < victim)));
    if (better) {
      victim = owner;
      victim_score = score;
      victim_protected = prot;
    }
  }
  *is_protected = victim_protected;
  return victim;
}

int32_t ExpertCache::TakeSlot(bool force) {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  bool victim_protected = false;
  const int32_t victim = Victim(force, &victim_protected);
  if (victim < 0) return -1;
  if (victim_protected)
    ++counters_[static_cast<uint32_t>(victim) / options_.num_experts].forced_evictions;
  Evict(static_cast<uint32_t>(victim));
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}

std::optional<uint32_t> ExpertCache::LendSlot(uint32_t keep) {
  if (in_layer_ || active_slots() <= std::max<uint32_t>(keep, 1)) return std::nullopt;
  while (free_slots_.empty()) {
    bool is_protected = false;
    int32_t victim = Victim(/*force=*/false, &is_protected);
    if (victim < 0) victim = Victim(/*force=*/true, &is_protected);
    if (victim >= 0) {
      Evict(static_cast<uint32_t>(victim));
      break;
    }
    // Every slot is loading (prefetches between iterations): the next load to finish leaves an
    // expert to give up. Every rank of a group lends when its leader did, so it waits rather
    // than fail.
    if (!AwaitTransfer().ok()) return std::nullopt;
  }
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slot_lent_[slot] = 1;
  ++lent_;
  ++slots_lent_;
  full_ = false;  // An expert left, or a free slot went: the policy decides again.
  return static_cast<uint32_t>(slot);
}

void ExpertCache::ReturnSlot(uint32_t slot) {
  if (slot >= slot_lent_.size() || slot_lent_[slot] == 0) return;
  slot_lent_[slot] = 0;
  --lent_;
  slot_fence_[slot] = 1;
  free_slots_.push_back(static_cast<int32_t>(slot));
}

void ExpertCache::Evict(uint32_t key) {
  Entry& e = entries_[key];
  const uint32_t layer = key / options_.num_experts;
  CacheCounters& c = counters_[layer];
  if (e.prefetched) {
    ++c.prefetches_wasted;
    e.prefetched = false;
  }
  ++c.evictions;
  slot_owner_[e.slot] = -1;
  free_slots_.push_back(e.slot);
  e.slot = -1;
  e.state = Residency::kOnHost;
  e.protect_until = 0;
  policy_->OnEvicted(layer, key % options_.num_experts);
}

void ExpertCache::SubmitLoad(uint32_t key, int32_t slot, bool on_demand, double priority) {
  Entry& e = entries_[key];
  e.state = Residency::kLoading;
  e.slot = slot;
  e.on_demand = on_demand;
  e.task = next_task_++;
  slot_owner_[slot] = static_cast<int32_t>(key);
  tasks_.emplace(e.task, key);
  TransferTask task;
  task.id = e.task;
  task.src = host_[key];
  task.key = key;
  task.dst = slots_base_ + static_cast<size_t>(slot) * slot_stride_;
  task.bytes = options_.expert_bytes;
  task.on_demand = on_demand;
  task.priority = priority;
  // The latest fence follows every read of every slot so far (compute is in order).
  task.wait_fence = std::exchange(slot_fence_[slot], 0) != 0 ? latest_fence_ : 0;
  CacheCounters& c = counters_[key / options_.num_experts];
  if (on_demand) {
    ++inflight_on_demand_;
    ++c.on_demand_loads;
    layer_loaded_on_demand_ = true;
  } else {
    ++inflight_prefetches_;
    ++c.prefetches_issued;
  }
  link_->Submit(task);
}

void ExpertCache::Complete(const TransferDone& done) {
  if (auto st = stream_tasks_.find(done.id); st != stream_tasks_.end()) {
    const auto [slot, key] = st->second;
    stream_tasks_.erase(st);
    CompleteStream(slot, key, done);
    return;
  }
  auto it = tasks_.find(done.id);
  if (it == tasks_.end()) {
    spdlog::warn("expert cache: completion for unknown transfer {}", done.id);
    return;
  }
  const uint32_t key = it->second;
  tasks_.erase(it);
  Entry& e = entries_[key];
  const uint32_t layer = key / options_.num_experts;
  CacheCounters& c = counters_[layer];
  c.bytes_moved += done.bytes_copied;
  if (e.on_demand) {
    --inflight_on_demand_;
  } else {
    --inflight_prefetches_;
  }
  e.on_demand = false;
  e.task = 0;
  if (!done.status.ok()) {
    // The source could not be read: back on the host, its slot freed (below). The running layer,
    // if it needs the expert, loads it once more on demand (TopUp), then takes it as failed
    // (Next); any later layer or iteration loads it afresh.
    ++c.failed_loads;
    const char* next = "a later use loads it again";
    if (e.needed) {
      ++e.failed_loads;
      if (e.failed_loads >= kLoadAttempts) {
        e.error = done.status;
        next = "the running layer goes on without it";
      } else {
        next = "retrying once";
      }
    }
    spdlog::warn("expert cache: layer={} expert={}: load failed ({}): {}", layer,
                 key % options_.num_experts, next, done.status.ToString());
  }
  if (done.cancelled || !done.status.ok()) {
    if (done.cancelled) ++c.prefetches_cancelled;
    slot_owner_[e.slot] = -1;
    free_slots_.push_back(e.slot);
    e.slot = -1;
    e.state = Residency::kOnHost;
    e.prefetched = false;
    e.protect_until = 0;
    return;
  }
  if (done.end_ns > done.start_ns)
    Average(&load_ns_, static_cast<double>(done.end_ns - done.start_ns));
  e.state = Residency::kResident;
  policy_->OnResident(layer, key % options_.num_experts);
}

Status ExpertCache::WaitForLink() {
  const int64_t start = clock_.NowNs();
  while (true) {
    done_.clear();
    const size_t n = link_->Wait(&done_, std::chrono::milliseconds(100));
    for (const TransferDone& d : done_) Complete(d);
    if (n > 0) return Status::Ok();
    if (!LinkBusy()) {
      return Internal("expert cache: waiting for an expert with nothing on the link");
    }
    if (clock_.NowNs() - start > kLinkSilenceNs) {
      return Unavailable("expert cache: the " + std::string(link_->name()) +
                         " link finished no transfer in 30 s (" +
                         std::to_string(tasks_.size() + stream_tasks_.size()) + " in flight)");
    }
  }
}

Status ExpertCache::AwaitTransfer() {
  if (!LinkBusy()) return NotFound("expert cache: nothing on the link");
  return WaitForLink();
}

// ---- the prefetch queue ----

void ExpertCache::Prefetch(uint32_t layer, uint32_t expert, double priority) {
  if (!Owns(layer, expert) || !std::isfinite(priority)) return;
  const uint64_t position = Position(layer);
  if (position <= started_) {
    ++prefetch_requests_dropped_;
    return;
  }
  const uint32_t key = Key(layer, expert);
  Entry& e = entries_[key];
  if (e.state != Residency::kOnHost) {
    // Already here or coming: keep it for that layer.
    e.protect_until = std::max(e.protect_until, position);
    return;
  }
  const int32_t index = queue_index_[key];
  if (index >= 0) {
    queue_[index].position = position;
    queue_[index].priority = priority;
    return;
  }
  queue_index_[key] = static_cast<int32_t>(queue_.size());
  queue_.push_back({key, position, priority});
}

void ExpertCache::ClearPrefetches() {
  for (const QueuedPrefetch& q : queue_) queue_index_[q.key] = -1;
  queue_.clear();
}

void ExpertCache::RemoveQueued(size_t index) {
  queue_index_[queue_[index].key] = -1;
  if (index + 1 != queue_.size()) {
    queue_[index] = queue_.back();
    queue_index_[queue_[index].key] = static_cast<int32_t>(index);
  }
  queue_.pop_back();
}

void ExpertCache::DropStalePrefetches() {
  for (size_t i = queue_.size(); i > 0; --i) {
    if (queue_[i - 1].position <= started_) {
      ++prefetch_requests_dropped_;
      RemoveQueued(i - 1);
    }
  }
}

bool ExpertCache::DeadlineAllows(const QueuedPrefetch& q, uint32_t ahead) const {
  if (layer_compute_ns_ <= 0.0 || load_ns_ <= 0.0) return true;  // Nothing measured yet.
  const double layers_left = static_cast<double>(q.position - started_);
  return (ahead + 1) * load_ns_ <= layers_left * layer_compute_ns_;
}

int64_t ExpertCache::UseInNs(uint64_t position) const {
  if (layer_compute_ns_ <= 0.0) return -1;  // Nothing measured yet.
  const double layers = position > started_ ? static_cast<double>(position - started_) : 0.0;
  return static_cast<int64_t>(layers * layer_compute_ns_);
}

void ExpertCache::PostDirective(PrefetchDirective directive) {
  std::lock_guard<std::mutex> lock(inbox_mu_);
  inbox_.push_back(std::move(directive));
}

void ExpertCache::ApplyDirectives() {
  std::vector<PrefetchDirective> inbox;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    inbox.swap(inbox_);
  }
  for (const PrefetchDirective& d : inbox) ApplyDirective(d);
}

void ExpertCache::ApplyDirective(const PrefetchDirective& d) {
  if (options_.tiered) HintDirective(d);
  auto it = batch_.find(d.request_id);
  const bool current = in_iteration_ && it != batch_.end() && it->second == d.iteration &&
                       d.target_layer < options_.num_layers && Position(d.target_layer) > started_;
  if (!current) {
    ++directives_stale_;
    return;
  }
  for (const PrefetchEntry& entry : d.entries) {
    if (entry.expert >= options_.num_experts || !Owns(d.target_layer, entry.expert)) {
      ++directives_foreign_;
    }
  }
  ++directives_;
  policy_->OnDirective(d);
}

void ExpertCache::HintDirective(const PrefetchDirective& d) {
  // The slower tier looks further ahead than the device's window: a directive's likeliest
  // experts for its layer are likely again at that layer in the next iteration, so even a
  // directive too late for the device (its layer started) is worth reading into host memory.
  // The likeliest 2K, by probability; the tier bounds what it reads at once.
  if (d.target_layer >= options_.num_layers) return;
  hint_scratch_.clear();
  for (const PrefetchEntry& entry : d.entries) {
    if (entry.expert < options_.num_experts && Owns(d.target_layer, entry.expert) &&
        entry.probability > 0.0f) {
      hint_scratch_.push_back(entry);
    }
  }
  const size_t n = std::min<size_t>(hint_scratch_.size(), 2 * size_t{options_.top_k});
  std::partial_sort(hint_scratch_.begin(), hint_scratch_.begin() + static_cast<std::ptrdiff_t>(n),
                    hint_scratch_.end(), [](const PrefetchEntry& a, const PrefetchEntry& b) {
                      return a.probability > b.probability ||
                             (a.probability == b.probability && a.expert < b.expert);
                    });
  // Its use: this iteration's layer when it has not started, else the next iteration's.
  const uint64_t position = Position(d.target_layer) > started_
                                ? Position(d.target_layer)
                                : Position(d.target_layer) + options_.num_layers;
  const int64_t use_in_ns = UseInNs(position);
  for (size_t i = 0; i < n; ++i) {
    link_->Hint(Key(d.target_layer, hint_scratch_[i].expert), use_in_ns);
  }
}

void ExpertCache::TopUp() {
  // On-demand loads for the running layer first, evicting protected experts if they must.
  bool starved = false;
  if (in_layer_) {
    for (uint32_t key : layer_needed_) {
      Entry& e = entries_[key];
      if (!e.needed || !e.error.ok()) continue;  // Failed for this layer: not loaded again.
      if (e.state == Residency::kLoading && !e.on_demand) {
        link_->Promote(e.task);
        e.on_demand = true;
        --inflight_prefetches_;
        ++inflight_on_demand_;
      } else if (e.state == Residency::kOnHost && !e.host_run && !streaming_) {
        const int32_t slot = TakeSlot(/*force=*/true);
        if (slot < 0) {
          starved = true;
          break;
        }
        SubmitLoad(key, slot, /*on_demand=*/true, 0.0);
      }
    }
  }
  if (starved && inflight_on_demand_ == 0) {
    // Every slot is loading a prefetch: give one back.
    for (const auto& [id, key] : tasks_) {
      if (!entries_[key].on_demand) {
        link_->Cancel(id);
        break;
      }
    }
  }
  // A streamed iteration moves nothing into the slots: its misses come through the stream.
  if (streaming_) {
    StreamTopUp();
    return;
  }
  // A miss pauses prefetching until the running layer has what it needs.
  if (inflight_on_demand_ > 0 || starved) return;
  DropStalePrefetches();
  while (inflight_prefetches_ < options_.max_inflight_prefetches && !queue_.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < queue_.size(); ++i) {
      const QueuedPrefetch& a = queue_[i];
      const QueuedPrefetch& b = queue_[best];
      if (a.priority > b.priority ||
          (a.priority == b.priority &&
           (a.position < b.position || (a.position == b.position && a.key < b.key)))) {
        best = i;
      }
    }
    const QueuedPrefetch q = queue_[best];
    if (policy_->admit_by_deadline() && !DeadlineAllows(q, inflight_prefetches_)) {
      ++prefetch_requests_dropped_;
      RemoveQueued(best);
      continue;
    }
    const int32_t slot = TakeSlot(/*force=*/false);
    if (slot < 0) break;  // Everything resident is pinned or protected: wait.
    RemoveQueued(best);
    SubmitLoad(q.key, slot, /*on_demand=*/false, q.priority);
    Entry& e = entries_[q.key];
    e.prefetched = true;
    e.protect_until = q.position;
  }
  // What waits in the queue may come from a slower tier: the link can start on it now.
  if (options_.tiered) {
    for (const QueuedPrefetch& q : queue_) link_->Hint(q.key, UseInNs(q.position));
  }
}

void ExpertCache::Pump() {
  done_.clear();
  link_->Poll(&done_);
  for (const TransferDone& d : done_) Complete(d);
  ApplyDirectives();
  TopUp();
}

// ---- the forward pass ----

void ExpertCache::BeginIteration(std::span<const SequenceInfo> sequences) {
  ++iteration_;
  in_iteration_ = true;
  in_layer_ = false;
  layer_ = 0;
  started_ = Position(0) - 1;
  batch_.clear();
  batch_order_.clear();
  for (const SequenceInfo& s : sequences) {
    batch_[s.request_id] = s.iteration;
    batch_order_.push_back(s.request_id);
  }
  streaming_ = std::exchange(stream_next_, false) && !full_ && !stream_.empty();
  stream_layers_queued_ = 0;
  if (streaming_) {
    ++stream_iterations_;
    QueueStreamLayer(0);  // Loads while the embedding and layer 0's attention run.
  }
  if (full_) return;  // Every expert resident for good: nothing to predict or move.
  policy_->OnIterationStart(sequences);
  Pump();
}

void ExpertCache::Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) {
  if (target <= layer || target >= options_.num_layers || probs.size() != options_.num_experts) {
    return;
  }
  policy_->OnSpeculation(layer, target, probs);
}

Status ExpertCache::BeginLayer(const LayerRouting& routing) {
  const uint32_t layer = routing.layer;
  if (!in_iteration_ || in_layer_) {
    return FailedPrecondition("expert cache: BeginLayer(" + std::to_string(layer) +
                              ") outside an iteration or inside another layer");
  }
  if (layer >= options_.num_layers || Position(layer) <= started_) {
    return InvalidArgument("expert cache: layer " + std::to_string(layer) +
                           " is out of order or range");
  }
  if (routing.tokens.size() != routing.experts.size()) {
    return InvalidArgument("expert cache: " + std::to_string(routing.tokens.size()) +
                           " token counts for " + std::to_string(routing.experts.size()) +
                           " experts");
  }
  for (size_t i = 0; i < routing.experts.size(); ++i) {
    if (routing.experts[i] >= options_.num_experts ||
        (i > 0 && routing.experts[i] <= routing.experts[i - 1])) {
      return InvalidArgument("expert cache: layer " + std::to_string(layer) +
                             ": experts are not sorted, unique and below " +
                             std::to_string(options_.num_experts));
    }
  }
  ApplyDirectives();
  in_layer_ = true;
  layer_ = layer;
  started_ = Position(layer);
  layer_start_ns_ = clock_.NowNs();
  layer_stall_ns_ = 0;
  layer_loaded_on_demand_ = false;
  DropStalePrefetches();

  CacheCounters& c = counters_[layer];
  const size_t J = options_.num_experts;
  const bool per_sequence = routing.sequence_counts.size() == batch_order_.size() * J;
  std::vector<RequestUsage*>& usage = layer_usage_;
  usage.clear();
  if (per_sequence) {
    for (uint64_t id : batch_order_) usage.push_back(&usage_[id]);
  }
  layer_needed_.clear();
  for (size_t i = 0; i < routing.experts.size(); ++i) {
    if (!Owns(layer, routing.experts[i])) continue;
    const uint32_t key = Key(layer, routing.experts[i]);
    layer_needed_.push_back(key);
    entries_[key].tokens = routing.tokens[i];
  }
  if (per_sequence) {
    layer_sequence_counts_.assign(routing.sequence_counts.begin(), routing.sequence_counts.end());
  } else {
    layer_sequence_counts_.clear();
  }
  if (options_.hybrid && !full_ && !streaming_) SplitLayer();
  for (uint32_t key : layer_needed_) {
    const uint32_t expert = key % options_.num_experts;
    Entry& e = entries_[key];
    e.needed = true;
    e.pinned = true;
    const bool hit = e.state == Residency::kResident;
    // A miss that must be read from disk before its copy (a tiered link).
    const bool disk = !hit && !e.host_run && options_.tiered && !link_->Staged(key);
    if (hit) {
      ++c.hits;
    } else {
      ++c.misses;
      if (e.state == Residency::kLoading && !e.on_demand) ++c.late_prefetches;
      if (disk) ++c.disk_reads;
    }
    if (e.prefetched) {
      ++c.prefetches_used;
      e.prefetched = false;
    }
    e.protect_until = 0;
    for (size_t s = 0; s < usage.size(); ++s) {
      if (routing.sequence_counts[s * J + expert] == 0) continue;
      ++(hit ? usage[s]->hits : usage[s]->misses);
      if (disk) ++usage[s]->disk_reads;
      if (e.host_run) {
        ++usage[s]->host_runs;
        usage[s]->bytes_not_moved += options_.expert_bytes;
      } else if (e.state == Residency::kOnHost) {
        usage[s]->bytes_moved += options_.expert_bytes;
      }
    }
    if (!full_) policy_->OnUse(layer, expert, hit);
  }
  // Protection ends when the layer it was for starts: what it did not use was wasted, and a
  // prefetch for it still on the link is cancelled.
  for (uint32_t key = 0; key < entries_.size(); ++key) {
    Entry& e = entries_[key];
    if (e.protect_until == 0 || e.protect_until > started_) continue;
    e.protect_until = 0;
    if (e.prefetched) {
      ++counters_[key / options_.num_experts].prefetches_wasted;
      e.prefetched = false;
      // Still on the link: its layer has started without it, so its copy would only take link
      // time and a slot from the loads to come. The link reports it cancelled (Complete).
      if (e.state == Residency::kLoading && !e.on_demand) link_->Cancel(e.task);
    }
  }
  if (full_) return Status::Ok();
  if (streaming_) {
    // The layer's streamed experts it does not route to go; those it does and the stream does
    // not hold (a prefetch cancelled since its layer was queued, a failed load) go first.
    for (uint32_t j = 0; j < options_.num_experts; ++j) {
      const uint32_t key = Key(layer, j);
      if (!Owns(layer, j) || entries_[key].needed) continue;
      DequeueStream(key);
      if (stream_of_[key] >= 0) ReleaseStream(static_cast<uint32_t>(stream_of_[key]), true);
    }
    for (auto it = layer_needed_.rbegin(); it != layer_needed_.rend(); ++it) {
      const uint32_t key = *it;
      if (entries_[key].state != Residency::kOnHost) continue;
      const int32_t slot = stream_of_[key];
      if (slot >= 0) {
        if (stream_[slot].task != 0) link_->Promote(stream_[slot].task);
        continue;
      }
      DequeueStream(key);
      stream_queue_.push_front(key);
      stream_queued_[key] = 1;
    }
    if (stream_layers_queued_ <= layer + 1) QueueStreamLayer(layer + 1);
  }
  policy_->OnLayerStart(routing);
  TopUp();
  return Status::Ok();
}

// ---- streaming ----

Status ExpertCache::AttachStreamBuffer(void* memory, uint32_t slots) {
  if (memory == nullptr || slots == 0) {
    return InvalidArgument("expert cache: a stream buffer needs memory and at least one slot");
  }
  if (in_iteration_ || !stream_.empty()) {
    return FailedPrecondition("expert cache: a stream buffer is attached once, between iterations");
  }
  stream_base_ = static_cast<char*>(memory);
  stream_.assign(slots, StreamSlot{});
  for (uint32_t s = slots; s > 0; --s) stream_free_.push_back(static_cast<int32_t>(s - 1));
  stream_of_.assign(entries_.size(), -1);
  stream_queued_.assign(entries_.size(), 0);
  return Status::Ok();
}

void ExpertCache::QueueStreamLayer(uint32_t layer) {
  if (layer >= options_.num_layers) return;
  for (uint32_t j = 0; j < options_.num_experts; ++j) {
    const uint32_t key = Key(layer, j);
    if (!Owns(layer, j) || entries_[key].state != Residency::kOnHost || stream_of_[key] >= 0 ||
        stream_queued_[key] != 0) {
      continue;
    }
    stream_queue_.push_back(key);
    stream_queued_[key] = 1;
  }
  stream_layers_queued_ = layer + 1;
}

void ExpertCache::DequeueStream(uint32_t key) {
  if (stream_queued_[key] == 0) return;
  stream_queued_[key] = 0;
  stream_queue_.erase(std::find(stream_queue_.begin(), stream_queue_.end(), key));
}

bool ExpertCache::StealStreamSlot() {
  // A later layer's expert gives its slot up and goes back to the queue's end: a loaded one
  // first (its slot is free at once), else a loading one (free when the link reports it
  // cancelled); the latest expert among them.
  int32_t pick = -1;
  for (size_t s = 0; s < stream_.size(); ++s) {
    const int32_t key = stream_[s].key;
    if (key < 0 || static_cast<uint32_t>(key) / options_.num_experts <= layer_) continue;
    bool better = true;
    if (pick >= 0) {
      const bool loaded = stream_[s].task == 0;
      better = loaded != (stream_[pick].task == 0) ? loaded : key > stream_[pick].key;
    }
    if (better) pick = static_cast<int32_t>(s);
  }
  if (pick < 0) return false;
  const uint32_t key = static_cast<uint32_t>(stream_[pick].key);
  ReleaseStream(static_cast<uint32_t>(pick), /*wasted=*/false);
  stream_queue_.push_back(key);
  stream_queued_[key] = 1;
  return true;
}

void ExpertCache::StreamTopUp() {
  while (!stream_queue_.empty()) {
    const uint32_t key = stream_queue_.front();
    const bool running = in_layer_ && key / options_.num_experts == layer_;
    if (stream_free_.empty() && (!running || !StealStreamSlot() || stream_free_.empty())) break;
    stream_queue_.pop_front();
    stream_queued_[key] = 0;
    const uint32_t slot = static_cast<uint32_t>(stream_free_.back());
    stream_free_.pop_back();
    StreamSlot& s = stream_[slot];
    s.key = static_cast<int32_t>(key);
    s.task = next_task_++;
    stream_of_[key] = static_cast<int32_t>(slot);
    stream_tasks_.emplace(s.task, std::make_pair(slot, key));
    TransferTask task;
    task.id = s.task;
    task.src = host_[key];
    task.key = key;
    task.dst = stream_base_ + static_cast<size_t>(slot) * options_.expert_bytes;
    task.bytes = options_.expert_bytes;
    task.on_demand = running;
    task.wait_fence = std::exchange(s.fence, 0);
    ++counters_[key / options_.num_experts].stream_loads;
    link_->Submit(task);
  }
}

void ExpertCache::CompleteStream(uint32_t slot, uint32_t key, const TransferDone& done) {
  StreamSlot& s = stream_[slot];
  s.task = 0;
  const uint32_t layer = key / options_.num_experts;
  CacheCounters& c = counters_[layer];
  c.bytes_moved += done.bytes_copied;
  const bool attached = s.key == static_cast<int32_t>(key);
  if (done.status.ok() && !done.cancelled && attached) {
    if (done.end_ns > done.start_ns)
      Average(&load_ns_, static_cast<double>(done.end_ns - done.start_ns));
    return;  // Ready.
  }
  if (attached) {
    stream_of_[key] = -1;
    s.key = -1;
  }
  stream_free_.push_back(static_cast<int32_t>(slot));
  if (done.cancelled || done.status.ok()) return;
  ++c.failed_loads;
  Entry& e = entries_[key];
  const char* next = "a later use loads it again";
  if (attached && e.needed && in_layer_ && layer == layer_) {
    if (++e.failed_loads >= kLoadAttempts) {
      e.error = done.status;
      next = "the running layer goes on without it";
    } else {
      next = "retrying once";
      stream_queue_.push_front(key);
      stream_queued_[key] = 1;
    }
  }
  spdlog::warn("expert cache: layer={} expert={}: stream load failed ({}): {}", layer,
               key % options_.num_experts, next, done.status.ToString());
}

void ExpertCache::ReleaseStream(uint32_t slot, bool wasted) {
  StreamSlot& s = stream_[slot];
  if (s.key >= 0) {
    if (wasted) ++counters_[static_cast<uint32_t>(s.key) / options_.num_experts].stream_wasted;
    stream_of_[s.key] = -1;
    s.key = -1;
  }
  if (s.task != 0) {
    link_->Cancel(s.task);  // Free when the link reports it (CompleteStream).
  } else {
    stream_free_.push_back(static_cast<int32_t>(slot));
  }
}

void ExpertCache::EndStream() {
  for (uint32_t key : stream_queue_) stream_queued_[key] = 0;
  stream_queue_.clear();
  for (size_t s = 0; s < stream_.size(); ++s) {
    if (stream_[s].key >= 0) ReleaseStream(static_cast<uint32_t>(s), /*wasted=*/true);
  }
  streaming_ = false;
}

Result<ReadyExpert> ExpertCache::Next() {
  if (!in_layer_) return FailedPrecondition("expert cache: Next() outside a layer");
  while (true) {
    if (!full_) Pump();
    bool waiting = false;
    Entry* host_run = nullptr;
    uint32_t host_key = 0;
    for (uint32_t key : layer_needed_) {
      Entry& e = entries_[key];
      if (!e.needed) continue;
      if (!e.error.ok()) {
        // Its load failed twice: the layer goes on without it.
        e.needed = false;
        ++counters_[layer_].failed_experts;
        ReadyExpert failed;
        failed.expert = key % options_.num_experts;
        failed.error = e.error;
        return failed;
      }
      if (e.state == Residency::kResident) {
        e.needed = false;
        return ReadyExpert{key % options_.num_experts, static_cast<uint32_t>(e.slot), false, {}};
      }
      if (streaming_ && stream_of_[key] >= 0 && stream_[stream_of_[key]].task == 0) {
        e.needed = false;
        return ReadyExpert{key % options_.num_experts,
                           static_cast<uint32_t>(stream_of_[key]),
                           false,
                           {},
                           /*streamed=*/true};
      }
      if (e.host_run) {
        if (host_run == nullptr) {
          host_run = &e;
          host_key = key;
        }
        continue;
      }
      waiting = true;
    }
    // Nothing loaded is ready: the host works meanwhile.
    if (host_run != nullptr) {
      host_run->needed = false;
      return ReadyExpert{host_key % options_.num_experts, 0, /*on_host=*/true, {}};
    }
    if (!waiting) return NotFound("expert cache: every expert of the layer was handed out");
    bool reading = false;  // A needed expert is still being read from disk.
    if (options_.tiered) {
      for (uint32_t key : layer_needed_) {
        const Entry& e = entries_[key];
        reading = reading || (e.needed && e.state == Residency::kLoading && !link_->Staged(key));
      }
    }
    const int64_t start = clock_.NowNs();
    Status s = WaitForLink();
    const int64_t stalled = clock_.NowNs() - start;
    layer_stall_ns_ += stalled;
    counters_[layer_].stall_ns += stalled;
    if (reading) counters_[layer_].disk_stall_ns += stalled;
    FMOE_RETURN_IF_ERROR(s);
  }
}

void ExpertCache::Done(uint32_t expert) {
  if (!in_layer_ || !Owns(layer_, expert)) return;
  const uint32_t key = Key(layer_, expert);
  Entry& e = entries_[key];
  e.pinned = false;
  if (!streaming_ || e.needed || stream_of_[key] < 0) return;
  const int32_t slot = stream_of_[key];
  if (stream_[slot].task != 0) return;  // Not handed out yet.
  // cuda: the next load into the slot waits for the kernels queued on it so far.
  stream_[slot].fence = link_->RecordComputeFence();
  ReleaseStream(static_cast<uint32_t>(slot), /*wasted=*/false);
  StreamTopUp();
}

void ExpertCache::RecordHostReadFailure(uint32_t expert, uint32_t failed_reads, bool gave_up) {
  if (!in_layer_ || !Owns(layer_, expert)) return;
  counters_[layer_].failed_loads += failed_reads;
  counters_[layer_].failed_experts += gave_up ? 1 : 0;
}

void ExpertCache::RecordHostRun(uint32_t expert, int64_t ns) {
  if (!in_layer_ || !Owns(layer_, expert)) return;
  const Entry& e = entries_[Key(layer_, expert)];
  if (!e.host_run || ns < 0) return;
  host_time_.Record(e.tokens, ns);
  counters_[layer_].host_ns += ns;
  // Shared among the sequences by their tokens.
  const size_t J = options_.num_experts;
  if (e.tokens == 0 || layer_sequence_counts_.size() != layer_usage_.size() * J) return;
  for (size_t s = 0; s < layer_usage_.size(); ++s) {
    const uint32_t n = layer_sequence_counts_[s * J + expert];
    layer_usage_[s]->host_ns += static_cast<int64_t>(static_cast<double>(ns) * n / e.tokens);
  }
}

void ExpertCache::SplitLayer() {
  missing_.clear();
  host_runs_planned_ = 0;
  uint32_t loading = 0;
  for (uint32_t key : layer_needed_) {
    const Entry& e = entries_[key];
    if (e.state == Residency::kLoading) ++loading;
    if (e.state != Residency::kOnHost) continue;
    // Tiered: an expert not in host memory is read from disk whichever way it runs; the read
    // feeds the link's copy (the tier pipelines them), so it goes to the link, and only experts
    // already in host memory are candidates for the host.
    if (options_.tiered && !link_->Staged(key)) {
      ++loading;
      continue;
    }
    missing_.push_back({key, std::max<uint32_t>(e.tokens, 1)});
  }
  if (missing_.empty()) return;
  // The layer's loads already on the link go first.
  const std::vector<bool> on_host =
      SplitMissing(missing_, load_ns_, loading * load_ns_, host_time_);
  CacheCounters& c = counters_[layer_];
  for (size_t i = 0; i < missing_.size(); ++i) {
    if (!on_host[i]) continue;
    entries_[missing_[i].key].host_run = true;
    ++host_runs_planned_;
    ++c.host_runs;
    c.bytes_not_moved += options_.expert_bytes;
  }
}

void ExpertCache::EndLayer() {
  if (!in_layer_) return;
  // cuda: the slots read by this layer may be overwritten only after its kernels.
  latest_fence_ = link_->RecordComputeFence();
  host_ran_.clear();
  for (uint32_t key : layer_needed_) {
    Entry& e = entries_[key];
    if (streaming_ && stream_of_[key] >= 0) {
      // Never handed out or never Done (a Forward that stopped): its slot goes after this layer.
      const int32_t slot = stream_of_[key];
      if (stream_[slot].task == 0) stream_[slot].fence = latest_fence_;
      ReleaseStream(static_cast<uint32_t>(slot), /*wasted=*/e.needed);
    }
    e.needed = false;
    e.pinned = false;
    if (e.host_run) host_ran_.push_back(key);
    e.host_run = false;
    e.failed_loads = 0;
    e.error = Status::Ok();
    if (latest_fence_ != 0 && e.slot >= 0) slot_fence_[e.slot] = 1;
  }
  layer_needed_.clear();
  host_runs_planned_ = 0;
  in_layer_ = false;
  Average(&layer_compute_ns_,
          static_cast<double>(clock_.NowNs() - layer_start_ns_ - layer_stall_ns_));
  if (full_) return;
  policy_->OnLayerEnd(layer_);
  Pump();
  if (options_.admit_host_runs) AdmitHostRuns();
}

void ExpertCache::AdmitHostRuns() {
  // Spare link time only. The layer just run needed no load on demand (a link that keeps up with
  // the misses; when it does not, the next layer's misses would queue behind an admission), and
  // the queued prefetches (the policy's own plan) come first.
  if (layer_loaded_on_demand_ || layer_stall_ns_ > 0) {
    host_ran_.clear();
    return;
  }
  for (uint32_t key : host_ran_) {
    if (inflight_on_demand_ > 0 || !queue_.empty() ||
        inflight_prefetches_ >= options_.max_inflight_prefetches) {
      break;
    }
    const Entry& e = entries_[key];
    if (e.state != Residency::kOnHost) continue;
    const uint32_t layer = key / options_.num_experts;
    const uint32_t expert = key % options_.num_experts;
    if (free_slots_.empty()) {
      bool victim_protected = false;
      const int32_t victim = Victim(/*force=*/false, &victim_protected);
      if (victim < 0) break;
      const double keep = policy_->EvictionScore(layer, expert);
      const double evict =
          policy_->EvictionScore(static_cast<uint32_t>(victim) / options_.num_experts,
                                 static_cast<uint32_t>(victim) % options_.num_experts);
      if (!(keep > evict)) continue;
    }
    const int32_t slot = TakeSlot(/*force=*/false);
    if (slot < 0) break;
    SubmitLoad(key, slot, /*on_demand=*/false, 0.0);
    ++counters_[layer].host_runs_admitted;
  }
  host_ran_.clear();
}

void ExpertCache::EndIteration() {
  if (in_layer_) EndLayer();
  if (streaming_) EndStream();
  in_iteration_ = false;
  started_ = Position(options_.num_layers - 1);
  DropStalePrefetches();
  for (Entry& e : entries_) {
    if (e.protect_until != 0 && e.protect_until <= started_) e.protect_until = 0;
  }
  if (!full_) policy_->OnIterationEnd();
}

void ExpertCache::OnRequestEnd(uint64_t request_id) {
  usage_.erase(request_id);
  policy_->OnRequestEnd(request_id);
}

RequestUsage ExpertCache::Usage(uint64_t request_id) const {
  auto it = usage_.find(request_id);
  return it == usage_.end() ? RequestUsage{} : it->second;
}

// ---- introspection ----

CacheStats ExpertCache::stats() const {
  CacheStats s;
  s.layers = counters_;
  for (const CacheCounters& c : counters_) s.total += c;
  s.directives = directives_;
  s.directives_stale = directives_stale_;
  s.directives_foreign = directives_foreign_;
  s.prefetch_requests_dropped = prefetch_requests_dropped_;
  s.preload_bytes = preload_bytes_;
  s.slots = active_slots();
  s.lent_slots = lent_;
  s.slots_lent = slots_lent_;
  s.expert_bytes = options_.expert_bytes;
  s.stream_slots = stream_slots();
  s.stream_iterations = stream_iterations_;
  for (const Entry& e : entries_) s.resident += e.state == Residency::kResident ? 1 : 0;
  return s;
}

Status ExpertCache::CheckInvariants() const {
  const auto broken = [](const std::string& what) {
    return Internal("expert cache invariant: " + what);
  };
  size_t used = 0;
  for (size_t s = 0; s < slot_owner_.size(); ++s) {
    const int32_t owner = slot_owner_[s];
    if (owner < 0) continue;
    ++used;
    const Entry& e = entries_[owner];
    if (e.slot != static_cast<int32_t>(s) || e.state == Residency::kOnHost) {
      return broken("slot " + std::to_string(s) + " owner " + std::to_string(owner) +
                    " does not hold it");
    }
  }
  size_t lent = 0;
  for (size_t s = 0; s < slot_lent_.size(); ++s) {
    if (slot_lent_[s] == 0) continue;
    ++lent;
    if (slot_owner_[s] != -1) return broken("lent slot " + std::to_string(s) + " has an owner");
  }
  if (lent != lent_) return broken("lent slots miscounted");
  if (used + free_slots_.size() + lent != slot_owner_.size()) {
    return broken(std::to_string(used) + " used + " + std::to_string(free_slots_.size()) +
                  " free + " + std::to_string(lent) +
                  " lent slots != " + std::to_string(slot_owner_.size()));
  }
  std::vector<bool> seen(slot_owner_.size(), false);
  for (int32_t s : free_slots_) {
    if (s < 0 || static_cast<size_t>(s) >= seen.size() || seen[s] || slot_owner_[s] != -1 ||
        slot_lent_[s] != 0) {
      return broken("free slot list is corrupt at slot " + std::to_string(s));
    }
    seen[s] = true;
  }
  size_t loading = 0;
  size_t on_demand = 0;
  for (size_t key = 0; key < entries_.size(); ++key) {
    const Entry& e = entries_[key];
    const std::string name = "expert " + std::to_string(key);
    if (e.host_run && (e.state != Residency::kOnHost || !in_layer_)) {
      return broken(name + " runs on the host but is not on the host in a running layer");
    }
    if (e.state == Residency::kOnHost) {
      if (e.slot != -1 || e.task != 0) return broken(name + " on host holds a slot or task");
    } else {
      if (key % options_.world_size != options_.rank) {
        return broken(name + " of another rank is on the device");
      }
      if (e.slot < 0 || slot_owner_[e.slot] != static_cast<int32_t>(key)) {
        return broken(name + " has no slot");
      }
    }
    if (e.state == Residency::kLoading) {
      ++loading;
      on_demand += e.on_demand ? 1 : 0;
      auto it = tasks_.find(e.task);
      if (it == tasks_.end() || it->second != key) return broken(name + " loads with no task");
    } else if (e.on_demand) {
      return broken(name + " is on demand but not loading");
    }
    if ((e.pinned || e.needed) && !in_layer_) return broken(name + " pinned between layers");
    if ((e.failed_loads != 0 || !e.error.ok()) && !in_layer_) {
      return broken(name + " failed outside a running layer");
    }
    if (!e.error.ok() && e.state != Residency::kOnHost) {
      return broken(name + " failed for the layer but is not on the host");
    }
    if (e.protect_until != 0 && e.protect_until <= started_) {
      return broken(name + " protected for a layer that started");
    }
    if (queue_index_[key] >= 0) {
      const QueuedPrefetch& q = queue_[queue_index_[key]];
      if (q.key != key || e.state != Residency::kOnHost || q.position <= started_) {
        return broken(name + " queued wrongly");
      }
    }
  }
  if (loading != tasks_.size() || on_demand != inflight_on_demand_ ||
      loading - on_demand != inflight_prefetches_) {
    return broken("transfers in flight do not match the loading experts");
  }
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (queue_index_[queue_[i].key] != static_cast<int32_t>(i)) return broken("queue index");
  }
  if (used > active_slots()) return broken("more experts on the device than slots");
  // The stream buffer.
  size_t held = 0;
  for (size_t s = 0; s < stream_.size(); ++s) {
    const StreamSlot& slot = stream_[s];
    const std::string name = "stream slot " + std::to_string(s);
    if (slot.key < 0 && slot.task == 0) continue;
    ++held;
    if (slot.key >= 0) {
      if (!in_iteration_) return broken(name + " holds an expert between iterations");
      if (stream_of_[slot.key] != static_cast<int32_t>(s)) return broken(name + " owner");
      if (entries_[slot.key].state != Residency::kOnHost) {
        return broken(name + " holds an expert that is also on the device");
      }
    }
    if (slot.task != 0) {
      auto it = stream_tasks_.find(slot.task);
      if (it == stream_tasks_.end() || it->second.first != s) return broken(name + " task");
    }
  }
  if (held + stream_free_.size() != stream_.size() || stream_tasks_.size() > held) {
    return broken("stream slots: " + std::to_string(held) + " held + " +
                  std::to_string(stream_free_.size()) +
                  " free != " + std::to_string(stream_.size()));
  }
  for (int32_t s : stream_free_) {
    if (stream_[s].key >= 0 || stream_[s].task != 0) return broken("free stream slot is held");
  }
  for (size_t key = 0; key < stream_of_.size(); ++key) {
    if (stream_of_[key] >= 0 && stream_[stream_of_[key]].key != static_cast<int32_t>(key)) {
      return broken("expert " + std::to_string(key) + " streamed in a slot it does not hold");
    }
  }
  size_t queued = 0;
  for (uint8_t q : stream_queued_) queued += q;
  if (queued != stream_queue_.size() || (!streaming_ && queued != 0)) {
    return broken("stream queue");
  }
  return Status::Ok();
}

}  // namespace fmoe
