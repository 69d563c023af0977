// Expert cache manager (DESIGN section 6, fMoE section 4.5): keeps a byte budget of this rank's
// routed experts in device slots, brings the rest in over the TransferEngine ahead of use as the
// policy asks, loads a missed expert on demand at once (prefetching paused meanwhile), and
// evicts by the policy's score. Torch-free: it moves bytes between host addresses and slots;
// CachedExperts (cached_experts.h) turns slots into tensors for the model.
//
// Threads: every method on the engine thread only, except PostDirective (any thread: it only
// enqueues; the engine thread applies directives at its next call).
//
// An expert's residency (Entry::state), and the methods that move it:
//   ON_HOST --Submit (BeginLayer/Next on a miss; Pump for a queued prefetch)--> LOADING
//   LOADING --transfer done (Pump/Next)--> RESIDENT;  LOADING --transfer cancelled--> ON_HOST
//   LOADING --transfer failed (its read did; tiered)--> ON_HOST, the slot freed; an expert the
//     running layer needs is loaded once more on demand (TopUp: one retry, a transient error
//     passes), and when that fails too it is FAILED for the layer: Next hands it out with the
//     read's error (ReadyExpert::error) instead of failing the layer, and EndLayer clears it
//     (ON_HOST: a later layer or iteration that picks it loads it afresh).
//   RESIDENT --BeginLayer picks it--> RESIDENT pinned --Done--> RESIDENT
//   RESIDENT (unpinned, unprotected) --Evict, to free a slot for a load--> EVICTING -> ON_HOST:
//     the slot passes to the next load with the compute fence of its last reader (cuda: the
//     copy stream waits for that event before overwriting; cpu: compute is synchronous).
// Hybrid execution (options.hybrid): BeginLayer sends each of the running layer's experts that is
// ON_HOST either to the link (LOADING, as above) or to the host (hybrid_split.h), whichever
// finishes the layer sooner (tiered: only experts whose bytes are in host memory, Staged, may go
// to the host); a host run stays ON_HOST, takes no slot and is handed out by Next
// with on_host set; its time comes back through RecordHostRun. After the layer, a host-run expert
// the policy values above the expert it would evict is loaded as a prefetch when the link has
// spare time (options.admit_host_runs).
// Protection: an expert prefetched (or re-requested while resident) for a layer that has not
// run yet is not evicted, unless an on-demand load of the running layer finds no other slot
// (counted as forced_evictions): the running layer must always make progress.
// Streaming (DESIGN section 14; AttachStreamBuffer, StreamNextIteration): an iteration told to
// stream leaves the slots alone. What is resident serves as usual; every other expert of this
// rank in layer l + 1 is copied into a buffer of stream slots beside the cache while layer l
// runs (layer 0's from BeginIteration), before layer l + 1's routing is known, so a long
// prefill that needs nearly every expert overlaps its loads with the layer before instead of
// loading on demand and evicting the decode working set. A stream slot is free again once its
// expert is Done (cuda: after a compute fence recorded then); experts layer l + 1 then does not
// route to are dropped (stream_wasted). Nothing is evicted, prefetched or run on the host
// (hybrid) in such an iteration; the entries of streamed experts stay ON_HOST.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "gpu_worker/cache/hybrid_split.h"
#include "gpu_worker/cache/policies/cache_policy.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"
#include "gpu_worker/core/sequence.h"

