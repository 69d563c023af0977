// CachedExperts: the ExpertSource the worker serves with when experts are offloaded. Owns the
// host expert store (every expert of this rank packed once in host memory, page-locked in cuda
// mode), the device slot pool, the transfer engine (emulated link in cpu mode, CUDA copy stream
// in cuda mode) and the ExpertCache that decides what lives in the slots; turns a slot into the
// expert's weight tensors for the model. With hybrid execution on, a missing expert the cache
// sends to the host comes out of Next as views of its host copy (the model runs it with the CPU
// kernel, cpu_expert.h) and its time is measured from Next to Done; in cpu mode that time is
// stretched by host_slowdown, the emulated host compute rate. Engine thread only, except
// PostDirective and stats (any thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "common/clock.h"
#include "gpu_worker/cache/expert_cache.h"
#include "gpu_worker/cache/store/host_tier.h"
#include "gpu_worker/core/kv_blocks.h"
#include "gpu_worker/experts/expert_source.h"

namespace fmoe {

struct CachedExpertsOptions {
  std::string policy = "fmoe";  // A MakePolicy name. Default: fmoe
  uint32_t top_k = 0;           // The model's experts per token. Required.
  PolicyOptions policy_options;
  // Budget: at most one of the two; neither = every expert of this rank (fraction 1).
  std::optional<double> cache_gb;
  std::optional<double> cache_fraction;
  // Auto (manifest expert_cache_gb: auto), which overrides both: once this rank's host store is
  // packed, slots = (memory_utilization x the link's free device bytes - reserve_bytes) /
  // expert bytes, at most every expert it owns; kResourceExhausted naming the figures when not
  // one fits. The figures are logged.
  bool cache_auto = false;
  double memory_utilization = 0.9;  // (0, 1]. Default: 0.9
  uint64_t reserve_bytes = 0;       // Kept free (the KV reserve). Default: 0
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t max_inflight_prefetches = 2;  // Default: 2
  bool preload = true;                   // Default: on
  LinkOptions link;                      // cpu mode: the emulated link.
  int cuda_index = -1;                   // >= 0: cuda mode on that device.
  // Hybrid execution (expert_cache.h): run a missing expert on the host when that finishes the
  // layer sooner. Needs float32, bfloat16 or quantized experts in cuda mode. Default: off
  bool hybrid = false;
  // Hybrid: admit a host-run expert with the link's spare time (expert_cache.h). Default: on
  bool admit_host_runs = true;
  // cpu mode: a host run takes this many times its real time (>= 1), as the emulated link paces
  // copies, so the split sees a host slower than the compute device. Default: 1
  double host_slowdown = 1.0;
  // The host tier (DESIGN section 13), for experts the loader left on disk
  // (RuntimeOptions::experts_on_disk): a host cache of host_cache_gb (1e9 bytes) or
  // host_cache_fraction of this rank's experts (at most one), read from the checkpoint's files
  // as they are needed; neither = a slot for every expert. host_cache_auto overrides both: every
  // expert when they fit in the host's available memory less host_reserve_bytes, else what fits
  // (at least one). Experts in memory (not left on disk) take none of these.
  std::optional<double> host_cache_gb;
  std::optional<double> host_cache_fraction;
  bool host_cache_auto = false;
  uint64_t host_reserve_bytes = uint64_t{4} << 30;  // Default: 4 GiB
  DiskReaderOptions disk;                           // The host tier's reader.
  // Tests: wraps the host tier's reader (fault injection: reads of chosen bytes fail).
  // Default: none
  std::function<std::unique_ptr<DiskReader>(std::unique_ptr<DiskReader>)> wrap_disk_reader;
  // One device budget for the experts and the KV pool (DESIGN section 14; the manifest's
  // `memory`), which overrides cache_gb, cache_fraction and cache_auto: the slot memory is the
  // whole budget cut into pages, each an expert's bytes rounded up to a multiple of
  // `page_quantum` (one KV block of every full-attention layer) so that a page holds either an
  // expert or whole KV blocks. The first pages are the KV pool's for good (kv_floor of the
  // budget, at least one page, and every page beyond one per owned expert); the others are
  // slots the pool borrows as sequences need blocks (kv_arena()) while at least expert_floor of
  // the budget (at least one slot) stays the experts'.
  struct SharedBudget {
    std::optional<double> device_gb;  // (0, 100000]: the budget in 1e9 bytes; else
    double device_fraction = 0.9;     // (0, 1] of the link's free bytes after the dense weights.
    double kv_floor = 0.1;            // [0, 1)
    double expert_floor = 0.1;        // [0, 1)
    uint64_t page_quantum = 0;        // Required (> 0).
  };
  std::optional<SharedBudget> shared;
  // A stream buffer of this many experts beside the slots (ExpertCache::AttachStreamBuffer), for
  // iterations told to stream (StreamNextIteration); allocated before the budget is sized, so
  // cache_auto and a shared budget's device_fraction see it taken; none when a fixed budget
  // holds every expert this rank owns. 0: none. Default: 0
  uint32_t stream_slots = 0;
};

class CachedExperts final : public ExpertSource, public KvPageLender {
 public:
  // Takes the experts the loader read (host memory, compute dtype); experts other ranks own may
  // be undefined tensors. kInvalidArgument for a budget that holds no expert or a bad policy.
  static Result<std::unique_ptr<CachedExperts>> Create(ExpertTable experts,
                                                       const CachedExpertsOptions& options,
                                                       Clock& clock = SteadyClock::Get());
  ~CachedExperts() override;

