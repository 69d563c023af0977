// HostTier (DESIGN section 13): the middle of a rank's three tiers of routed experts. A budget of
// host-memory slots, each one expert's packed bytes (the layout the expert store and the device
// slots use), in front of the checkpoint's files: an expert that is not in a slot is read from
// its file (DiskReader, O_DIRECT) into one, its stored tensors each read from their own extent.
// The device link copies from a slot (TieredLink pins it for the copy) and hybrid execution
// computes from one. When no slot is free, the unpinned expert with the lowest score goes (the
// device cache's eviction score, the same predicted next use), least recently used first on
// ties; a request finding every slot pinned or being read waits for one. Reads ahead (Prefetch)
// get only the disk's spare time: none starts while a read a device load waits for (urgent) is
// queued or reading, nor when the expert's predicted use comes sooner than a read would end.
//
// Torch-free. Threads: every method on one thread (the engine thread), except stats (any). The
// reader's threads read; finished expert reads come back through Poll/Wait. A split region
// (RegionSplit) is read into a staging buffer and scattered into the slot on the reader's
// finishing thread (DiskReader::Submit's `then`) before its read comes back.
//
// An expert's state:  ABSENT --Request--> QUEUED (no slot yet) --slot--> READING
//   READING --every extent read--> RESIDENT;  READING --an extent failed--> ABSENT (error out)
//   RESIDENT --Pin/Unpin (counted)--> RESIDENT;  RESIDENT unpinned --evicted--> ABSENT
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "gpu_worker/cache/store/disk_reader.h"

namespace fmoe {

// A stored region split into parts (gpt-oss's fused experts: gate and up interleave in one
// tensor, and its float layout is [in, out]): the region is a [rows, cols] matrix of elem_bytes
// elements, and part p is its rows p, p + ways, ... (by_columns false) or its columns p,
// p + ways, ... transposed to rows (by_columns true), written contiguous at part_dst[p] (from
// the expert's first packed byte); ways = part_dst.size(). Empty part_dst: no split.
struct RegionSplit {
  bool by_columns = false;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint32_t elem_bytes = 0;  // 1, 2 or 4.
  std::vector<uint64_t> part_dst;
};

// Writes each part of `region` (rows x cols elements) to `expert` + part_dst[p]. The split must
// be one HostTier::Create accepts.
void ScatterRegion(const RegionSplit& split, const char* region, char* expert);

// One stored region of an expert: where its bytes are in a file, where they go in the expert:
// as read at dst_offset, or (split.part_dst not empty) read into a staging buffer and scattered
// into the parts.
struct ExpertExtent {
  uint32_t file = 0;    // A DiskReader file index.
  uint64_t offset = 0;  // In the file.
  uint64_t bytes = 0;
  uint64_t dst_offset = 0;  // From the expert's first packed byte.
  std::string tensor;       // The tensor's name, for messages.
  RegionSplit split;
};

struct HostTierOptions {
  uint32_t num_experts = 0;  // J, for messages (key = layer * J + expert). Required.
  size_t expert_bytes = 0;   // One expert's packed bytes. Required.
  uint32_t slots = 0;        // Experts the host budget holds, >= 1. Required.
  // Prefetch reads (whole experts) in flight or queued at once, at most; more are dropped.
  // Within it a prefetch starts only in the disk's spare time (Prefetch). Default: 4
  uint32_t max_prefetch_reads = 4;
};

// A finished expert read.
struct TierDone {
  uint32_t key = 0;
  // kDataLoss / kIoError "host tier: expert E of layer L: tensor \"NAME\": PATH: bytes [A, B):
  // ..." when a read failed (the expert is ABSENT again; a later Request retries).
  Status status;
  int64_t start_ns = 0;  // Steady clock: the first extent's submit, the last extent's end.
  int64_t end_ns = 0;
};

struct HostTierStats {
  uint64_t hits = 0;    // Pin found the expert resident.
  uint64_t misses = 0;  // Request found it absent: a disk read.
  uint64_t reads = 0;   // Expert reads finished, failed ones included.
  uint64_t read_errors = 0;
  uint64_t bytes_read = 0;
  int64_t read_ns = 0;   // Sum over finished reads of their time (submit to end).
  int64_t stall_ns = 0;  // Time Acquire blocked for a read.
  uint64_t evictions = 0;
  uint64_t prefetches = 0;       // Reads Prefetch started.
  uint64_t prefetches_used = 0;  // Prefetched experts pinned afterwards.
  // Prefetches not started: an urgent read was queued or reading (yielded); the expert's
  // predicted use came before the read's expected end (late).
  uint64_t prefetches_yielded = 0;
  uint64_t prefetches_late = 0;
  uint32_t slots = 0;
  uint32_t resident = 0;
};

class HostTier {
 public:
  // `extents[key]`: the expert's stored tensors (empty for experts another rank owns; each
  // within expert_bytes). `reader` has the files the extents name added. kInvalidArgument for
  // bad options or extents; kResourceExhausted when the slots cannot be allocated.
  static Result<std::unique_ptr<HostTier>> Create(const HostTierOptions& options,
                                                  std::vector<std::vector<ExpertExtent>> extents,
                                                  std::vector<std::string> file_paths,
                                                  std::unique_ptr<DiskReader> reader);
  ~HostTier();