namespace fmoe {

struct ExpertCacheOptions {
  uint32_t num_layers = 0;   // L MoE layers. Required.
  uint32_t num_experts = 0;  // J routed experts per layer. Required.
  uint32_t top_k = 0;        // K. Required.
  uint32_t rank = 0;         // This rank owns experts with (l * J + j) % world_size == rank.
  uint32_t world_size = 1;
  size_t expert_bytes = 0;  // Bytes of one expert (every expert has the same shape). Required.
  // Slots: experts the device budget holds, 1..owned experts. Required.
  uint32_t slots = 0;
  // Bytes from one slot to the next (>= expert_bytes); 0 = expert_bytes. One device budget with
  // the KV pool (LendSlot) makes slots pages that also hold whole KV blocks. Default: 0
  size_t slot_stride = 0;
  // Prefetch transfers handed to the link at once; the rest wait in the cache's queue, where
  // directives can still re-rank or drop them. Default: 2
  uint32_t max_inflight_prefetches = 2;
  // Fill the slots with experts in (layer, expert) order at start, as a warm cache. Default: on
  bool preload = true;
  // Hybrid execution: run a missing expert on the host instead of loading it when that finishes
  // the layer sooner (hybrid_split.h). Default: off
  bool hybrid = false;
  // Hybrid: after a layer, load an expert it ran on the host with the link's spare time (the
  // layer loaded nothing on demand and did not stall; nothing queued; a prefetch window free)
  // when the policy values it above what it would evict for it (the fmoe policies: the maps
  // predict its reuse). Default: on
  bool admit_host_runs = true;
  // The link finds each expert's bytes itself from TransferTask::key (TieredLink, the host tier
  // in front of the disk): `host` holds no addresses, a load may fail (its read did), and
  // prefetches the link window has no room for yet are hinted to it. Default: off
  bool tiered = false;
};

// Converts a manifest budget into slots: `gb` (1e9 bytes) when set, else `fraction` of the
// rank's own experts (rounded down, at least 1). kInvalidArgument when the budget holds no
// expert.
Result<uint32_t> BudgetSlots(std::optional<double> gb, std::optional<double> fraction,
                             size_t expert_bytes, uint32_t owned_experts);

struct CacheCounters {
  uint64_t hits = 0;               // Needed and resident when its layer started.
  uint64_t misses = 0;             // Needed and not resident (includes late prefetches).
  uint64_t late_prefetches = 0;    // Needed while its prefetch was still on the link.
  uint64_t on_demand_loads = 0;    // Loads started because a layer needed the expert.
  uint64_t prefetches_issued = 0;  // Prefetch loads handed to the link.
  uint64_t prefetches_used = 0;    // Prefetched experts a layer then used (late ones included).
  uint64_t prefetches_wasted = 0;  // Prefetched, evicted or passed without use.
  uint64_t prefetches_cancelled = 0;
  uint64_t evictions = 0;
  uint64_t forced_evictions = 0;    // Protected experts evicted for an on-demand load.
  uint64_t bytes_moved = 0;         // Host to device, partial cancelled copies included.
  int64_t stall_ns = 0;             // Compute waiting for experts.
  uint64_t host_runs = 0;           // Missing experts run on the host instead (hybrid).
  int64_t host_ns = 0;              // Time of those runs.
  uint64_t bytes_not_moved = 0;     // Their bytes, which stayed on the host.
  uint64_t host_runs_admitted = 0;  // Host-run experts then loaded with spare link time.
  // Tiered link: misses whose bytes were not in host memory either (read from disk first), and
  // the part of stall_ns spent waiting while a needed expert was still being read.
  uint64_t disk_reads = 0;
  int64_t disk_stall_ns = 0;
  // Loads the link reported failed (their source could not be read; retries included), and
  // experts handed to a layer as failed (ReadyExpert::error) after their retry failed too.
  uint64_t failed_loads = 0;
  uint64_t failed_experts = 0;
  // Streamed iterations: loads into the stream buffer, and those whose layer then did not use
  // the expert (loaded ahead of its routing, or cancelled on the way).
  uint64_t stream_loads = 0;
  uint64_t stream_wasted = 0;
  CacheCounters& operator+=(const CacheCounters& o);
};

struct CacheStats {
  std::vector<CacheCounters> layers;  // Per MoE layer.
  CacheCounters total;
  uint64_t directives = 0;          // Applied.
  uint64_t directives_stale = 0;    // For a layer already started or an old iteration: dropped.
  uint64_t directives_foreign = 0;  // Entries for experts another rank owns: ignored.
  uint64_t prefetch_requests_dropped = 0;  // Queued prefetches whose layer started first.
  uint64_t preload_bytes = 0;
  uint32_t slots = 0;       // Slots the cache holds now (lent ones not counted).
  uint32_t lent_slots = 0;  // Slots lent to the KV pool now.
  uint64_t slots_lent = 0;  // Lendings since start.
  uint32_t resident = 0;
  size_t expert_bytes = 0;
  uint32_t stream_slots = 0;       // The stream buffer's slots (0: none).
  uint64_t stream_iterations = 0;  // Iterations that streamed.
};

// An expert ready for the running layer: its bytes are in slot `slot` until Done. Or, when
// `error` is not ok, an expert whose load failed twice (its read did): it has no bytes this
// layer, and the caller computes nothing for it (still calling Done).
struct ReadyExpert {
  uint32_t expert = 0;
  uint32_t slot = 0;      // Unless on_host or failed.
  bool on_host = false;   // Hybrid: run it on the host from its host copy; report RecordHostRun.
  Status error;           // Not ok: the load's error (tiered: names the file and the tensor).
  bool streamed = false;  // `slot` is a stream slot (AttachStreamBuffer), until Done.
};

class ExpertCache final : public CacheControl {
 public:
  // `host[l * J + j]`: the expert's bytes in host memory (nullptr for experts other ranks own;
  // every one nullptr with options.tiered).
  // `slot_memory`: slots * expert_bytes bytes on the device end of `link`. The cache does not
  // own the memory; it owns the policy. `clock` times stalls.
  static Result<std::unique_ptr<ExpertCache>> Create(ExpertCacheOptions options,
                                                     std::unique_ptr<CachePolicy> policy,
                                                     TransferEngine* link,
                                                     std::vector<const void*> host,
                                                     void* slot_memory, Clock& clock);
  ~ExpertCache() override;