  void BeginIteration(std::span<const SequenceInfo> sequences) override;
  uint32_t speculation_distance() const override;
  void Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) override;
  Status BeginLayer(const LayerRouting& routing) override;
  // An expert the cache hands out failed (its load failed twice), or a host run whose read into
  // the host tier failed, comes out failed with that error.
  Result<SourcedExpert> Next() override;
  void Done(uint32_t expert) override;
  bool HostRunsPlanned() const override;
  void EndLayer() override;
  void EndIteration() override;
  void OnRequestEnd(uint64_t request_id) override;
  RequestUsage Usage(uint64_t request_id) const override { return cache_->Usage(request_id); }
  bool StreamNextIteration() override;

  // Any thread.
  void PostDirective(PrefetchDirective directive);
  // Refreshed at the end of every iteration; any thread.
  CacheStats stats() const;
  TransferStats link_stats() const;
  // The host tier's figures; nullopt without one (experts in memory). Any thread.
  std::optional<HostTierStats> host_tier_stats() const;
  const ExpertCache& cache() const { return *cache_; }
  ExpertCache& cache() { return *cache_; }

  // With a shared budget: the pages the KV pool lives in; nullopt without one.
  std::optional<KvArena> kv_arena();
  // KvPageLender (engine thread, between iterations): page floor_pages + s is the cache's slot s.
  std::optional<uint32_t> Lend() override;
  void Return(uint32_t page) override;

 private:
  CachedExperts() = default;
  // Where one stored tensor of an expert sits in its packed bytes.
  struct PartLayout {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    size_t offset = 0;  // From the expert's first byte.
  };
  // Create's steps: the table checked and one expert's layout taken (returns the experts this
  // rank owns); every owned expert packed into the host store (its tensors in ExpertWeights::
  // Tensors order; quantized experts' tensors 64-byte aligned; the table's tensors released;
  // returns each expert key's address, null for another rank's); each device slot's weight views,
  // made once (a slot's address never changes).
  Result<uint32_t> TakeShape(const ExpertTable& experts, const CachedExpertsOptions& options);
  Result<std::vector<const void*>> PackHost(ExpertTable* experts,
                                            const CachedExpertsOptions& options, uint32_t owned);
  void MakeSlotViews(uint32_t slots, const CachedExpertsOptions& options);
  // A shared budget's pages: sets page_bytes_, pages_, kv_floor_pages_, expert_floor_slots_ and
  // returns the cache's slots.
  Result<uint32_t> PlanSharedBudget(const CachedExpertsOptions& options, uint32_t owned);
  // An expert's tensors over its packed bytes at `base`, on `device`.
  ExpertWeights ViewsAt(char* base, at::Device device) const;
  // Unpins the host tier's copy of the host run that just finished (with a tier).
  void ReleaseHostKey();
  // The host tier's slot for `key`: while every host slot is pinned by a transfer in flight it
  // waits for the cache's next transfer to finish (which unpins one) and tries again; with none in
  // flight the exhaustion is the error.
  Result<const void*> AcquireHostSlot(uint32_t key);
  size_t expert_bytes() const { return expert_bytes_; }
  // Slot 0's first byte (after a shared budget's KV floor pages).
  char* SlotBase() const {
    return static_cast<char*>(slots_) + size_t{kv_floor_pages_} * page_bytes_;
  }

  // With experts on disk: the host tier; the cache's link is a TieredLink in front of it.
  // Returns the experts' addresses (all null: the link finds them by key).
  Result<std::vector<const void*>> MakeHostTier(const ExpertTable& experts,
                                                const CachedExpertsOptions& options,
                                                uint32_t owned);
  std::unique_ptr<HostTier> tier_;
  std::unique_ptr<TransferEngine> link_;
  std::unique_ptr<ExpertCache> cache_;
  void* host_ = nullptr;  // Packed experts, expert_bytes_ apart.
  size_t host_bytes_ = 0;
  void* slots_ = nullptr;                  // The device memory (with a shared budget: every page).
  std::vector<ExpertWeights> slot_views_;  // Per slot: its expert's tensors over its bytes.
  void* stream_ = nullptr;                 // The stream buffer (options.stream_slots).
  std::vector<ExpertWeights> stream_views_;  // Per stream slot.
  // A shared budget (0 pages without): pages of page_bytes_; the slots begin after the KV
  // pool's floor pages.
  uint64_t page_bytes_ = 0;
  uint32_t pages_ = 0;
  uint32_t kv_floor_pages_ = 0;
  uint32_t expert_floor_slots_ = 0;
  std::vector<const void*> host_addresses_;  // Per expert key: its packed host copy.
  bool cuda_ = false;
  double host_slowdown_ = 1.0;
  // The host run handed out by Next and not yet Done (one at a time: the model runs it at once).
  int64_t host_expert_ = -1;
  int64_t host_key_ = -1;  // Its key, pinned in the host tier (with one).
  bool on_disk_ = false;   // The experts were left on disk: a host tier.
  int64_t host_start_ns_ = 0;
  QuantSpec quant_;                            // The experts' stored format (kNone: float).
  std::array<bool, kExpertPlaces> present_{};  // Per ExpertWeights::Places entry: stored.
  std::vector<PartLayout> layout_;  // Per stored tensor, in ExpertWeights::Tensors order.
  size_t expert_bytes_ = 0;         // One expert's packed bytes (with alignment padding).

  mutable std::mutex stats_mu_;
  CacheStats stats_;  // GUARDED_BY(stats_mu_)
};

}  // namespace fmoe
