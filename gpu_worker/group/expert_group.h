// The expert-parallel group a rank belongs to (DESIGN section 7): the ranks of one worker group,
// joined through c10d. Rank 0 serves a TCPStore at the group's rendezvous address; every rank
// connects to it, and the collectives run over ProcessGroupGloo (cpu mode, and cuda mode when
// LibTorch has no NCCL) or ProcessGroupNCCL (CUDA builds of LibTorch with NCCL).
//
// Three collectives, each bounded by the collective timeout; a failure (a peer died, a timeout)
// breaks the group for good: that call and every later one return kUnavailable naming the
// operation, the rank and the cause, and the rank is expected to leave (the launcher restarts
// the whole group).
//   CombineDisjoint  the per-layer exchange of routed-expert outputs. Each element is nonzero on
//                    at most one rank (the rank that owns the expert), so the bytes are summed
//                    as integers: the result is every rank's part, bit for bit, whatever the
//                    dtype and whatever order the backend reduces in. A group of any size
//                    computes exactly what one rank computes alone.
//   Broadcast        rank 0's bytes (the iteration plan) to every rank.
//   SumCounters      int64 sums (expert figures of the group).
// One thread calls the collectives (the engine's or the follower's); stats() from any thread.
// A group of one rank has no process group: every call returns at once.
//
// Liveness (liveness_timeout > 0, Gloo groups): a thread of each rank adds to its counter in rank
// 0's store every liveness_interval, over a connection of its own; rank 0's thread watches every
// rank's counter. A collective waits in slices of at most 100 ms and breaks the group, without
// waiting out the collective timeout, once a rank's counter has not moved for liveness_timeout
// (rank 0) or this rank's own additions have not gone through for that long (a rank cut off from
// rank 0's host). A cut link is then noticed in about liveness_timeout instead of the collective
// timeout: nothing closes a socket when a link is cut.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"

namespace fmoe {

// How sums across the ranks run: kAuto picks all-gather and a local sum for a Gloo group of two
// ranks (2-5 times faster than Gloo's all-reduce there) and all-reduce otherwise (Gloo with
// three or more ranks, NCCL).
enum class SumAlgorithm { kAuto, kAllReduce, kAllGather };

struct ExpertGroupOptions {
  std::string group;               // Name, for messages. Required.
  uint32_t rank = 0;               // Default: 0
  uint32_t world_size = 1;         // Default: 1
  std::string rendezvous_host;     // Rank 0's TCPStore. Required when world_size > 1.
  uint16_t rendezvous_port = 0;    // Required when world_size > 1.
  std::string host = "127.0.0.1";  // This rank's address: Gloo's transport binds to it.
  int cuda_index = -1;             // >= 0: cuda mode (NCCL when LibTorch has it). Default: -1
  std::chrono::milliseconds rendezvous_timeout{120000};  // Default: 120 s
  std::chrono::milliseconds collective_timeout{60000};   // Default: 60 s
  SumAlgorithm sum_algorithm = SumAlgorithm::kAuto;      // Default: auto
  std::chrono::milliseconds liveness_interval{250};      // Default: 250 ms
  std::chrono::milliseconds liveness_timeout{0};         // 0: no liveness thread. Default: 0
};

// What this rank sent through the group, for logs, heartbeats and the benchmarks.
struct GroupStats {
  uint64_t combines = 0;    // CombineDisjoint calls.
  uint64_t broadcasts = 0;  // Broadcast calls.
  uint64_t sums = 0;        // SumCounters calls.
  // Payload bytes this rank contributed (the tensor of a combine, the counters of a sum, the
  // plan when it is rank 0). The wire carries about 2 (n - 1) / n times a combine's payload.
  uint64_t payload_bytes = 0;
  uint64_t wait_us = 0;  // Time inside collectives, waiting for peers included.
};

class ExpertGroup {
 public:
  // Rendezvous and connection; kUnavailable (a peer did not come within the rendezvous
  // timeout, the store's port is taken, the host is not an address of this machine) naming it.
  static Result<std::unique_ptr<ExpertGroup>> Join(const ExpertGroupOptions& options);
  ~ExpertGroup();

  uint32_t rank() const { return options_.rank; }
  uint32_t world_size() const { return options_.world_size; }
  const std::string& backend() const { return backend_; }  // "none", "gloo" or "nccl".
  bool failed() const;
  // Why the group broke; Ok while it works.
  Status failure() const;

  // In place; `t` must be contiguous, of the same shape and dtype on every rank.
  Status CombineDisjoint(at::Tensor& t);
  // Rank 0's `bytes` replace every other rank's.
  Status Broadcast(std::vector<uint8_t>* bytes);
  Status SumCounters(std::span<int64_t> values);
  // Every rank's `values` become their element-wise minimum over the group (the same count on
  // every rank; a sum of world_size x values.size() counters).
  Status MinAcrossRanks(std::span<int64_t> values);
  GroupStats stats() const;

 private:
  struct Impl;
  explicit ExpertGroup(ExpertGroupOptions options);
  Status Fail(const std::string& op, const std::string& why);

  ExpertGroupOptions options_;
  std::string backend_ = "none";
  std::unique_ptr<Impl> impl_;
  mutable std::mutex mu_;
  GroupStats stats_;  // GUARDED_BY(mu_)
  Status failure_;    // GUARDED_BY(mu_); set once.
};

}  // namespace fmoe