  // ---- the forward pass, in order ----
  void BeginIteration(std::span<const SequenceInfo> sequences);
  // Speculative gates for a later layer, computed before BeginLayer(layer).
  void Speculate(uint32_t layer, uint32_t target, std::span<const float> probs);
  // Pins what is resident of this rank's experts in `routing`, starts on-demand loads for the
  // rest. kInvalidArgument for a layer out of order or an expert out of range.
  Status BeginLayer(const LayerRouting& routing);
  // The next of this layer's experts (this rank's only) that is ready, the resident ones first
  // in ascending order, then the others as their loads finish; blocks meanwhile. An expert whose
  // load failed (after one retry) is handed out with ReadyExpert::error set; the layer goes on.
  // kNotFound when every one has been handed out; kUnavailable if the link stops answering.
  Result<ReadyExpert> Next();
  // The compute on an expert from Next is finished: unpins it.
  void Done(uint32_t expert);
  // A host run handed out by Next took `ns` (before its Done): feeds the host time model and the
  // figures.
  void RecordHostRun(uint32_t expert, int64_t ns);
  // A host run handed out by Next whose host copy could not be read (a host tier's read):
  // `failed_reads` reads failed, and when `gave_up` the running layer goes on without it. Counts
  // as the link's failed loads do (failed_loads, failed_experts).
  void RecordHostReadFailure(uint32_t expert, uint32_t failed_reads, bool gave_up);
  // Waits for the link to finish a transfer and applies it: a copy's end releases the host slot
  // it pinned, so a host run that found every host slot held by loads on their way to the device
  // gets one. kNotFound when nothing is on the link (no slot will come free that way).
  Status AwaitTransfer();
  // Host runs the running layer has (hybrid).
  uint32_t host_runs_planned() const { return host_runs_planned_; }
  void EndLayer();
  void EndIteration();
  void OnRequestEnd(uint64_t request_id);
  // A request's figures; zero for one the cache has not seen or that has ended.
  RequestUsage Usage(uint64_t request_id) const;

  // Any thread.
  void PostDirective(PrefetchDirective directive);
  // Drains finished transfers and directives and tops up the link. Between layers, often.
  void Pump();

  // The policy's, or 0 when the budget holds every expert of this rank (nothing to predict).
  uint32_t speculation_distance() const {
    return holds_every_expert() ? 0 : policy_->speculation_distance();
  }
  // The slots hold every expert this rank owns: nothing would ever be evicted.
  bool holds_every_expert() const { return active_slots() >= owned_; }

  // ---- one device budget with the KV pool (DESIGN section 14), between iterations ----
  // A slot for the KV pool: a free one, else the resident expert the policy values least is
  // evicted (unprotected ones first); while every slot is loading, it waits for a load to finish.
  // nullopt when the cache would keep fewer than max(keep, 1) slots, inside an iteration's
  // layer, or when the link fails.
  std::optional<uint32_t> LendSlot(uint32_t keep);
  // A lent slot back (free; the next load into it waits for the latest compute fence, as KV
  // reads of it may still run). A slot not lent is ignored.
  void ReturnSlot(uint32_t slot);
  uint32_t active_slots() const { return options_.slots - lent_; }

  // ---- streaming (header comment), between iterations ----
  // `slots` stream slots of expert_bytes each, one after the other from `memory` (on the
  // device end of the link; not owned). Once. kInvalidArgument for none; kFailedPrecondition
  // inside an iteration or when one is attached already.
  Status AttachStreamBuffer(void* memory, uint32_t slots);
  // The next iteration streams (no effect without a stream buffer, or when every expert is
  // resident for good). Cleared by BeginIteration.
  void StreamNextIteration() { stream_next_ = !stream_.empty(); }
  uint32_t stream_slots() const { return static_cast<uint32_t>(stream_.size()); }
  // The running iteration streams.
  bool streaming() const { return streaming_; }
  uint32_t lent_slots() const { return lent_; }
  const ExpertCacheOptions& options() const { return options_; }
  const CachePolicy& policy() const { return *policy_; }
  CacheStats stats() const;
  // kInternal describing the first broken invariant (tests).
  Status CheckInvariants() const;

