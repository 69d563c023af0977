// SimTieredLink (DESIGN sections 11 and 13): the replay's disk tier. A host cache of
// `host_slots` experts in front of a simulated disk, ahead of the simulated device link
// (sim_link.h, owned), as one TransferEngine for an ExpertCache with options.tiered: what
// TieredLink and HostTier do in the worker, in simulated time; nothing is read or copied. Time is
// the replay's ManualClock: every call first runs the disk and the link up to it, their events in
// time order; Wait advances the clock to the next event until a task finishes. The serving
// replay's run owns one. One thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench/fmoe_bench/sim_link.h"
#include "common/clock.h"
#include "common/status.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe::bench {

// The disk tier's figures, for `fmoe-bench replay` (flags --host-budget, --disk-*).
struct DiskModel {
  // Host cache, as a fraction of the L * J experts, (0, 1]; 0: no disk tier (every expert in
  // host memory, as without these flags). Default: 0
  double host_budget = 0;
  // Disk bandwidth, 10^9 bytes/s. Default: 1.1, this dev VM's virtio disk (vda) with O_DIRECT
  // for 8-64 MiB reads at queue depth 1-16 (fio randread io_uring bs=8M: 1.05-1.19 GB/s).
  double gbps = 1.1;
  // Per expert read, us. Default: 57, the mean latency of fio's 4 KiB O_DIRECT random reads at
  // queue depth 1 (io_uring) on the same disk (three 5 s runs: 55.8-57.1 us; bench/README.md).
  double latency_us = 57;
  // Expert reads in flight at once (sharing the bandwidth). Default: 8 (DiskReader's)
  uint32_t queue_depth = 8;
  // Reads started by Hint in flight at once, at most (HostTier's max_prefetch_reads); within
  // it a hinted read starts only in the disk's spare time, as in HostTier::Prefetch. Default: 4
  uint32_t max_hinted_reads = 4;
  // The host cache starts with the first host slots' worth of experts in (layer, expert) order,
  // as if filled at start-up; off: empty. Default: on
  bool warm = true;
  // The host cache's eviction score: kPolicy, the device cache's policy score (the same
  // predicted next use, as the worker's host tier); kLoads, its own: the loads it served per
  // expert (the device's misses), every count halved each 32 x host slots loads (measured in
  // bench/RESULTS.md, "A host-cache score of its own"). Default: kPolicy
  enum class Score : uint8_t { kPolicy, kLoads };
  Score score = Score::kPolicy;

  bool enabled() const { return host_budget > 0; }
  // One expert read alone: latency + bytes / bandwidth (>= 1 ns).
  int64_t ReadNs(double expert_bytes) const;
  // "host cache 25% of the experts (416 of 1664, warm at start), disk 1.10 GB/s + 57 us per
  // read, ...: an expert read alone 0.414 ms".
  std::string Describe(uint32_t experts, double expert_bytes) const;
};

// kInvalidArgument naming the field out of range.
Status ValidateDiskModel(const DiskModel& model);

struct SimTierOptions {
  uint32_t experts = 0;     // L * J (key = layer * J + expert). Required.
  uint32_t host_slots = 0;  // Experts the host cache holds, 1..experts. Required.
  double expert_bytes = 0;  // The bytes one expert read moves from disk (> 0). Required.
  DiskModel disk;           // Bandwidth, latency, queue depth, hinted reads, warm start.
};

// Counters since creation; the replay takes differences.
struct SimTierStats {
  uint64_t loads = 0;         // Tasks submitted (each a load of one expert to the device).
  uint64_t host_hits = 0;     // ... whose expert was in host memory at Submit (no read waited for).
  uint64_t disk_reads = 0;    // Expert reads finished, hinted ones included.
  uint64_t hinted_reads = 0;  // Reads started by Hint.
  // Hints not read: an urgent read was queued or on the disk (yielded); the expert's predicted
  // use came before the read's expected end (late).
  uint64_t hints_yielded = 0;
  uint64_t hints_late = 0;
  double bytes_read = 0;   // disk_reads * expert_bytes.
  uint64_t evictions = 0;  // Experts dropped from the host cache.
  // Time the compute waited (inside Wait, which the cache calls only when it must have a load
  // to go on) while at least one on-demand task (the running layer needs its expert) was still
  // waiting for its expert's read, i.e. before its copy could start. The rest of a stall is the
  // device link's.
  int64_t disk_stall_ns = 0;

  double host_hit_rate() const { return loads ? double(host_hits) / double(loads) : 0.0; }
};

// A task:  WAITING (its expert is not in host memory: a read) --read done--> COPYING (on the
//   link, the expert pinned) --copy done--> done (unpinned; start_ns = the Submit when it
//   waited, so the cache's load time sees the disk).  WAITING --Cancel--> done cancelled at once
//   (the read goes on into the host cache).  WAITING --Promote--> its read urgent.
// An expert (host cache):  ABSENT --Request, a slot--> READING --read done--> RESIDENT;
//   ABSENT --Request, no slot--> QUEUED --a slot frees--> READING;  ABSENT --Hint, in the disk's
//   spare time (no urgent read queued or on the disk, the predicted use no sooner than the mean
//   read time x (hinted reads under way + 1)), fewer than max_hinted_reads hinted reads, a free
//   slot or an unpinned expert scoring below it--> READING;
//   RESIDENT unpinned and not held --evicted for another (lowest score, LRU on ties)--> ABSENT.
//   Requested experts are held (not evicted) until their task pins them or is cancelled.
// The disk: at most queue_depth expert reads at once; each waits `latency`, then moves its
// bytes at disk_gbps shared equally by the reads moving bytes; the next read to start is the
// oldest urgent one (an on-demand task's, or promoted), then the oldest other; a started read is
// not preempted (as DiskReader).
class SimTieredLink final : public TransferEngine {
 public:
  // `copy_ns`: one expert over the device link (> 0). kInvalidArgument for bad options.
  static Result<std::unique_ptr<SimTieredLink>> Create(ManualClock& clock, int64_t copy_ns,
                                                       const SimTierOptions& options);
  ~SimTieredLink() override;