  // The slots' memory (64-byte aligned), for the device link to register.
  void* memory() const { return memory_; }
  size_t memory_bytes() const { return memory_bytes_; }
  uint32_t slots() const { return options_.slots; }
  std::string_view backend() const { return reader_->backend(); }

  // The eviction score (lower goes first). Default: every expert 0 (least recently used).
  void set_score(std::function<double(uint32_t key)> score) { score_ = std::move(score); }
  bool Owns(uint32_t key) const { return key < entries_.size() && !extents_[key].empty(); }
  bool Resident(uint32_t key) const;

  // The expert's bytes, pinned (not evicted until Unpin), when resident; nullptr otherwise.
  const void* Pin(uint32_t key);
  void Unpin(uint32_t key);
  // Starts reading `key` unless it is resident or being read; `urgent` reads go before the
  // others, and raise a queued read. The expert is held for the requester: once read it is not
  // evicted before its next Pin (or Release). A key this rank does not own comes back as a
  // failed read.
  void Request(uint32_t key, bool urgent);
  // The requester no longer wants `key` (a cancelled load): it may be evicted once read.
  void Release(uint32_t key);
  // Reads `key` ahead of use, in the disk's spare time only: when no urgent read is queued or
  // reading (one would share the disk with it), the read is expected to end before the use
  // `use_in_ns` from now (negative: unknown, not checked), fewer than max_prefetch_reads
  // prefetches are under way, and a slot is free or an unpinned expert scores below it;
  // otherwise does nothing. Expected end: the mean of recent reads' times (submit to end) x
  // (prefetches under way + 1), the reader taking one read at a time.
  void Prefetch(uint32_t key, int64_t use_in_ns = -1);
  // Reads a device load waits for (urgent), queued or reading.
  uint32_t urgent_pending() const { return urgent_pending_; }
  // The moving mean of expert reads' times, ns; 0 before the first.
  double read_ns_mean() const { return read_ns_mean_; }
  // Finished expert reads, without blocking / waiting up to `timeout` for one.
  size_t Poll(std::vector<TierDone>* out);
  size_t Wait(std::vector<TierDone>* out, std::chrono::milliseconds timeout);
  // Reads not finished (queued for a slot or reading).
  size_t pending() const { return queued_.size() + reading_; }
  // Request(urgent) and wait for it: the expert pinned, or the read's error
  // (kResourceExhausted when every slot is pinned). Every read finished meanwhile, its own
  // included, still comes out of the next Poll/Wait.
  Result<const void*> Acquire(uint32_t key);

  // Any thread.
  HostTierStats stats() const;
  // kInternal naming the first broken invariant (tests).
  Status CheckInvariants() const;

 private:
  enum class State : uint8_t { kAbsent, kQueued, kReading, kResident };
  struct Entry {
    State state = State::kAbsent;
    int32_t slot = -1;
    uint32_t pins = 0;
    uint32_t parts_left = 0;
    bool urgent = false;
    bool held = false;        // Requested and not pinned since: not evicted.
    bool prefetched = false;  // Read by Prefetch and not pinned since.
    uint64_t last_use = 0;
    int64_t start_ns = 0;
    Status error;  // The first failed extent's.
  };
  HostTier(const HostTierOptions& options, std::vector<std::vector<ExpertExtent>> extents,
           std::vector<std::string> file_paths, std::unique_ptr<DiskReader> reader);
  // A free slot, evicting the lowest-scored unpinned resident expert if needed (only one that
  // scores below `below` when given); -1 when none.
  int32_t TakeSlot(const double* below);
  void StartRead(uint32_t key, int32_t slot);
  void StartQueued();
  void Drain(const std::vector<ReadDone>& reads, std::vector<TierDone>* out);
  std::string Name(uint32_t key) const;
  void Publish();

  HostTierOptions options_;
  std::vector<std::vector<ExpertExtent>> extents_;
  std::vector<std::string> paths_;
  std::unique_ptr<DiskReader> reader_;
  std::function<double(uint32_t)> score_;
  void* memory_ = nullptr;
  size_t memory_bytes_ = 0;
  std::vector<Entry> entries_;
  std::vector<int32_t> slot_owner_;  // Key per slot, -1 = free.
  std::vector<int32_t> free_slots_;
  std::vector<uint32_t> queued_;  // Keys waiting for a slot, in request order.
  std::unordered_map<uint64_t, std::pair<uint32_t, size_t>> reads_;  // Read id -> key, extent.
  // Staging buffers of split regions' reads in flight, by read id, and spare ones for reuse.
  struct Staging {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
  };
  std::unordered_map<uint64_t, Staging> staged_;
  std::vector<Staging> spare_staging_;
  std::vector<TierDone> kept_;  // Finished while Acquire waited for another.
  std::vector<ReadDone> scratch_;
  uint64_t next_read_ = 1;
  uint64_t clock_ = 0;  // Use counter for LRU.
  uint32_t reading_ = 0;
  uint32_t prefetching_ = 0;
  uint32_t urgent_pending_ = 0;  // Entries QUEUED or READING with urgent set.
  double read_ns_mean_ = 0.0;
  HostTierStats counters_;

  mutable std::mutex stats_mu_;
  HostTierStats published_;  // GUARDED_BY(stats_mu_)
};

}  // namespace fmoe