  // CacheControl.
  uint32_t num_layers() const override { return options_.num_layers; }
  uint32_t num_experts() const override { return options_.num_experts; }
  uint32_t top_k() const override { return options_.top_k; }
  uint32_t slots() const override { return active_slots(); }
  // Experts this rank owns, and the moving average of one expert's transfer (0 before any).
  uint32_t owned() const { return owned_; }
  double load_ns() const { return load_ns_; }
  bool Owns(uint32_t layer, uint32_t expert) const override;
  uint32_t current_layer() const override { return layer_; }
  void Prefetch(uint32_t layer, uint32_t expert, double priority) override;
  void ClearPrefetches() override;

 private:
  enum class Residency : uint8_t { kOnHost, kLoading, kResident };
  struct Entry {
    Residency state = Residency::kOnHost;
    int32_t slot = -1;
    bool pinned = false;         // Picked by the running layer and not Done.
    bool needed = false;         // Picked by the running layer and not yet handed out by Next.
    bool on_demand = false;      // Loading for the running layer (or promoted to it).
    bool prefetched = false;     // Resident or loading through a prefetch, not used since.
    uint64_t protect_until = 0;  // Position of the layer it is protected for (0 = none).
    uint64_t task = 0;           // Transfer id while loading.
    bool host_run = false;       // Hybrid: the running layer runs it on the host.
    uint32_t tokens = 0;         // Tokens routed to it by the running layer.
    // Loads of it that failed while the running layer needed it (the first is retried).
    uint8_t failed_loads = 0;
    Status error;  // FAILED for the running layer: the last failed load's error.
  };
  // BeginLayer (hybrid): picks the running layer's experts to run on the host.
  void SplitLayer();
  // EndLayer (hybrid): loads the layer's host-run experts worth keeping with spare link time.
  void AdmitHostRuns();
  struct QueuedPrefetch {
    uint32_t key = 0;
    uint64_t position = 0;  // Target layer's position.
    double priority = 0.0;
  };

  ExpertCache(ExpertCacheOptions options, std::unique_ptr<CachePolicy> policy, TransferEngine* link,
              std::vector<const void*> host, void* slot_memory, Clock& clock);
  Status Preload();
  uint64_t Position(uint32_t layer) const { return iteration_ * options_.num_layers + layer; }
  uint64_t RunningPosition() const { return Position(layer_); }
  uint32_t Key(uint32_t layer, uint32_t expert) const {
    return layer * options_.num_experts + expert;
  }
  bool Evictable(const Entry& e) const;
  // The resident expert TakeSlot would evict (key), -1 when none; `is_protected` tells whether it
  // is protected (only chosen with `force`).
  int32_t Victim(bool force, bool* is_protected) const;
  // A free slot, evicting if needed (`force`: protected experts too); -1 when none.
  int32_t TakeSlot(bool force);
  void Evict(uint32_t key);
  void SubmitLoad(uint32_t key, int32_t slot, bool on_demand, double priority);
  void Complete(const TransferDone& done);
  void ApplyDirectives();
  void ApplyDirective(const PrefetchDirective& d);
  // Tiered: a directive's likeliest experts hinted to the link (the host tier reads ahead).
  void HintDirective(const PrefetchDirective& d);
  void TopUp();
  bool DeadlineAllows(const QueuedPrefetch& q, uint32_t ahead) const;
  // Predicted ns until `position` runs (layers ahead x a layer's compute); -1 before a measure.
  int64_t UseInNs(uint64_t position) const;
  void DropStalePrefetches();
  void RemoveQueued(size_t index);
  Status WaitForLink();

  // Streaming. A stream slot holds `key`'s bytes (or is loading them while task != 0); a slot
  // whose load was cancelled keeps its task, with key -1, until the link reports it.
  struct StreamSlot {
    int32_t key = -1;
    uint64_t task = 0;
    uint64_t fence = 0;  // The next load into it waits for this compute fence (0: none).
  };
  // Queues the loads of `layer`'s experts of this rank that are neither on the device nor
  // streamed nor queued; layers are queued in order, each once an iteration.
  void QueueStreamLayer(uint32_t layer);
  // Starts queued stream loads in free stream slots, in queue order; a load the running layer
  // needs takes the slot of a later layer's expert when none is free.
  void StreamTopUp();
  bool StealStreamSlot();
  void CompleteStream(uint32_t slot, uint32_t key, const TransferDone& done);
  // Frees a stream slot (ready) or cancels its load; `wasted` counts its expert as unused.
  void ReleaseStream(uint32_t slot, bool wasted);
  void DequeueStream(uint32_t key);
  void EndStream();
  bool LinkBusy() const { return !tasks_.empty() || !stream_tasks_.empty(); }