  // The eviction score (lower goes first), as the cache's policy gives it. Default: 0 for
  // every expert (least recently used).
  void set_score(std::function<double(uint32_t key)> score) { score_ = std::move(score); }

  std::string_view name() const override { return "simulated behind a host tier"; }
  void Submit(const TransferTask& task) override;
  void Cancel(uint64_t id) override;
  void Promote(uint64_t id) override;
  // As HostTier::Prefetch: `use_in_ns` negative is unknown (not checked).
  void Hint(uint32_t key, int64_t use_in_ns) override;
  // In the host cache as of the last call (the cache's disk-read counters ask it).
  bool Staged(uint32_t key) const override { return Resident(key); }
  size_t Poll(std::vector<TransferDone>* out) override;
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) override;
  TransferStats stats() const override { return link_.stats(); }
  Result<void*> AllocateDevice(size_t bytes) override { return link_.AllocateDevice(bytes); }
  void FreeDevice(void* ptr) override { link_.FreeDevice(ptr); }

  const SimTierStats& tier_stats() const { return stats_; }
  bool Resident(uint32_t key) const;
  uint32_t resident() const { return static_cast<uint32_t>(resident_.size()); }
  // Expert reads on the disk now (at most disk.queue_depth).
  size_t reads_in_flight() const { return inflight_.size(); }
  // Urgent reads queued for a slot or for the disk, or on it.
  uint32_t urgent_pending() const { return urgent_pending_; }
  // The moving mean of expert reads' times (slot taken to last byte), ns; 0 before the first.
  double read_ns_mean() const { return read_ns_mean_; }
  // kInternal naming the first broken invariant (tests).
  Status CheckInvariants() const;

 private:
  enum class State : uint8_t { kAbsent, kQueued, kReading, kResident };
  struct Entry {
    State state = State::kAbsent;
    uint32_t pins = 0;
    bool held = false;    // Requested and not pinned (or released) since: not evicted.
    bool urgent = false;  // Its read goes before the others.
    bool hinted = false;  // Read by Hint; counts against max_hinted_reads while reading.
    uint64_t last_use = 0;
  };
  struct Read {
    uint32_t key = 0;
    uint64_t seq = 0;      // Order of arrival on the disk queue.
    int64_t ready_ns = 0;  // In flight: the end of its latency.
    double left = 0;       // Bytes still to move.
    int64_t start_ns = 0;  // StartRead.
  };
  struct Task {
    TransferTask task;
    bool copying = false;
    int64_t wait_ns = -1;  // Submit, when it waited for a read; -1 when it did not.
  };

  SimTieredLink(ManualClock& clock, int64_t copy_ns, const SimTierOptions& options);
  // Runs the disk and the link up to `now`, in event order; `stalled`: the compute waits
  // meanwhile (disk stall accrues).
  void AdvanceTo(int64_t now, bool stalled);
  // The next disk event (a read's latency ends or its last byte arrives); INT64_MAX when idle.
  int64_t NextDiskEvent() const;
  int64_t NextEvent() const;
  void RunDisk(int64_t to);  // Moves the bytes of the reads in flight up to `to` (<= events).
  void FinishReads();        // Reads whose bytes are all in: RESIDENT, waiting tasks copy.
  void RunLink(int64_t to);  // The link's clock to `to`, its finished copies out.
  void ToLink(Task& t);
  void StartDisk();
  bool TakeSlot(const double* below);
  void StartRead(uint32_t key);
  void StartQueued();
  void Request(uint32_t key, bool urgent);
  void Release(uint32_t key);
  void Unpin(uint32_t key);
  double Score(uint32_t key) const {
    if (options_.disk.score != DiskModel::Score::kPolicy) return uses_[key];
    return score_ ? score_(key) : 0.0;
  }
  // A load of `key`, for the tier's own score.
  void CountLoad(uint32_t key);

  ManualClock& clock_;
  ManualClock link_clock_;  // The link's own: set to each event's time as it is run.
  SimLink link_;
  SimTierOptions options_;
  double bytes_per_ns_;
  int64_t latency_ns_;
  std::function<double(uint32_t)> score_;
  int64_t now_ = 0;  // Time the tier has run to.
  std::vector<Entry> entries_;
  std::vector<uint32_t> resident_;  // Keys of RESIDENT experts.
  uint32_t reading_ = 0;            // READING experts (a slot each).
  uint32_t hinted_reading_ = 0;
  uint32_t urgent_pending_ = 0;  // QUEUED or READING entries with urgent set.
  double read_ns_mean_ = 0;
  std::vector<uint32_t> slot_queue_;  // QUEUED keys, in request order.
  std::vector<Read> disk_queue_;      // Waiting for the disk.
  std::vector<Read> inflight_;        // On the disk.
  uint64_t next_seq_ = 0;
  uint64_t use_clock_ = 0;
  std::vector<double> uses_;  // The own score's counts (DiskModel::score).
  uint64_t loads_since_halving_ = 0;
  std::unordered_map<uint64_t, Task> tasks_;
  std::vector<TransferDone> done_;
  std::vector<TransferDone> copies_;  // Scratch.
  SimTierStats stats_;
};

}  // namespace fmoe::bench
