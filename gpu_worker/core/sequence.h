// The per-iteration vocabulary shared by the model, the expert sources, the cache and its
// policies, the observers and the group's plans: which sequences an iteration runs, what the gate
// picked for one MoE layer, and a request's expert figures. Plain structs, Torch-free.
#pragma once

#include <cstdint>
#include <span>

namespace fmoe {

struct SequenceInfo {
  uint64_t request_id = 0;
  // The request's Forwards before this one: 0 = its first (prompt tokens); a prompt prefilled in
  // chunks takes several (gpu_worker/core/scheduler.h).
  uint32_t iteration = 0;
  uint32_t tokens = 0;  // New tokens this iteration.
  // The new tokens are prompt tokens (the prefill or a chunk of it), not a decode step. Always
  // true at iteration 0.
  bool prefill = false;

  bool in_prefill() const { return prefill || iteration == 0; }
};

// One request's expert figures so far (its share of the batch's hits, misses and the bytes of
// the loads its misses started).
struct RequestUsage {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t bytes_moved = 0;
  uint64_t host_runs = 0;        // Hybrid: missing experts its tokens had run on the host.
  int64_t host_ns = 0;           // Those runs' time, shared among the requests by tokens.
  uint64_t bytes_not_moved = 0;  // Their bytes, which stayed on the host.
  // Host tier: misses whose experts were not in host memory either (read from disk first).
  uint64_t disk_reads = 0;
};

// The gate's decision for one MoE layer of the running batch.
struct LayerRouting {
  uint32_t layer = 0;
  std::span<const uint32_t> experts;  // Sorted, unique experts used (every rank's).
  std::span<const uint32_t> tokens;   // Tokens routed to each of `experts`.
  // Iteration-level expert activation, row-major [sequences x J]: tokens of sequence s routed
  // to expert j (the rows of MoE-Infinity's iteration EAM). Sequences in OnIterationStart order.
  std::span<const uint32_t> sequence_counts;
};

}  // namespace fmoe