  ExpertCacheOptions options_;
  std::unique_ptr<CachePolicy> policy_;
  TransferEngine* link_;
  std::vector<const void*> host_;
  char* slots_base_;
  Clock& clock_;

  std::vector<Entry> entries_;       // By key = l * J + j.
  std::vector<int32_t> slot_owner_;  // Key in each slot, -1 = free.
  std::vector<uint8_t> slot_fence_;  // 1: read since its last load; wait for a fence.
  std::vector<uint8_t> slot_lent_;   // 1: lent to the KV pool (neither free nor owned).
  uint32_t lent_ = 0;
  uint64_t slots_lent_ = 0;
  size_t slot_stride_ = 0;
  uint64_t latest_fence_ = 0;  // Recorded after the last layer's compute.
  std::vector<int32_t> free_slots_;
  std::vector<QueuedPrefetch> queue_;             // Unordered; picked by priority.
  std::vector<int32_t> queue_index_;              // By key: index in queue_, -1 = not queued.
  std::unordered_map<uint64_t, uint32_t> tasks_;  // Transfer id -> key.
  std::unordered_map<uint64_t, uint32_t> batch_;  // Request id -> iteration, this batch.
  std::vector<uint64_t> batch_order_;             // Request ids in sequence order.
  std::unordered_map<uint64_t, RequestUsage> usage_;
  std::vector<RequestUsage*> layer_usage_;  // Scratch: usage_ of each sequence, this layer.
  std::vector<uint32_t> layer_needed_;      // This rank's experts of the running layer.
  // Per sequence of the batch, its tokens per expert of the running layer (row-major [s x J]).
  std::vector<uint32_t> layer_sequence_counts_;
  HostTimeModel host_time_;                  // Hybrid: measured host run times.
  uint32_t host_runs_planned_ = 0;           // Host runs of the running layer.
  std::vector<MissingExpert> missing_;       // Scratch.
  std::vector<uint32_t> host_ran_;           // Scratch: keys the last layer ran on the host.
  std::vector<TransferDone> done_;           // Scratch.
  std::vector<PrefetchEntry> hint_scratch_;  // Scratch (HintDirective).
  uint32_t owned_ = 0;                       // Experts this rank owns.
  // The budget holds every expert and all were preloaded: nothing will ever move, so the
  // policy is not consulted (its predictions could not change anything).
  bool full_ = false;
  uint64_t next_task_ = 1;
  uint64_t iteration_ = 0;  // Iterations begun so far (positions count from 1).
  uint32_t layer_ = 0;
  uint64_t started_ = 0;  // Position of the last layer started.
  bool in_layer_ = false;
  bool in_iteration_ = false;
  uint32_t inflight_prefetches_ = 0;
  uint32_t inflight_on_demand_ = 0;
  int64_t layer_start_ns_ = 0;
  int64_t layer_stall_ns_ = 0;
  bool layer_loaded_on_demand_ = false;  // The running layer submitted an on-demand load.
  double layer_compute_ns_ = 0.0;        // Moving average of a layer's compute (no stall).
  double load_ns_ = 0.0;                 // Moving average of one expert's transfer.

  char* stream_base_ = nullptr;
  std::vector<StreamSlot> stream_;
  std::vector<int32_t> stream_free_;
  std::vector<int32_t> stream_of_;      // By key: its stream slot, -1 = none.
  std::vector<uint8_t> stream_queued_;  // By key: in stream_queue_.
  std::deque<uint32_t> stream_queue_;   // Keys to load, in order.
  // Transfer id -> (stream slot, key at submission).
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> stream_tasks_;
  uint32_t stream_layers_queued_ = 0;  // This iteration's layers [0, n) are queued.
  bool streaming_ = false;
  bool stream_next_ = false;
  uint64_t stream_iterations_ = 0;

  std::vector<CacheCounters> counters_;
  uint64_t directives_ = 0, directives_stale_ = 0, directives_foreign_ = 0;
  uint64_t prefetch_requests_dropped_ = 0, preload_bytes_ = 0;

  std::mutex inbox_mu_;
  std::vector<PrefetchDirective> inbox_;  // GUARDED_BY(inbox_mu_)
};

}  // namespace fmoe
